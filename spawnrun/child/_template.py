"""A template: the child that collected a file forks a fresh process for each of its tests.

Runs in a test's child (``ChildSpec.fork_each``, fast mode's default for a file with
several tests that run alone) and in the processes it forks. The child has configured
pytest and collected the file, as any child does; it runs none of the tests itself. For
each ``Go`` it forks; the fork sets up every fixture its test needs, runs it, tears
everything down (``nextitem=None``), says "done" and exits, as a child of its own would.
A fork that dies ends the template the same way (signal or exit code: ``_forkwait``), so
the parent reports the test as a child's crash and the file's other tests go on in a
fresh template. Forking is refused where the collection left the process unsafe to fork (the
template rules of ``_zygote``): the child then runs its one test itself and ends.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import select
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any
from typing import NoReturn

import pytest

from spawnrun.child import _forkwait
from spawnrun.child import _leave
from spawnrun.child import _rehearse
from spawnrun.proc import _probe
from spawnrun.wire import _replies


def fork_each(relay: Any, item: Any, then: list[Any], by_id: dict[str, Any]) -> None:
    """A template: fork a fresh process for each test, from what is collected here.

    Nothing of a test runs in the template: each fork sets up every fixture it needs
    and tears all of them down (``nextitem=None``), as a child of its own would, and
    says "done" itself. A fork that dies ends the template the same way, so its
    test's report is a child's crash report and the rest go on in a fresh template.
    """
    forks = 0
    previous: _forkwait.Said | None = None
    spare: _Spare | None = None
    while True:
        forks += 1
        ending, spare = _fork_test(relay, item, bool(then), forks, previous, spare, by_id)
        previous = None
        if not then:
            break
        # The fork that said "done" exits while its report is replayed and the next Go
        # comes (the template waited for its exit first: ~7 ms of every test's turn).
        # Where the run has devices, its end comes before the next fork: its device
        # memory is gone before the next test's starts. Where it has none, the next
        # fork need not wait for it: its end is told once that one said "done" (the
        # template never writes to the parent while a fork may).
        if ending is not None and _forkwait.ends_before_go(relay, ending):
            _forkwait.reap(relay, ending)
            ending = None
        found = relay.await_go(by_id)
        if found is not None:
            then = then[then.index(found) + 1 :] if found in then else []
        if ending is not None and found is not None and then and relay.spec.deviceless:
            previous = ending
        elif ending is not None:
            _forkwait.reap(relay, ending)
        if found is None:
            break
        item = found
    if spare is not None:
        spare.dismiss()
    relay.done = True  # the forks said "done"; what follows is told as After


def _fork_test(
    relay: Any,
    item: Any,
    more: bool,
    serial: int,
    previous: _forkwait.Said | None = None,
    spare: _Spare | None = None,
    by_id: dict[str, Any] | None = None,
) -> tuple[_forkwait.Said | None, _Spare | None]:
    """Fork ``item``'s process (or hand it to ``spare``, forked ahead) and wait for it:
    where ``more`` tests follow, until it said "done" (``_forkwait.reap`` waits for its end
    later), having forked the next test's spare meanwhile; else until it ended.
    ``previous``: the fork before, which said "done": its end is told once this one said
    "done" or ended (no fork writes to the parent then)."""
    _flush(relay)
    template = os.getpid()
    pid = spare.go(item, more, serial, relay.last_go) if spare is not None else 0
    if pid:
        said_done = spare.said_done  # type: ignore[union-attr]
    else:
        if spare is not None:
            spare.dismiss()  # it is gone: the test gets a fork of its own
        said_done, told = os.pipe()  # the fork writes a byte once it has said "done"
        pid = os.fork()
        if pid == 0:
            os.close(said_done)
            _forked(relay, item, more, serial, template, told)
        os.close(told)
    # A timeout's stack dump is asked of this process: the test's is the fork's.
    # (faulthandler reinstalls its handler only when it was unregistered first.)
    faulthandler.unregister(_leave.DUMP_SIGNAL)
    signal.signal(_leave.DUMP_SIGNAL, lambda *_: _forkwait.signal_quietly(pid, _leave.DUMP_SIGNAL))
    # The next test's process, forked while this one runs: its fork is off the next
    # test's path. It waits, having run nothing, until its Go comes (``_Spare``).
    upcoming = _Spare.fork(relay, by_id, template) if more and by_id is not None else None
    try:
        status, done, killed = _forkwait.wait_for(pid, said_done, until_done=more)
    except BaseException:
        os.close(said_done)
        if upcoming is not None:
            upcoming.dismiss()
        raise
    said_at = time.monotonic()  # its exit's time counts from here, not after the reap
    _dump_own_stacks(relay)
    if previous is not None:
        _forkwait.reap(relay, previous)
    if status is None:  # it said "done" and exits now: reaped later
        return _forkwait.Said(pid, said_done, said_at, item.nodeid), upcoming
    os.close(said_done)
    if upcoming is not None and not (done and more):
        upcoming.dismiss()  # the template ends with its test
        upcoming = None
    _forkwait.ended(relay, pid, status, done, killed, more)
    return None, upcoming


def _flush(relay: Any) -> None:
    """Nothing of the template's left in a buffer a fork would write again; where the
    terminal's output starts for the next fork."""
    if relay.sink is not None:
        relay.sink.flush()
        relay.terminal_from = os.path.getsize(relay.sink.current)
    sys.stdout.flush()
    sys.stderr.flush()


