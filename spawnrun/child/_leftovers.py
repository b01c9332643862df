"""What a test left running: adopted while it runs, ended and named as its process leaves.

Runs in the process that runs a test (a spawned child, a template's fork); imports only
the standard library and ``_proctable``. Before the test's code runs, the process
becomes the subreaper of what it starts (Linux ``PR_SET_CHILD_SUBREAPER``): a process
below it whose parent ends is re-parented to it, not to init, so nothing the test starts
escapes it, also not a grandchild that called ``setsid`` (an engine's server, a
daemonized helper). As the process leaves (``_leave.leave``, after the exit work that
joins what is joined at exit), what is still its child was left running by the test: it
is named to the parent (``tell``), sent SIGTERM, given ``GRACE`` (orphans of those it
ends are adopted and ended in turn), then SIGKILL, and reaped. What multiprocessing
itself keeps for the process (its resource tracker, its forkserver), which ends with it,
is left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable

from spawnrun.proc import _proctable

PR_SET_CHILD_SUBREAPER = 36
#: How long what a test left running gets between SIGTERM and SIGKILL.
GRACE = 2.0
#: How many of them the parent is told of by name (the message stays one small write).
SHOWN = 8
#: How the parent hears what was left running ((description, ...), pids); set where a
#: test runs (``Turn.run``): a template, which runs none, ends nothing here.
tell: Callable[[list[str], list[int]], None] | None = None


def adopt() -> None:
    """Become the subreaper of every process started below this one from now on."""
    with contextlib.suppress(Exception):  # not Linux, or no prctl: nothing is adopted
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def end() -> None:
    """Name, end and reap what the test left running below this process."""
    if tell is None:
        return
    found = children()
    if not found:
        return
    with contextlib.suppress(Exception):  # the parent gone: they are ended all the same
        tell([describe(pid) for pid in found[:SHOWN]], found)
    ended = set(found)
    _signal(found, signal.SIGTERM)
    deadline = time.monotonic() + GRACE
    while time.monotonic() < deadline:
        _reap()
        left = children()
        if not left:
            return
        new = [pid for pid in left if pid not in ended]  # orphans of those ended
        ended.update(new)
        _signal(new, signal.SIGTERM)
        time.sleep(0.02)
    for _ in range(100):  # a process stuck in the kernel may outlast SIGKILL a while
        left = children()
        if not left:
            return
        _signal(left, signal.SIGKILL)
        time.sleep(0.01)


def children() -> list[int]:
    """This process's live children (zombies reaped), but multiprocessing's own."""
    _reap()
    me = os.getpid()
    mine = {pid for pid, (parent, _, _) in _proctable.live_processes().items() if parent == me}
    return sorted(mine - _kept())


def describe(pid: int) -> str:
    """``pid`` and its command line, as the warning names it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
        command = " ".join(w.decode(errors="replace") for w in words if w)
    except OSError:
        command = ""
    if len(command) > 120:
        command = command[:117] + "..."
    return f"pid {pid} ({command or '?'})"


def _kept() -> set[int]:
    """multiprocessing's helper processes of this process: they end as it does."""
    kept = set()
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    pid = getattr(getattr(tracker, "_resource_tracker", None), "_pid", None)
    if isinstance(pid, int):
        kept.add(pid)
    server = sys.modules.get("multiprocessing.forkserver")
    pid = getattr(getattr(server, "_forkserver", None), "_forkserver_pid", None)
    if isinstance(pid, int):
        kept.add(pid)
    return kept


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):  # it ended meanwhile (and is ours to reap)
            os.kill(pid, signum)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
