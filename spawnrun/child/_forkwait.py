"""How a template's forks end: their word that they said "done", their exit waited for,
and how they ended told to the parent or taken on by the template.

Runs in a file's template (``_template``), never in its forks. A fork that said "done"
gets ``FORK_EXIT_LIMIT`` to exit, then is killed; where more tests follow, how it ended
is a warning on its test (``ForkEnded``), else the template ends the same way (signal or
exit code), so the parent reports the test as a child's crash. Waits on a fork's pidfd
(no polling) where the kernel has them. Imports nothing of spawnrun but the protocol.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import select
import signal
import time
from multiprocessing.connection import wait
from typing import Any
from typing import NoReturn

from spawnrun.wire import _replies


@dataclasses.dataclass(frozen=True)
class Said:
    """A fork that said "done": its pid, its "done" pipe, when it said it, its test."""

    pid: int
    said_done: int
    done_at: float
    nodeid: str


def ends_before_go(relay: Any, fork: Said) -> bool:
    """Wait for the next ``Go`` or the fork's end, whichever comes first, and at most
    until the fork's ``FORK_EXIT_LIMIT`` is spent; True: the fork is to be reaped now
    (ended, or to be killed)."""
    pidfd = _pidfd(fork.pid)
    if pidfd is None:
        return True  # an older kernel: wait for it as before
    try:
        left = max(0.0, fork.done_at + _replies.FORK_EXIT_LIMIT - time.monotonic())
        ready = wait([relay.conn, pidfd], left)
        return not ready or pidfd in ready
    finally:
        os.close(pidfd)


def reap(relay: Any, fork: Said) -> None:
    """Wait for the end of a fork that said "done" (``FORK_EXIT_LIMIT`` from then), and
    tell how it ended."""
    try:
        status, _, killed = wait_for(fork.pid, fork.said_done, fork.done_at)
    finally:
        os.close(fork.said_done)
    assert status is not None  # without ``until_done`` it waits for the end
    ended(relay, fork.pid, status, True, killed, True, fork.nodeid)


def ended(
    relay: Any, pid: int, status: int, done: bool, killed: bool, more: bool, nodeid: str = ""
) -> None:
    code = os.waitstatus_to_exitcode(status)
    if done and more:
        # Its test is over and reported: how its process ended is a warning on that
        # test (named), told before the template's next fork or once that one said
        # "done"; the template goes on (the next test is not to blame).
        relay.send(_replies.ForkEnded(pid, code, killed, nodeid))
        return
    if os.WIFSIGNALED(status):
        _die_by(os.WTERMSIG(status))
    if code:
        os._exit(code)


def wait_for(
    pid: int, said_done: int, done_at: float | None = None, until_done: bool = False
) -> tuple[int | None, bool, bool]:
    """The fork's wait status, whether it said "done", and whether it had to be killed.

    Until "done" the test runs, for as long as it takes (the parent's timeout applies);
    after it (``done_at``: it said it then), the fork gets ``FORK_EXIT_LIMIT`` to exit,
    as a child of its own does. ``until_done``: return once it said "done", its status
    None (it is still to be waited for). Waits on the fork's pidfd (no polling) where
    the kernel has them.
    """
    pidfd = _pidfd(pid)
    killed = heard_all = False
    try:
        while True:
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                # Its word may have come with its exit, in the same instant.
                done = done_at is not None or (not heard_all and _said(said_done) is True)
                return status, done, killed
            if done_at is None and not heard_all:
                said = _said(said_done)
                if said and until_done:
                    return None, True, False
                if said:
                    done_at = time.monotonic()
                heard_all = said is None  # its end of the pipe is closed: no word to come
            watch = [] if pidfd is None else [pidfd]
            timeout: float | None = None if pidfd is not None else 0.005
            if done_at is None and not heard_all:
                watch.append(said_done)
            elif done_at is not None and not killed:
                left = done_at + _replies.FORK_EXIT_LIMIT - time.monotonic()
                if left <= 0:
                    signal_quietly(pid, signal.SIGKILL)
                    killed = True
                elif pidfd is not None:
                    timeout = left
            select.select(watch, [], [], timeout)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None  # an older kernel: poll


def _said(said_done: int) -> bool | None:
    """Whether the fork said "done" (None: its end of the pipe closed without a word)."""
    readable, _, _ = select.select([said_done], [], [], 0)
    if not readable:
        return False
    return True if os.read(said_done, 1) == b"1" else None


def signal_quietly(pid: int, signum: int) -> None:
    with contextlib.suppress(OSError):  # it just ended
        os.kill(pid, signum)


def _die_by(signum: int) -> NoReturn:
    """End this process by the signal that ended its fork (the parent tells which)."""
    faulthandler.disable()  # the fork's stacks are written; none of ours
    with contextlib.suppress(OSError, ValueError):
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal that does not end a process by default
