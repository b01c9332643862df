"""Real CUDA tests: skipped without an NVIDIA GPU, deliberately hostile with one.

With a GPU, the pytest parent initializes CUDA at import time, as vLLM's conftest once
did: a fork-based runner then fails every test with "Cannot re-initialize CUDA in
forked subprocess", and spawned children must still work.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import ModuleType

import pytest

import spawnrun

HERE = Path(__file__).parent
#: The pytest parent's pid, inherited by spawned children through the environment.
PARENT_PID_ENV = "SPAWNRUN_GPU_PARENT_PID"


def _skip_reason() -> str | None:
    # Decide without importing torch: on CPU machines that import is slow and pointless.
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0"):
        return "no NVIDIA GPU on this machine"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if os.environ.get("SPAWNRUN_GPU_PARENT_INIT", "1") != "1" and not spawnrun.is_child():
        # Even is_available() opens the driver (about 14 MiB on an H200): with the
        # deliberate init off, the parent leaves CUDA alone entirely.
        return None
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if not spawnrun.is_child():
        # On purpose: the parent now holds a CUDA context (children must not).
        # SPAWNRUN_GPU_PARENT_INIT=0 turns this off to show the plugin itself makes none.
        torch.zeros(1, device="cuda")
    return None


SKIP_REASON = _skip_reason()


def pytest_configure(config: pytest.Config) -> None:
    if not spawnrun.is_child():
        os.environ[PARENT_PID_ENV] = str(os.getpid())


def pytest_unconfigure(config: pytest.Config) -> None:
    if not spawnrun.is_child():
        os.environ.pop(PARENT_PID_ENV, None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SKIP_REASON is None:
        return
    # This hook sees the whole session's items: touch only those under tests/gpu.
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)


@pytest.fixture
def torch() -> ModuleType:
    """torch, imported only by tests that run (never at collection on CPU machines)."""
    return pytest.importorskip("torch")
