"""Which import started each of this process's threads, so that a refusal names it.

Runs in templates (the zygote, a spawned child that collects its file as a template),
from ``arm`` until ``disarm``, as ``_streams`` does; imports only the standard library.
A native thread has no Python name: ``/proc`` tells its library's name for it at best
(often the program's own, ``python3``). What is known is when it appeared: a thread that
appears while a module is imported was started by that import (an extension module's
init, or code the module runs as it loads), and is credited to the innermost module
being imported then (``onnxruntime.capi.onnxruntime_pybind11_state``, say).

Every load of a module passes through importlib's ``_load_unlocked``; while armed, it
counts the process's threads before and after (one ``stat`` of ``/proc/self/task``,
about a microsecond) and lists them only where the count changed. Where that function
is not there (another Python) or ``/proc`` is not, nothing is credited, and a refusal
names threads as before.
"""

from __future__ import annotations

import os
import sys
from typing import Any

TASKS = "/proc/self/task"

#: Each thread (native id) that an import started: the module then being imported, and
#: that import's serial number (loads are numbered as they start).
_started_by: dict[int, tuple[str, int]] = {}
_serial = 0
#: importlib's own ``_load_unlocked`` while ours stands in for it.
_original: Any = None


def arm() -> None:
    """From now on, credit each thread that starts during an import to that import."""
    global _original
    bootstrap = sys.modules.get("_frozen_importlib")
    load = getattr(bootstrap, "_load_unlocked", None)
    if _original is not None or load is None or not os.path.isdir(TASKS):
        return
    _original = load

    def _load_unlocked(spec: Any) -> Any:
        global _serial
        _serial += 1
        serial, before = _serial, _tasks()
        try:
            return load(spec)
        finally:
            if _count() != len(before):
                _credit(before, getattr(spec, "name", "?"), serial)

    _load_unlocked.__wrapped__ = load  # type: ignore[attr-defined]
    bootstrap._load_unlocked = _load_unlocked  # type: ignore[union-attr]


def disarm() -> None:
    """The test's own code runs next: importlib is its own again."""
    global _original
    if _original is not None:
        sys.modules["_frozen_importlib"]._load_unlocked = _original  # type: ignore[attr-defined]
        _original = None


def started_by(tid: int) -> str:
    """The module whose import started thread ``tid`` ("" if none known)."""
    return _started_by.get(tid, ("", 0))[0]


def _count() -> int:
    try:
        return os.stat(TASKS).st_nlink - 2  # "." and "..", then one entry per thread
    except OSError:
        return -1


def _tasks() -> set[str]:
    try:
        return set(os.listdir(TASKS))
    except OSError:
        return set()


def _credit(before: set[str], module: str, serial: int) -> None:
    for tid in _tasks() - before:
        credited = _started_by.get(int(tid))
        # An import inside this one, which ended first, keeps what it credited; a credit
        # from before this import began was an ended thread's whose id came back.
        if credited is None or credited[1] < serial:
            _started_by[int(tid)] = (module, serial)
