"""Budgets on a real GPU: torch is capped when its CUDA comes up, exclusive tests run alone."""

from __future__ import annotations

import os
from types import ModuleType

import pytest

GIB = 1 << 30


@pytest.mark.gpu(memory="2GiB")
def test_budget_caps_torch_at_its_first_cuda_call(torch: ModuleType) -> None:
    assert int(os.environ["SPAWNRUN_GPU_BUDGET"]) == 2 * GIB
    assert not torch.cuda.is_initialized()  # the cap did not create a context
    ok = torch.empty(GIB // 4, dtype=torch.float32, device="cuda")  # 1 GiB
    total = torch.cuda.get_device_properties(0).total_memory
    assert torch.cuda.get_per_process_memory_fraction(0) == pytest.approx(2 * GIB / total)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(3 * GIB // 4, dtype=torch.float32, device="cuda")  # 3 GiB more
    del ok


@pytest.mark.gpu(exclusive=True)
def test_exclusive_finds_the_device_to_itself(torch: ModuleType) -> None:
    assert "SPAWNRUN_GPU_BUDGET" not in os.environ
    free, total = torch.cuda.mem_get_info()
    # Nothing of this run beside it: only its own context (and foreign processes).
    assert free > 0.9 * total
