"""GPU failures that must stay inside their own child. Run on purpose only:

    SPAWNRUN_GPU_CRASH_DEMO=1 python -m pytest tests/gpu/test_cuda_crashes.py

Expected: the first three FAIL (device-side assert; killed at the timeout; SIGSEGV),
and the last one PASSES on the same device afterwards.
"""

from __future__ import annotations

import os
import signal
import time
from types import ModuleType

import pytest

import spawnrun

pytestmark = pytest.mark.skipif(
    os.environ.get("SPAWNRUN_GPU_CRASH_DEMO") != "1",
    reason="expected failures; set SPAWNRUN_GPU_CRASH_DEMO=1 to run them",
)

#: If the timeout does not fire, the "hang" ends after this many seconds and fails.
HANG_CAP_S = 60.0


@pytest.fixture
def spawned() -> None:
    # These tests wreck their process; in-process (--no-spawn) that would be pytest's.
    if not spawnrun.is_child():
        pytest.skip("crash demo runs only in a spawned child")


@pytest.mark.gpu
def test_1_device_side_assert(torch: ModuleType, spawned: None) -> None:
    x = torch.zeros(4, device="cuda")
    x[torch.tensor([10], device="cuda")]  # out of bounds: asserts in the kernel
    torch.cuda.synchronize()


@pytest.mark.gpu(timeout=10)
def test_2_gpu_hang_hits_timeout(torch: ModuleType, spawned: None) -> None:
    # Each spin kernel keeps the GPU busy for about a second; the timeout should kill us.
    deadline = time.monotonic() + HANG_CAP_S
    while time.monotonic() < deadline:
        torch.cuda._sleep(1 << 31)
        torch.cuda.synchronize()
    pytest.fail(f"not killed by the 10 s timeout within {HANG_CAP_S:.0f} s")


@pytest.mark.gpu
def test_3_segfault_after_cuda(torch: ModuleType, spawned: None) -> None:
    assert torch.ones(8, device="cuda").sum().item() == 8
    os.kill(os.getpid(), signal.SIGSEGV)


@pytest.mark.gpu
def test_4_device_still_healthy(torch: ModuleType) -> None:
    assert not torch.cuda.is_initialized()
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    assert x.sum().item() == 999 * 1000 / 2
