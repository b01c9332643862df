"""A test's turn in the child: take the go, run the test, stream its reports, say "done".

Runs in the child only (a spawned child, a fork of a template). ``Turn`` holds the
child's connection to the parent and what it knows of the test at hand; its pytest hooks
stream each phase and report of the test as pytest makes and logs them. The relay
(``_relay``), the child's pytest plugin, is a ``Turn`` that also boots the child and
serves its tests; a file's template (``_template``) runs each of its forks' tests
through it. Both build on this module: it imports neither. What it tells the parent
(``Done``: the test's terminal output, its devices' peaks, its CPU load, the libraries it
imported) is plain data only, whatever the test put in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO
from typing import Any

import pytest

from spawnrun.child import _budget
from spawnrun.child import _collection
from spawnrun.child import _environ
from spawnrun.child import _leftovers
from spawnrun.child import _sink
from spawnrun.child import _streams
from spawnrun.child import _threadwatch
from spawnrun.proc import _libraries
from spawnrun.proc import _probe
from spawnrun.wire import _orders
from spawnrun.wire import _protocol as proto
from spawnrun.wire import _replies

#: At most this many modules a test imported are told (``Done.imported``).
_MAX_IMPORTED = 2000


class Turn:
    """The child's side of a test's turn: the go taken, the test run, its reports
    streamed, "done" said (with what it used)."""

    def __init__(self, spec: _orders.ChildSpec, conn: Connection, stacks: IO[str]) -> None:
        self.spec = spec
        self.conn = conn
        self.stacks = stacks
        self.interrupted = False
        self.notes: list[str] = []
        self.done = False
        #: The test being run (the spec's, then later ones of its scope).
        self.current = spec.nodeid
        #: The last ``Go`` taken between tests (a template's spare fork takes it too).
        self.last_go: _orders.Go | None = None
        self.config: Any = None
        #: Where the test's terminal output starts in ``sink`` (set at the go).
        self.terminal_from = -1
        #: Where the child's terminal reporter writes (set at configure).
        self.sink: _sink.Sink | None = None
        #: Its process's CPU seconds and the clock when its current test began.
        self.cpu_from: tuple[float, float] | None = None
        #: The modules the process had once booted (None: not booted).
        self.boot_modules: _libraries.Mark | None = None
        #: Reports of the current execution made but not yet logged, by phase.
        self.made: dict[str, Any] = {}

    def _left_running(self, processes: list[str], pids: list[int]) -> None:
        self.send(_replies.LeftRunning(self.current, processes, pids))

    def send(self, msg: _replies.Message) -> None:
        # Plain data only, whatever the test put in it (a tensor, an instance of a class
        # of its own): the parent must read every message without importing anything.
        fields = {f.name: proto.plain(getattr(msg, f.name)) for f in dataclasses.fields(msg)}
        self.conn.send_bytes(proto.frame(dataclasses.replace(msg, **fields)))

    def finish(self) -> None:
        """Say "done" (once), or after it what went wrong since (``After``)."""
        try:
            if not self.done:
                self.done = True
                self.send(self._done(more=False))
                if self.sink is not None:
                    self.sink.to_own()  # the session's end is no part of the test
            elif self.notes:
                self.send(_replies.After(self.notes))
        except OSError:
            pass  # the parent is gone or no longer listening: nothing left to tell
        self.notes = []
        sys.stdout.flush()
        sys.stderr.flush()

    def run(self, item: Any, nextitem: Any) -> None:
        _streams.disarm()  # forks the test makes reseed as anywhere
        _threadwatch.disarm()  # the test imports through importlib's own loader
        if _leftovers.tell is None:  # what the test leaves running is its process's
            _leftovers.adopt()
            _leftovers.tell = self._left_running
        _environ.watch_writes()  # a fork: what the template's imports read, rewritten?
        self.cpu_from = (_cpu_seconds(), time.monotonic())
        try:
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        except KeyboardInterrupt as exc:
            self._interrupted(_keyboard_interrupt(exc))
            raise
        except pytest.exit.Exception as exc:
            self._interrupted(_replies.Interrupted(False, exc.msg, exc.returncode))
            raise

    def _cpu_load(self) -> float | None:
        """The cores the test kept busy on average since its ``run`` (None: unknown, or
        too brief to tell)."""
        if self.cpu_from is None:
            return None
        cpu, since = self.cpu_from
        wall = time.monotonic() - since
        return (_cpu_seconds() - cpu) / wall if wall >= CPU_LOAD_MIN_WALL else None

    def _imported(self) -> list[str]:
        """Libraries imported since the boot (or the scope's previous test), at most
        ``_MAX_IMPORTED``: a later run's template may preload them."""
        if self.boot_modules is None or self.config is None:
            return []
        found = _libraries.imported_since(self.boot_modules, Path(str(self.config.rootpath)))
        self.boot_modules = _libraries.mark()
        return found[:_MAX_IMPORTED]

    def done_for_now(self) -> None:
        """Say the test is done; the process waits for another (``Done.more``)."""
        self.send(self._done(more=True))
        self.notes = []

    def _done(self, more: bool) -> _replies.Done:
        """The test's "done": its peaks, read before anything gives a device back; then,
        where no other test comes (``more`` False), the device given back before the
        session's end, so that the next test on it waits only for memory still held."""
        peak, per_device = _peaks()
        jax = _probe.jax_peak()  # since the child started: JAX resets none
        held = _probe.allocated() if more else None
        if not more:
            _probe.release_devices()
        return _replies.Done(
            self.notes,
            self.terminal_since(),
            peak,
            per_device,
            more,
            held_bytes=held,
            jax_peak=jax,
            imported=self._imported(),
            cpu_load=self._cpu_load(),
            doubt=_environ.doubt(),
        )

    def await_go(self, by_id: dict[str, Any]) -> Any:
        """The scope's next test, once a ``Go`` names it (None: stop)."""
        try:
            go = self.conn.recv()
        except (EOFError, OSError):
            return None
        if not isinstance(go, _orders.Go) or go.nodeid not in by_id:
            return None
        item = by_id[go.nodeid]
        problem = self.take_go(item, go)
        if problem:
            self.send(_replies.Booted(os.getpid(), False, problem))
            return None
        self.last_go = go
        return item

    def take_go(self, item: Any, go: _orders.Go) -> str:
        """``item`` bound to the parent's parameters, the parent's environment at its
        turn taken: "" once done, else why it cannot be (a template's spare fork takes
        its test's ``Go`` the same way)."""
        problem = _collection.bind_parents(item, self.spec, go.params)
        if problem:
            return problem
        take_environment(go)
        self.current = go.nodeid
        return ""

    def _interrupted(self, msg: _replies.Interrupted) -> None:
        """The test stopped the session: say so, and say "done" before pytest ends here.

        The child's own session end (its "no tests ran" line and exit banner) is no part
        of the test: the parent's session ends the same way and says it once.
        """
        self.interrupted = True
        self.send(msg)
        self.finish()

    def mark_terminal(self) -> None:
        """Remember where the test's terminal output will start (see ``Relay.pytest_configure``)."""
        # The process's own streams (pytest's capture has replaced sys.stdout by now).
        for stream in (sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                stream.flush()  # type: ignore[union-attr]
                if self.spec.log_path is not None:
                    # Output that bypasses capture must keep its place among pytest's.
                    stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        if self.sink is not None:
            self.sink.flush()
            if self.spec.log_path is not None:
                self.sink.to_output(self.spec.log_path)
            self.terminal_from = os.path.getsize(self.sink.current)

    def terminal_since(self) -> str:
        """What reached the terminal since the last call (from the go on)."""
        if self.sink is None or self.terminal_from < 0:
            return ""
        for stream in (sys.__stdout__, sys.__stderr__, sys.stdout, sys.stderr, self.sink):
            with contextlib.suppress(Exception):
                stream.flush()  # type: ignore[union-attr]
        try:
            with open(self.sink.current, "rb") as f:
                f.seek(self.terminal_from)
                data = f.read()
        except OSError:
            return ""
        self.terminal_from += len(data)
        return _sink.bounded(data.decode("utf-8", "replace"))

    # pytest hooks: the test's reports, streamed as pytest makes and logs them -------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: Any) -> None:
        self._enter(item, "setup")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: Any) -> None:
        self._enter(item, "call")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item: Any) -> None:
        self._enter(item, "teardown")

    def _enter(self, item: Any, when: str) -> None:
        if item.nodeid != self.current:
            return
        if when == "setup":
            self.made.clear()
        for report in self.made.values():  # made, not logged: sent in case we die
            self.send(_replies.Report(self._serializable(report), pending=True))
        self.made.clear()
        self.send(_replies.Phase(when))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: Any, call: Any) -> Any:
        report = yield
        if item.nodeid == self.current:
            if report.failed:
                note = _budget.out_of_memory_note(call.excinfo)
                if note:
                    report.sections.append((_budget.SECTION, note))
            self.made[report.when] = report
        return report

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.nodeid != self.current:
            return
        self.made.pop(report.when, None)
        data = self._serializable(report)
        rendered = hasattr(report.longrepr, "toterminal") and isinstance(data.get("longrepr"), str)
        self.send(_replies.Report(data, terminal=self.terminal_since(), rendered=rendered))

    def _serializable(self, report: Any) -> Any:
        config = self.config
        # Some plugins settle a report's outcome when its status is asked, from state of
        # this process (subtests: a test whose subtests failed fails): ask here.
        with contextlib.suppress(Exception):
            config.hook.pytest_report_teststatus(report=report, config=config)
        report.sections = [(t, _sink.bounded(c)) for t, c in report.sections]
        data = config.hook.pytest_report_to_serializable(config=config, report=report)
        # What the test recorded travels as plain data; other values as their str, which
        # is what pytest writes of them (junitxml). The rest of the report (a plugin's
        # attributes) as plain data or reprs (``send``).
        if isinstance(data, dict) and isinstance(data.get("user_properties"), list):
            data["user_properties"] = proto.plain(data["user_properties"], str)
        return data

    def pytest_warning_recorded(
        self, warning_message: Any, when: str, nodeid: str, location: Any
    ) -> None:
        # Collection-time warnings were already recorded by the parent's collection.
        if when != "runtest":
            return
        category = warning_message.category
        self.send(
            _replies.WarningRecord(
                message=str(warning_message.message),
                category_module=category.__module__,
                category_name=category.__qualname__,
                filename=str(warning_message.filename),
                lineno=int(warning_message.lineno or 0),
                nodeid=nodeid,
                when=when,
            )
        )


#: A test shorter than this (seconds) records no CPU load: too brief to tell.
CPU_LOAD_MIN_WALL = 0.1


def _cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its children it waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


def _peaks() -> tuple[int | None, int | None]:
    """torch's reserved peak on all the test's devices together, and on its fullest one."""
    peaks = _probe.reserved_peaks()
    return (sum(peaks), max(peaks)) if peaks else (None, None)


def take_environment(go: _orders.Go) -> None:
    """The parent's environment as it is at this test's turn (its devices were set
    before this process started and are not part of it)."""
    for name in go.env_unset:
        os.environ.pop(name, None)
    os.environ.update(go.env_set)


def _keyboard_interrupt(exc: KeyboardInterrupt) -> _replies.Interrupted:
    """A KeyboardInterrupt raised by the test, with where pytest would say it was raised."""
    path, lineno = "", 0
    with contextlib.suppress(Exception):
        crash = pytest.ExceptionInfo.from_exception(exc).getrepr().reprcrash
        if crash is not None:
            path, lineno = str(crash.path), int(crash.lineno)
    return _replies.Interrupted(True, str(exc), None, path, lineno)
