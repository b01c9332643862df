"""A spawned process made to look, to the test, like a fresh interpreter's main process.

Runs in every process spawnrun spawns (a test's child, the zygote that forks templates),
first thing, before pytest, the suite or spawnrun's child side is imported; the standard
library only.

multiprocessing's spawn bootstrap leaves marks no fresh ``python -m pytest`` has: it
forces the process-wide start method to ``spawn`` (``get_start_method()`` says
``spawn`` where a fresh interpreter on Linux has ``fork`` and has set none), makes the
process a ``SpawnProcess`` named ``SpawnProcess-N`` whose ``parent_process()`` is the
pytest parent. A test then differs from plain pytest below pytest:
``multiprocessing.Process(target=<a closure>)`` fails to pickle; torch's
``DataLoader(num_workers=4)`` starts spawn workers, each importing torch and the test
module again (26-33 s where plain pytest took 0.6 s on 2 cores); a conftest's
``multiprocessing.set_start_method("spawn")`` raises "context has already been set".

``as_fresh`` undoes those marks: no start method chosen (the platform's default on
first use), the main process (``MainProcess``, no parent, a fresh authentication key).
The pid of the process that spawned this one is kept for spawnrun (``spawned_by``).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os

#: The pid of the process that spawned this one (None: not a multiprocessing child).
_spawned_by: int | None = None


def as_fresh() -> None:
    """This process's multiprocessing state as a fresh interpreter's (see the module)."""
    global _spawned_by
    parent = multiprocessing.parent_process()
    if parent is not None:
        _spawned_by = parent.pid
    # CPython's own state, with no public way back: the default context's choice (what
    # ``set_start_method`` sets), and the process objects ``current_process()`` and
    # ``parent_process()`` return.
    multiprocessing.context._default_context._actual_context = None  # type: ignore[attr-defined]
    multiprocessing.process._current_process = _MainProcess()  # type: ignore[attr-defined]
    multiprocessing.process._parent_process = None  # type: ignore[attr-defined]
    _not_inherited()


def kept(fd: int) -> int:
    """``fd``, received from another process (``reduction.recv_handle`` gives it
    inheritable), kept from the processes a test starts."""
    os.set_inheritable(fd, False)
    return fd


def _not_inherited() -> None:
    """The descriptors the spawn handed this process (its pipe to the parent, the parent's
    resource tracker) are kept from what the test starts: a fresh interpreter has none of
    them, and a subprocess that inherited one would hold the parent's pipe open."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return  # not Linux
    for name in names:
        fd = int(name)
        if fd <= 2:
            continue
        try:
            if os.get_inheritable(fd):
                os.set_inheritable(fd, False)
        except OSError:
            pass  # the directory's own descriptor, closed by now


class _MainProcess(multiprocessing.process.BaseProcess):
    """What ``current_process()`` is in a fresh interpreter (CPython deletes its own class
    once it made its instance, so here is one like it)."""

    def __init__(self) -> None:
        self._identity = ()
        self._name = "MainProcess"
        self._parent_pid = None
        self._popen = None
        self._closed = False
        key = multiprocessing.process.AuthenticationString(os.urandom(32))  # type: ignore[attr-defined]
        self._config = {"authkey": key, "semprefix": "/mp"}

    def close(self) -> None:
        pass


def spawned_by() -> int | None:
    """The pid of the process that spawned this one, as multiprocessing knew it."""
    return _spawned_by if _spawned_by is not None else _parent_pid()


def _parent_pid() -> int | None:
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None else None
