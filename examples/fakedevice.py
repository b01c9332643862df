"""A fake accelerator runtime that, like CUDA, is not fork-safe.

Once initialized in a process, any child *forked* from that process is poisoned: the
first use raises the same kind of error CUDA raises. A child started fresh (spawn)
imports this module anew and works. Tests copy this module next to their inner suites.
"""

from __future__ import annotations

import os

FORK_ERROR = "Cannot re-initialize FakeDevice in forked subprocess"

_initialized_in: int | None = None
_poisoned = False


def _after_fork_in_child() -> None:
    global _poisoned
    if _initialized_in is not None:
        _poisoned = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def init() -> None:
    global _initialized_in
    if _poisoned:
        raise RuntimeError(FORK_ERROR)
    if _initialized_in is None:
        _initialized_in = os.getpid()


def is_initialized() -> bool:
    return _initialized_in is not None and not _poisoned


def compute(x: int) -> int:
    init()
    return 2 * x
