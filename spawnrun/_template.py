"""A template: the child that collected a file forks a fresh process for each of its tests.

Runs in a test's child (``ChildSpec.fork_each``, fast mode's default for a file with
several tests that run alone) and in the processes it forks. The child has configured
pytest and collected the file, as any child does; it runs none of the tests itself. For
each ``Go`` it forks; the fork sets up every fixture its test needs, runs it, tears
everything down (``nextitem=None``), says "done" and exits, as a child of its own would.
A fork that dies ends the template the same way (signal or exit code), so the parent
reports the test as a child's crash and the file's other tests go on in a fresh
template. Forking is refused where the collection left the process unsafe to fork (the
template rules of ``_zygote``): the child then runs its one test itself and ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import select
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any
from typing import NoReturn

import pytest

from spawnrun import _leave
from spawnrun import _probe
from spawnrun import _protocol as proto


def fork_each(relay: Any, item: Any, then: list[Any], by_id: dict[str, Any]) -> None:
    """A template: fork a fresh process for each test, from what is collected here.

    Nothing of a test runs in the template: each fork sets up every fixture it needs
    and tears all of them down (``nextitem=None``), as a child of its own would, and
    says "done" itself. A fork that dies ends the template the same way, so its
    test's report is a child's crash report and the rest go on in a fresh template.
    """
    forks = 0
    previous: _Said | None = None
    while True:
        forks += 1
        ending = _fork_test(relay, item, bool(then), forks, previous)
        previous = None
        if not then:
            break
        # The fork that said "done" exits while its report is replayed and the next Go
        # comes (the template waited for its exit first: ~7 ms of every test's turn).
        # Where the run has devices, its end comes before the next fork: its device
        # memory is gone before the next test's starts. Where it has none, the next
        # fork need not wait for it: its end is told once that one said "done" (the
        # template never writes to the parent while a fork may).
        if ending is not None and _ends_before_go(relay, ending):
            _reap(relay, ending)
            ending = None
        found = relay._await_go(by_id)
        if found is not None:
            then = then[then.index(found) + 1 :] if found in then else []
        if ending is not None and found is not None and then and relay.spec.deviceless:
            previous = ending
        elif ending is not None:
            _reap(relay, ending)
        if found is None:
            break
        item = found
    relay.done = True  # the forks said "done"; what follows is told as After


def _fork_test(
    relay: Any,
    item: Any,
    more: bool,
    serial: int,
    previous: _Said | None = None,
) -> _Said | None:
    """Fork ``item``'s process and wait for it: where ``more`` tests follow, until it said
    "done" (``_reap`` waits for its end later); else until it ended. ``previous``: the
    fork before, which said "done": its end is told once this one said "done" or
    ended (no fork writes to the parent then)."""
    if relay.sink is not None:
        relay.sink.flush()
        relay.terminal_from = os.path.getsize(relay.sink.current)
    sys.stdout.flush()
    sys.stderr.flush()
    template = os.getpid()
    said_done, told = os.pipe()  # the fork writes a byte once it has said "done"
    pid = os.fork()
    if pid == 0:
        os.close(said_done)
        _forked(relay, item, more, serial, template, told)
    os.close(told)
    # A timeout's stack dump is asked of this process: the test's is the fork's.
    # (faulthandler reinstalls its handler only when it was unregistered first.)
    faulthandler.unregister(_leave.DUMP_SIGNAL)
    signal.signal(_leave.DUMP_SIGNAL, lambda *_: _signal_quietly(pid, _leave.DUMP_SIGNAL))
    try:
        status, done, killed = _wait_for(pid, said_done, until_done=more)
    except BaseException:
        os.close(said_done)
        raise
    said_at = time.monotonic()  # its exit's time counts from here, not after the reap
    _dump_own_stacks(relay)
    if previous is not None:
        _reap(relay, previous)
    if status is None:  # it said "done" and exits now: reaped later
        return _Said(pid, said_done, said_at, item.nodeid)
    os.close(said_done)
    _ended(relay, pid, status, done, killed, more)
    return None


def _dump_own_stacks(relay: Any) -> None:
    signal.signal(_leave.DUMP_SIGNAL, signal.SIG_DFL)
    faulthandler.register(_leave.DUMP_SIGNAL, file=relay.stacks, all_threads=True, chain=False)


@dataclasses.dataclass(frozen=True)
class _Said:
    """A fork that said "done": its pid, its "done" pipe, when it said it, its test."""

    pid: int
    said_done: int
    done_at: float
    nodeid: str


def _ends_before_go(relay: Any, fork: _Said) -> bool:
    """Wait for the next ``Go`` or the fork's end, whichever comes first, and at most
    until the fork's ``FORK_EXIT_LIMIT`` is spent; True: the fork is to be reaped now
    (ended, or to be killed)."""
    pidfd = _pidfd(fork.pid)
    if pidfd is None:
        return True  # an older kernel: wait for it as before
    try:
        left = max(0.0, fork.done_at + proto.FORK_EXIT_LIMIT - time.monotonic())
        ready = wait([relay.conn, pidfd], left)
        return not ready or pidfd in ready
    finally:
        os.close(pidfd)


def _reap(relay: Any, fork: _Said) -> None:
    """Wait for the end of a fork that said "done" (``FORK_EXIT_LIMIT`` from then), and
    tell how it ended."""
    try:
        status, _, killed = _wait_for(fork.pid, fork.said_done, fork.done_at)
    finally:
        os.close(fork.said_done)
    assert status is not None  # without ``until_done`` it waits for the end
    _ended(relay, fork.pid, status, True, killed, True, fork.nodeid)


def _ended(
    relay: Any, pid: int, status: int, done: bool, killed: bool, more: bool, nodeid: str = ""
) -> None:
    code = os.waitstatus_to_exitcode(status)
    if done and more:
        # Its test is over and reported: how its process ended is a warning on that
        # test (named), told before the template's next fork or once that one said
        # "done"; the template goes on (the next test is not to blame).
        relay.send(proto.ForkEnded(pid, code, killed, nodeid))
        return
    if os.WIFSIGNALED(status):
        _die_by(os.WTERMSIG(status))
    if code:
        os._exit(code)


def _wait_for(
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
                left = done_at + proto.FORK_EXIT_LIMIT - time.monotonic()
                if left <= 0:
                    _signal_quietly(pid, signal.SIGKILL)
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


def _forked(relay: Any, item: Any, more: bool, serial: int, template: int, told: int) -> NoReturn:
    try:
        _probe.die_with_parent(template)
        # Its stacks are the test's: where the template's would go (it forwards the
        # parent's request), not among the processes below the test.
        faulthandler.register(_leave.DUMP_SIGNAL, file=relay.stacks, all_threads=True, chain=False)
        relay.send(proto.ForkedTest(os.getpid()))
        base = getattr(item.config.option, "basetemp", None)
        if base:
            point_basetemp(item.config, f"{base}-{serial}")
        relay.current = item.nodeid
        try:
            relay._run(item, None)
        except (KeyboardInterrupt, pytest.exit.Exception):
            _leave.leave(0)  # told (Interrupted, Done): the parent ends the session
        if more:
            relay._done_for_now()
            with contextlib.suppress(OSError):
                os.write(told, b"1")
        else:
            relay.finish()
    except BaseException:  # noqa: BLE001 - the template ends with it: a crash report
        traceback.print_exc()
        _leave.leave(70)
    _leave.leave(0)


def point_basetemp(config: Any, base: str) -> None:
    """A forked test's own base for ``tmp_path``, as each spawned child has one (a
    template's fork, a configured template's fork).

    pytest keeps the session's temporary-directory factory on the config, with no
    public way to point it elsewhere: its given base is replaced before any test of
    this process asks for it.
    """
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None:
        factory._given_basetemp = Path(os.path.abspath(base))
        factory._basetemp = None


def _signal_quietly(pid: int, signum: int) -> None:
    with contextlib.suppress(OSError):  # it just ended
        os.kill(pid, signum)


def _die_by(signum: int) -> NoReturn:
    """End this process by the signal that ended its fork (the parent tells which)."""
    faulthandler.disable()  # the fork's stacks are written; none of ours
    with contextlib.suppress(OSError, ValueError):
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal that does not end a process by default
