"""A child's side of a memory budget: enforced the moment its own CUDA comes up.

Runs in the child only (test children, spawned or forked). The parent puts the budget
in the child's environment before its interpreter (or its fork) starts:
``SPAWNRUN_GPU_BUDGET`` (bytes per device), and for JAX ``XLA_PYTHON_CLIENT_PREALLOCATE``
and ``XLA_PYTHON_CLIENT_MEM_FRACTION``, which JAX reads itself when it starts.

For torch, ``install`` queues the cap (``torch.cuda.set_per_process_memory_fraction``
on every visible device) with torch's own lazy-initialization queue, so it takes effect
when the test's first CUDA call initializes CUDA and never initializes CUDA itself: a
test that does not use the GPU never creates a context. torch may be imported before
``install`` (the fast mode's template preloads it) or later (a conftest, a test
module, the test body): an import hook covers the second case.

The budget caps torch's caching allocator only (not the CUDA context or cuBLAS's
workspace: the parent's reserve per process covers those). A test that runs out of
memory gets a report section naming its budget and its measured peak.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from spawnrun.child._afterimport import after_import
from spawnrun.devices._packing import show
from spawnrun.proc import _probe

BUDGET_ENV = "SPAWNRUN_GPU_BUDGET"
#: A lock file per device that children sharing it take while they create contexts.
INIT_LOCK_ENV = "SPAWNRUN_CUDA_INIT_LOCK"
INIT_LOCK_WAIT = 10.0
#: How many children sharing a device may create their contexts at once (0: no limit);
#: the parent's own value of this variable, if set, is passed on (a measurement switch).
INIT_SLOTS_ENV = "SPAWNRUN_CUDA_INIT_SLOTS"
INIT_SLOTS = 1
#: What the parent told the child about its budget, for the out-of-memory section.
SOURCE_ENV = "SPAWNRUN_GPU_BUDGET_SOURCE"
SECTION = "spawnrun: GPU memory budget"
#: JAX reads these itself when its backend starts.
XLA_PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"
XLA_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
#: What a child's budget puts in its environment (``_starting.child_env``): each test's
#: own, even in a process forked from a template that ran with another budget.
PER_TEST_ENV = frozenset(
    {BUDGET_ENV, SOURCE_ENV, INIT_LOCK_ENV, INIT_SLOTS_ENV, XLA_PREALLOCATE_ENV, XLA_FRACTION_ENV}
)


def budget() -> int | None:
    text = os.environ.get(BUDGET_ENV, "")
    return int(text) if text.isdigit() else None


def install() -> None:
    """Arrange for the budget to be applied when torch initializes CUDA."""
    if budget() is None:
        return
    after_import("torch.cuda", _queue)


def _queue(cuda: ModuleType) -> None:
    lazy_call = getattr(cuda, "_lazy_call", None)
    if lazy_call is None:
        return  # a torch without the queue: nothing safe to hook
    # _lazy_call runs the function at once if CUDA is already up, else at its init.
    lazy_call(_apply)


def _apply() -> None:
    torch: Any = sys.modules["torch"]
    cap = budget()
    if cap is None:
        return
    # Children sharing a device create their contexts one at a time: eight at once
    # each take several times as long as one alone.
    slots = os.environ.get(INIT_SLOTS_ENV, "")
    with _few_at_a_time(os.environ.get(INIT_LOCK_ENV, ""), int(slots) if slots.isdigit() else 0):
        for index in range(torch.cuda.device_count()):
            total = int(torch.cuda.get_device_properties(index).total_memory)
            if total > 0:
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
            torch.cuda.synchronize(index)  # the context, created now, under the lock


@contextlib.contextmanager
def _few_at_a_time(prefix: str, slots: int, limit: float = INIT_LOCK_WAIT) -> Iterator[None]:
    """One of ``slots`` exclusive ``flock`` files ``<prefix>-<i>``, waited for at most
    ``limit`` seconds (then the child goes on without one: a neighbour may be stuck)."""
    held = -1
    end = time.monotonic() + limit
    try:
        while prefix and slots > 0 and held < 0 and time.monotonic() < end:
            for slot in range(slots):
                try:
                    fd = os.open(f"{prefix}-{slot}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                except OSError:
                    break
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = fd
                    break
                except BlockingIOError:
                    os.close(fd)
            else:
                time.sleep(0.005)
                continue
            if held < 0:
                break  # the lock files cannot be made: no staggering
        yield
    finally:
        if held >= 0:
            os.close(held)  # closing the descriptor releases the lock


def out_of_memory_note(excinfo: Any) -> str:
    """The section for a test that ran out of device memory ("" for other failures)."""
    cap = budget()
    if cap is None or excinfo is None:
        return ""
    exc = excinfo.value
    text = f"{type(exc).__name__}: {exc}"
    if "out of memory" not in text.lower() and "OutOfMemory" not in type(exc).__name__:
        return ""
    peaks = _probe.reserved_peaks()
    peak = max(peaks) if peaks else None
    source = os.environ.get(SOURCE_ENV, "")
    lines = [
        f"this test ran with a GPU memory budget of {show(cap)} per device"
        + (f" ({source})" if source else "")
        + ", enforced as torch's per-process memory fraction",
        "its peak: "
        + (f"{show(peak)} reserved by torch" if peak is not None else "unknown (no torch)"),
        "declare a larger budget (memory=...), or exclusive=True to run it alone",
    ]
    return "\n".join(lines)