class _Spare:
    """A fork made ahead for the template's next test: it waits, having run nothing of
    the suite's, until the template hands it its test, then runs it as any fork does.

    Forked from the template as it is between tests (nothing runs in it then), it is
    the process a fork made at the ``Go`` would be; what the ``Go`` changed in the
    template (the parent's environment at the test's turn, the parent's parameters) it
    applies itself, before any of the test's code. One that ends before its ``Go`` (it
    was killed) is dismissed, and the test gets a fork of its own. Dismissed, it exits
    at once, without its exit work (it never ran anything).
    """

    def __init__(self, pid: int, go_fd: int, said_done: int) -> None:
        self.pid, self.go_fd, self.said_done = pid, go_fd, said_done

    @classmethod
    def fork(cls, relay: Any, by_id: dict[str, Any], template: int) -> _Spare | None:
        _flush(relay)
        go_read, go_write = os.pipe()
        said_done, told = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (go_read, go_write, said_done, told):
                os.close(fd)
            return None  # the test forks at its Go, as before
        if pid == 0:
            os.close(go_write)
            os.close(said_done)
            _spare(relay, by_id, template, go_read, told)
        os.close(go_read)
        os.close(told)
        return cls(pid, go_write, said_done)

    def go(self, item: Any, more: bool, serial: int, go: Any) -> int:
        """Hand it ``item`` (``go``: the template took it for it): its pid, or 0 where it
        had ended."""
        ended, _ = os.waitpid(self.pid, os.WNOHANG)
        if ended:
            self.pid = 0
            return 0
        words = pickle.dumps((item.nodeid, more, serial, go))
        try:
            os.write(self.go_fd, words)  # then closed: its end-of-file ends the words
        except OSError:
            return 0
        finally:
            os.close(self.go_fd)
            self.go_fd = -1
        return self.pid

    def dismiss(self) -> None:
        for fd in (self.go_fd, self.said_done):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.go_fd = self.said_done = -1
        if self.pid:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)  # it reads end-of-file and exits at once
            self.pid = 0


def _pages_path(relay: Any) -> str:
    """Where the template's forks write down the pages they copied (``_rehearse``)."""
    return os.path.join(os.path.dirname(relay.spec.stacks_path), "pages")


def _spare(relay: Any, by_id: dict[str, Any], template: int, go_read: int, told: int) -> NoReturn:
    try:
        _probe.die_with_parent(template)
        # The copies its test would make, now, until the test comes.
        _rehearse.rehearse(_pages_path(relay), lambda: bool(select.select([go_read], [], [], 0)[0]))
        words = b""
        while True:
            chunk = os.read(go_read, 1 << 16)
            if not chunk:
                break
            words += chunk
        os.close(go_read)
        if not words:
            os._exit(0)  # dismissed: it ran nothing, and leaves nothing
        nodeid, more, serial, go = pickle.loads(words)
        item = by_id[nodeid]
        if go is not None:
            problem = relay.take_go(item, go)
            if problem:  # the template took it: it binds alike here
                raise RuntimeError(problem)
        _flush(relay)  # its test's output starts here, after the tests before it
    except BaseException:  # noqa: BLE001 - its test is told as a fork's crash
        traceback.print_exc()
        _leave.leave(70)
    _forked(relay, item, more, serial, template, told)


def _dump_own_stacks(relay: Any) -> None:
    # Unregistered first: faulthandler installs its handler again only then, and
    # ``signal.signal`` below replaced it at the system's level.
    faulthandler.unregister(_leave.DUMP_SIGNAL)
    signal.signal(_leave.DUMP_SIGNAL, signal.SIG_DFL)
    faulthandler.register(_leave.DUMP_SIGNAL, file=relay.stacks, all_threads=True, chain=False)


def _forked(relay: Any, item: Any, more: bool, serial: int, template: int, told: int) -> NoReturn:
    try:
        _probe.die_with_parent(template)
        # Its stacks are the test's: where the template's would go (it forwards the
        # parent's request), not among the processes below the test. The template's
        # forwarding handler is none of the test's (``signal.getsignal`` as spawned).
        _dump_own_stacks(relay)
        relay.send(_replies.ForkedTest(os.getpid()))
        base = getattr(item.config.option, "basetemp", None)
        if base:
            point_basetemp(item.config, f"{base}-{serial}")
        relay.current = item.nodeid
        try:
            relay.run(item, None)
        except (KeyboardInterrupt, pytest.exit.Exception):
            _leave.leave(0)  # told (Interrupted, Done): the parent ends the session
        if more:
            relay.done_for_now()
            with contextlib.suppress(OSError):
                os.write(told, b"1")
            if serial == 1 or serial % _rehearse.RECORD_EVERY == 0:
                _rehearse.record(_pages_path(relay))  # for the spares to come
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
