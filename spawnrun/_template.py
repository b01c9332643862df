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
import faulthandler
import os
import select
import signal
import sys
import time
import traceback
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
    while True:
        forks += 1
        _fork_test(relay, item, bool(then), forks)
        if not then:
            break
        found = relay._await_go(by_id)
        if found is None:
            break
        then = then[then.index(found) + 1 :] if found in then else []
        item = found
    relay.done = True  # the forks said "done"; what follows is told as After


def _fork_test(relay: Any, item: Any, more: bool, serial: int) -> None:
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
        status, done, killed = _wait_for(pid, said_done)
    finally:
        os.close(said_done)
    signal.signal(_leave.DUMP_SIGNAL, signal.SIG_DFL)
    faulthandler.register(_leave.DUMP_SIGNAL, file=relay.stacks, all_threads=True, chain=False)
    code = os.waitstatus_to_exitcode(status)
    if done and more:
        # Its test is over and reported: how its process ended is a warning on that
        # test, told before the next fork; the template goes on (the next test is not
        # to blame).
        relay.send(proto.ForkEnded(pid, code, killed))
        return
    if os.WIFSIGNALED(status):
        _die_by(os.WTERMSIG(status))
    if code:
        os._exit(code)


def _wait_for(pid: int, said_done: int) -> tuple[int, bool, bool]:
    """The fork's wait status, whether it said "done", and whether it had to be killed.

    Until "done" the test runs, for as long as it takes (the parent's timeout applies);
    after it, the fork gets ``FORK_EXIT_LIMIT`` to exit, as a child of its own does.
    Waits on the fork's pidfd (no polling) where the kernel has them.
    """
    pidfd = _pidfd(pid)
    done_at: float | None = None
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
