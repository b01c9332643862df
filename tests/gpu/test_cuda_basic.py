"""CUDA works in spawned children although the pytest parent holds a CUDA context."""

from __future__ import annotations

import os
from types import ModuleType

import pytest

import spawnrun

PARENT_PID_ENV = "SPAWNRUN_GPU_PARENT_PID"  # set by conftest.py in the parent
GIB = 1 << 30

# Exit codes of the forked child in the control test.
FORK_FAILED_AS_EXPECTED = 0
FORK_OTHER_ERROR = 1
FORK_CUDA_WORKED = 2


@pytest.mark.gpu
def test_fresh_process(torch: ModuleType) -> None:
    # Checked before any CUDA call: a spawned child starts with no context at all.
    assert not torch.cuda.is_initialized()
    assert spawnrun.is_child()
    assert os.getpid() != int(os.environ[PARENT_PID_ENV])


@pytest.mark.gpu
def test_matmul_matches_cpu(torch: ModuleType) -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(512, 256, generator=gen, dtype=torch.float64)
    b = torch.randn(256, 128, generator=gen, dtype=torch.float64)
    # float64 keeps TF32 and reduction order out of the comparison.
    got = (a.cuda() @ b.cuda()).cpu()
    torch.testing.assert_close(got, a @ b)


@pytest.mark.gpu
def test_allocate_one_gib(torch: ModuleType) -> None:
    before = torch.cuda.memory_allocated()
    x = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before >= GIB
    del x
    assert torch.cuda.memory_allocated() == before


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # os.fork in a threaded process
def test_control_fork_after_cuda_init_fails(torch: ModuleType) -> None:
    """Unmarked: runs in the parent and shows what spawning avoids."""
    torch.zeros(1, device="cuda")  # already done by conftest in the parent; cheap
    pid = os.fork()
    if pid == 0:
        # Forked child: report through the exit code only, and never return to pytest.
        code = FORK_OTHER_ERROR
        try:
            torch.zeros(1, device="cuda")
            code = FORK_CUDA_WORKED
        except RuntimeError as exc:
            if "Cannot re-initialize CUDA in forked subprocess" in str(exc):
                code = FORK_FAILED_AS_EXPECTED
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == FORK_FAILED_AS_EXPECTED
