"""Real multi-GPU scheduling: busy tests spread over the GPUs, and a two-GPU NCCL test.

Records (when SPAWNRUN_GPU_RECORDS names a folder) which device each busy test saw and
when, so ``benchmarks/gpu_scheduling.py`` can check exclusivity and the speedup.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import ModuleType

import pytest

BUSY_SECONDS = 2.0


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(8))
def test_busy(torch: ModuleType, i: int) -> None:
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.time()
    while time.time() - start < BUSY_SECONDS:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    end = time.time()
    folder = os.environ.get("SPAWNRUN_GPU_RECORDS")
    if folder:
        record = {"uuid": uuid, "start": start, "end": end, "pid": os.getpid()}
        (Path(folder) / f"busy{i}.json").write_text(json.dumps(record))


def _allreduce_worker(rank: int, world: int, init_file: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    t = torch.full((1024,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    assert t.eq(sum(range(1, world + 1))).all().item(), t[:4]
    dist.destroy_process_group()


@pytest.mark.gpu(count=2)
def test_nccl_allreduce_across_its_two_gpus(torch: ModuleType, tmp_path: Path) -> None:
    assert len(os.environ["CUDA_VISIBLE_DEVICES"].split(",")) == 2
    assert torch.cuda.device_count() == 2
    torch.multiprocessing.spawn(
        _allreduce_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True
    )
