"""The child's pytest plugin: find the test, say so, wait for the go, stream its reports.

Runs in the child only (a spawned child, a fork of a template). ``_child`` sets the
process up and registers a ``Relay``; from pytest's collection on, the relay serves the
test: ``Booted``, the go, each phase and report as pytest logs it, ``Done``; a scope's
child waits for its next test, a file's template forks one process per test
(``_template``). Messages carry plain data only, whatever the test put in them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import gc
import io
import os
import pickle
import resource
import sys
import time
import traceback
import types
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO
from typing import Any

import pytest

from spawnrun.child import _budget
from spawnrun.child import _environ
from spawnrun.child import _forksafe
from spawnrun.child import _leftovers
from spawnrun.child import _stackhook
from spawnrun.child import _streams
from spawnrun.child import _template
from spawnrun.child import _threadwatch
from spawnrun.child._leave import DUMP_SIGNAL
from spawnrun.proc import _bytecode
from spawnrun.proc import _libraries
from spawnrun.proc import _probe
from spawnrun.wire import _identity
from spawnrun.wire import _orders
from spawnrun.wire import _protocol as proto
from spawnrun.wire import _replies

#: Plugins that run each test in a fork of the process (pytest-forked, and a local copy
#: loaded as ``-p forked``): gone from the child before any test runs.
FORKING_PLUGINS = ("pytest_forked", "forked")

_MAX_LISTED_IDS = 10
#: At most this many modules a test imported are told (``Done.imported``).
_MAX_IMPORTED = 2000
#: How much of the child's own terminal output explains an early end.
_EARLY_TAIL = 8000
#: A captured-output section longer than this keeps only its tail, so a test that
#: prints 100 MB neither floods the pipe nor bloats the parent.
SECTION_LIMIT = 256 * 1024


NO_DEBUGGER = (
    "spawnrun: a debugger cannot stop a test that runs in a spawned child (it has no "
    "terminal to talk to). Run the test in-process: add --no-spawn, or select it alone "
    "with --pdb or --trace, which imply in-process runs"
)


def _refuse_debuggers() -> None:
    """``breakpoint()`` / ``pdb.set_trace()`` fail with a hint instead of a bare BdbQuit.

    A choice made through PYTHONBREAKPOINT (a remote debugger, say) is left alone.
    """

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(NO_DEBUGGER)

    if not os.environ.get("PYTHONBREAKPOINT"):
        import pdb

        sys.breakpointhook = refuse
        pdb.set_trace = refuse


def arm_faulthandler(stacks: IO[str]) -> None:
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=stacks, all_threads=True, chain=False)


def _list_wanted(wanted: Callable[[str], bool]) -> Callable[[], None]:
    """pytest's directory and package collectors list only the ``wanted`` entries, until
    the returned function undoes it.

    They call the ignore hook for each entry of the directories on the way to the
    test: a hook call of every plugin, and a legacy path made for it, per sibling file
    (a fork of a template collecting one file of a folder of 40 spent a third of its
    collection on them). What is left out here, ``Relay.pytest_ignore_collect`` would
    ignore; other collectors (a plugin's own) still meet the hook. Where pytest lists
    directories otherwise (another version), nothing changes.

    The patch is of pytest's modules, which every session in the process shares: it is
    undone once the child's own collection is over (``Relay.undo``), so that a session
    its test starts (``pytester.runpytest()``, ``inline_run``) lists its directories as
    it would in-process, not filtered by the child's arguments.
    """
    import _pytest.pathlib

    listing = _pytest.pathlib.scandir

    def scandir(path: Any, *args: Any, **kwargs: Any) -> list[os.DirEntry[str]]:
        return [e for e in listing(path, *args, **kwargs) if wanted(e.path)]

    patched = []
    for name in ("_pytest.main", "_pytest.python"):
        module = sys.modules.get(name)
        if getattr(module, "scandir", None) is listing:
            module.scandir = scandir  # type: ignore[union-attr]
            patched.append(module)

    def undo() -> None:
        for module in patched:
            if module.scandir is scandir:  # type: ignore[union-attr]
                module.scandir = listing  # type: ignore[union-attr]

    return undo


def wanted_paths(args: list[str], invocation_dir: str) -> tuple[set[str], tuple[str, ...]] | None:
    """The paths the child's arguments name and every directory above them, and the
    directory arguments (what lies below them is wanted too); None: an argument that
    names no existing path (a module name for ``--pyargs``), so nothing is left out."""
    on_the_way: set[str] = set()
    below: list[str] = []
    for arg in args:
        path = os.path.abspath(os.path.join(invocation_dir, arg.split("::")[0]))
        if not os.path.exists(path):
            return None
        if os.path.isdir(path):
            below.append(path.rstrip(os.sep) + os.sep)
        while path not in on_the_way:
            on_the_way.add(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
    return on_the_way, tuple(below)


class Relay:
    """Child-side pytest plugin: finds the test, waits for the go, streams reports."""

    def __init__(self, spec: _orders.ChildSpec, conn: Connection, stacks: IO[str]) -> None:
        self.spec = spec
        self.conn = conn
        self.stacks = stacks
        self.booted = False
        self.interrupted = False
        self.collect_errors: list[str] = []
        #: What pytest reported as internal errors (a hook that raised), as text.
        self.internal_errors: list[str] = []
        self.notes: list[str] = []
        self.done = False
        #: The test being run (the spec's, then later ones of its scope).
        self.current = spec.nodeid
        #: The last ``Go`` taken between tests (a template's spare fork takes it too).
        self.last_go: _orders.Go | None = None
        self.config: Any = None
        #: Reports of the current execution made but not yet logged, by phase.
        self.made: dict[str, Any] = {}
        #: Where the test's terminal output starts in ``sink`` (set at the go).
        self.terminal_from = -1
        self.wanted = wanted_paths(spec.args, spec.invocation_dir)
        #: Where the child's terminal reporter writes (set at configure).
        self.sink: _Sink | None = None
        #: Its process's CPU seconds and the clock when its current test began.
        self.cpu_from: tuple[float, float] | None = None
        #: The modules the process had once booted (None: not booted).
        self.boot_modules: _libraries.Mark | None = None
        #: Undo what only its configuration and collection may see (``_availability``,
        #: ``_metadata``), before the test runs.
        self.undo: list[Callable[[], None]] = []

    def _left_running(self, processes: list[str], pids: list[int]) -> None:
        self.send(_replies.LeftRunning(self.current, processes, pids))

    def send(self, msg: _replies.Message) -> None:
        # Plain data only, whatever the test put in it (a tensor, an instance of a class
        # of its own): the parent must read every message without importing anything.
        fields = {f.name: proto.plain(getattr(msg, f.name)) for f in dataclasses.fields(msg)}
        self.conn.send_bytes(proto.frame(dataclasses.replace(msg, **fields)))

    # pytest hooks ---------------------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: Any) -> None:
        self.config = config
        _refuse_debuggers()
        self.undo.append(_list_wanted(self._wanted))
        # pytest's own faulthandler plugin points faulthandler at stderr during
        # configure; take it back so crash stacks land where the parent reads them.
        arm_faulthandler(self.stacks)
        # The parent prints the replayed reports; the child's terminal reporter stays,
        # since plugins (pytest-timeout, --setup-show) write through it, but without its
        # own per-test lines, and into a file (see _Sink).
        pm = config.pluginmanager
        pm.register(self._suite_property_plugin(), "spawnrun-suite-property")
        # A spawned test is never forked again (pytest-forked's --forked or marker):
        # its process is the fresh one this child is, which a fork would undo.
        for name in FORKING_PLUGINS:
            forking = pm.get_plugin(name)
            if forking is not None:
                pm.unregister(forking)
        old = pm.get_plugin("terminalreporter")
        if old is not None:
            pm.unregister(old)
            sink = self.sink = _Sink(
                os.path.join(os.path.dirname(self.spec.stacks_path), "terminal.log")
            )
            pm.register(_quiet_reporter(self)(config, sink), "terminalreporter")

    def _xunit2_warning(self, request: Any, fixture: str) -> None:
        family = self.spec.junit_family
        if family and family not in ("xunit1", "legacy"):
            request.node.warn(
                pytest.PytestWarning(
                    f"{fixture} is incompatible with junit_family '{family}' "
                    "(use 'legacy' or 'xunit1')"
                )
            )

    @pytest.fixture
    def record_property(self, request: Any) -> Any:
        """pytest's fixture, warning as it does when the parent writes junitxml."""
        self._xunit2_warning(request, "record_property")

        def append_property(name: str, value: object) -> None:
            request.node.user_properties.append((name, value))

        return append_property

    @pytest.fixture
    def record_xml_attribute(self, request: Any) -> Any:
        """pytest's fixture, sending the attribute to the parent, whose junitxml writes it."""
        request.node.warn(
            pytest.PytestExperimentalApiWarning("record_xml_attribute is an experimental feature")
        )
        self._xunit2_warning(request, "record_xml_attribute")

        def add_attribute(name: str, value: object) -> None:
            if self.spec.junit_family:
                self.send(_replies.XmlAttribute(str(name), str(value)))

        return add_attribute

    def _suite_property_plugin(self) -> Any:
        """pytest's ``record_testsuite_property``, sending the property to the parent,
        whose junitxml writes it. A session fixture may not be an instance method
        (pytest 9.2 warns, an error under ``filterwarnings = error``): it is a plain
        function of a plugin module of its own."""
        send = self.send

        @pytest.fixture(scope="session")
        def record_testsuite_property() -> Any:
            def record(name: str, value: object) -> None:
                __tracebackhide__ = True
                if not isinstance(name, str):
                    raise TypeError(f"name parameter needs to be a string, but {type(name)} given")
                send(_replies.SuiteProperty(name, str(value)))

            return record

        plugin = types.ModuleType("spawnrun_suite_property")  # fixtures of a module
        plugin.record_testsuite_property = record_testsuite_property  # type: ignore[attr-defined]
        return plugin

    def pytest_internalerror(self, excrepr: Any) -> None:
        # Kept for the parent: an error before this plugin's own pytest_configure ran (a
        # conftest's raised first) reaches only pytest's original terminal reporter.
        self.internal_errors.append(str(excrepr))

    def pytest_ignore_collect(self, collection_path: Any) -> bool | None:
        """Only what the child's arguments name is collected: their paths, the
        directories that lead to them and what lies below a directory argument.

        pytest lists each directory on the way to an argument and makes a collector of
        every file and folder in it, only to keep the one the argument names: in a
        folder of 400 test files (or transformers' 400 model folders) each child paid
        for all of them. Their ignore files and hooks still apply to what is kept.
        pytest's own directory collectors do not even see the rest (``_list_wanted``)."""
        return None if self._wanted(str(collection_path)) else True

    def _wanted(self, path: str) -> bool:
        if self.wanted is None:
            return True
        on_the_way, below = self.wanted
        return path in on_the_way or path.startswith(below)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.collect_errors.append(
                f"ERROR collecting {report.nodeid or '.'}\n{report.longreprtext}"
            )

    def finish(self) -> None:
        """Say "done" (once), or after it what went wrong since (``After``)."""
        try:
            if not self.done:
                self.done = True
                peak, per_device = _peaks()
                # The test is over: give the device back before the session's end, so
                # the next test on it waits only for memory that is really still held.
                _probe.release_devices()
                terminal = self._terminal_since()
                imported = self._imported()
                load = self._cpu_load()
                self.send(
                    _replies.Done(
                        self.notes,
                        terminal,
                        peak,
                        per_device,
                        jax_peak=_probe.jax_peak(),
                        imported=imported,
                        cpu_load=load,
                        doubt=_environ.doubt(),
                    )
                )
                if self.sink is not None:
                    self.sink.to_own()  # the session's end is no part of the test
            elif self.notes:
                self.send(_replies.After(self.notes))
        except OSError:
            pass  # the parent is gone or no longer listening: nothing left to tell
        self.notes = []
        sys.stdout.flush()
        sys.stderr.flush()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: Any) -> bool:
        self.serve(session)
        return True

    def serve(self, session: Any) -> None:
        """Find the test, say so, wait for the go, run it."""
        _bytecode.stop()  # collected: the test sees bytecode settings as the parent has
        for undo in self.undo:  # and torch and importlib as they are
            undo()
        waited = 0.0
        if not self.spec.nodeid:  # started early, before the parent had collected its test
            since = time.monotonic()
            if not self._take_assignment():
                self.booted = self.done = True  # dismissed: nothing is left to tell
                return
            waited = time.monotonic() - since
        wanted = self.spec.nodeid
        item = next((i for i in session.items if i.nodeid == wanted), None)
        if item is None:
            self.send(_replies.Booted(os.getpid(), False, self._not_found(session)))
            self.booted = True
            return
        problem = self._bind_parents(item)
        if problem:
            self.send(_replies.Booted(os.getpid(), False, problem))
            self.booted = True
            return
        unsafe = _zygote_refusal() if self.spec.fork_each else ""
        touched = _forksafe.boot_touch()
        if not touched and _environ.read_mask():
            # Its imports kept the device mask it saw: it must run on those devices,
            # as a boot that initialized the driver does.
            touched = "driver"
        self.boot_modules = _libraries.mark()
        self.send(
            _replies.Booted(
                os.getpid(), True, not_a_template=unsafe, waited=waited, touched=touched
            )
        )
        self.booted = True
        try:
            go = self.conn.recv()
        except (EOFError, OSError):
            return  # the parent stopped the run before this test's turn
        if not isinstance(go, _orders.Go):
            return
        # Everything the boot created (imports, collection) lives until the process
        # ends: keep the collector off it, so the session's end (pytest collects garbage
        # several times at unconfigure: ~0.3 s with torch loaded) stays short; the next
        # test on this device waits for this process to be gone.
        gc.freeze()
        self._mark_terminal()
        _take_environment(go)
        _stackhook.install(os.path.dirname(self.spec.stacks_path))  # a new PYTHONPATH, say
        if self.spec.executions:
            _continue_reruns(item, self.spec.executions)
        by_id = {i.nodeid: i for i in session.items}
        then = [by_id[n] for n in self.spec.then if n in by_id]
        if self.spec.fork_each:
            if not unsafe:
                _template.fork_each(self, item, then, by_id)
                return
            then = []  # it runs its one test itself, then ends
        while True:
            # A scope's child keeps the fixtures its next test shares up (nextitem).
            nextitem = then[0] if then else None
            self._run(item, nextitem)
            if nextitem is None:
                break
            found = self._next_test(by_id)
            if found is None:
                self._end_scope(session)
                return
            if found is not nextitem:
                # One in between did not come (another xdist worker ran it): tear down
                # what the next test does not share; a finalizer's error is told.
                try:
                    session._setupstate.teardown_exact(found)
                except Exception:  # noqa: BLE001 - told to the parent, never raised here
                    self.notes.append("error tearing fixtures down:\n" + traceback.format_exc())
            then = then[then.index(found) + 1 :] if found in then else []
            item = found
        # The test is over, session-scoped fixtures included (nextitem=None): say so
        # now. Session finish and unconfigure (pytest's final garbage collections cost
        # ~0.3 s with torch loaded) run after, off the parent's critical path.
        self.finish()

    def _take_assignment(self) -> bool:
        """Read which test this child is for (``Assign``); False: none came."""
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            return False
        if not isinstance(msg, _orders.Assign):
            return False
        self.spec = msg.onto(self.spec)
        self.current = msg.nodeid
        return True

    def _run(self, item: Any, nextitem: Any) -> None:
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

    def _next_test(self, by_id: dict[str, Any]) -> Any:
        """Say this test is done, and wait for the next one of the scope (None: stop)."""
        self._done_for_now()
        _probe.reset_peaks()
        return self._await_go(by_id)

    def _cpu_load(self) -> float | None:
        """The cores the test kept busy on average since its ``_run`` (None: unknown, or
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

    def _done_for_now(self) -> None:
        """Say the test is done; the process waits for another (``Done.more``)."""
        peak, per_device = _peaks()
        held = _probe.allocated()
        terminal = self._terminal_since()
        imported = self._imported()
        load = self._cpu_load()
        self.send(
            _replies.Done(
                self.notes,
                terminal,
                peak,
                per_device,
                True,
                jax_peak=_probe.jax_peak(),  # since the child started: JAX resets none
                held_bytes=held,
                imported=imported,
                cpu_load=load,
                doubt=_environ.doubt(),
            )
        )
        self.notes = []

    def _await_go(self, by_id: dict[str, Any]) -> Any:
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
        problem = self._bind_parents(item, go.params)
        if problem:
            return problem
        _take_environment(go)
        self.current = go.nodeid
        return ""

    def _end_scope(self, session: Any) -> None:
        """Stopped between tests: tear the scope's fixtures down, free the devices."""
        self.done = True  # the last test said "done"; what follows is told as After
        try:
            session._setupstate.teardown_exact(None)
        except BaseException:  # noqa: BLE001 - told to the parent, never raised here
            self.notes.append("error tearing the scope's fixtures down:\n" + traceback.format_exc())
        _probe.release_devices()
        self.finish()

    def _interrupted(self, msg: _replies.Interrupted) -> None:
        """The test stopped the session: say so, and say "done" before pytest ends here.

        The child's own session end (its "no tests ran" line and exit banner) is no part
        of the test: the parent's session ends the same way and says it once.
        """
        self.interrupted = True
        self.send(msg)
        self.finish()

    def _mark_terminal(self) -> None:
        """Remember where the test's terminal output will start (see ``pytest_configure``)."""
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

    def _terminal_since(self) -> str:
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
        return _bounded(data.decode("utf-8", "replace"))

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
        self.send(_replies.Report(data, terminal=self._terminal_since(), rendered=rendered))

    def _serializable(self, report: Any) -> Any:
        config = self.config
        # Some plugins settle a report's outcome when its status is asked, from state of
        # this process (subtests: a test whose subtests failed fails): ask here.
        with contextlib.suppress(Exception):
            config.hook.pytest_report_teststatus(report=report, config=config)
        report.sections = [(t, _bounded(c)) for t, c in report.sections]
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

    def ended_early(self, code: object) -> str:
        text = f"pytest ended in the child before it reached the test (exit status {code})"
        said = ""
        if self.sink is not None:
            self.sink.flush()
            path = self.sink.own.name
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    said = f.read()[-_EARLY_TAIL:].strip()
            except OSError:
                said = ""
        if not said and self.internal_errors:
            # The error came before this plugin took the terminal over.
            said = "\n".join(self.internal_errors)[-_EARLY_TAIL:].strip()
        return f"{text}; the child's pytest said:\n{said}" if said else text

    def _bind_parents(self, item: Any, theirs: dict[str, _orders.Binding] | None = None) -> str:
        """Make the child's test the parent's; "" once it is, else why it cannot be.

        Where the child's values read as the parent's, the child's own run (as they
        would in-process: one object, shared with its module). Where they differ (drawn
        at random at import, a set's order), the parent's values are put in their place,
        so the child runs exactly the parent's test. A value that cannot travel (it does
        not pickle, or does not unpickle here) leaves another test under this id: that
        is refused, never run.
        """
        mine = _identity.spellings(item)
        theirs = self.spec.params if theirs is None else theirs
        differ = sorted(k for k in mine if k in theirs and mine[k] != theirs[k].spelling)
        if set(mine) != set(theirs):
            return self._other_test(item, theirs, mine, "it takes other parameters")
        values = {}
        for name in differ:
            binding = theirs[name]
            if not binding.value:
                why = f"the parent's {name} cannot travel: {binding.unsent}"
                return self._other_test(item, theirs, mine, why)
            try:
                values[name] = pickle.loads(binding.value)
            except Exception as exc:  # noqa: BLE001 - whatever a value's reducer raises
                why = f"the parent's {name} does not unpickle here ({type(exc).__name__}: {exc})"
                return self._other_test(item, theirs, mine, why)
        if values:
            item.callspec.params.update(values)
        return ""

    def _other_test(
        self, item: Any, bindings: dict[str, _orders.Binding], mine: dict[str, str], why: str
    ) -> str:
        theirs = {k: b.spelling for k, b in bindings.items()}
        return (
            f"node id {item.nodeid!r} names another test in the child "
            f"(collected args: {' '.join(self.spec.args)}): the parent's binds "
            f"{_identity.describe(theirs)}, the child's binds {_identity.describe(mine)}, "
            f"and {why}. "
            "Its parameters come from data that differs between interpreters (random "
            "values drawn at import: seed them; a set, whose order follows the hash seed: "
            "sort it or set PYTHONHASHSEED) or from collection-time state (a counter in "
            "pytest_generate_tests); spawnrun will not run a different test under this id"
        )

    def _not_found(self, session: Any) -> str:
        lines = [
            f"node id {self.spec.nodeid!r} was not collected by the child "
            f"(collected args: {' '.join(self.spec.args)})"
        ]
        ids = [i.nodeid for i in session.items]
        if ids:
            shown = ids[:_MAX_LISTED_IDS]
            more = len(ids) - len(shown)
            lines.append(f"the child collected {len(ids)} test(s):")
            lines += [f"  {i}" for i in shown]
            if more:
                lines.append(f"  ... and {more} more")
        else:
            lines.append("the child collected no tests")
        lines += self.collect_errors
        return "\n".join(lines)


#: A test shorter than this (seconds) records no CPU load: too brief to tell.
CPU_LOAD_MIN_WALL = 0.1


def _cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its children it waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


def _zygote_refusal() -> str:
    """Why this process may not fork its tests ("" if it may): the template's own rules."""
    return _forksafe.unsafe_state()


def _peaks() -> tuple[int | None, int | None]:
    """torch's reserved peak on all the test's devices together, and on its fullest one."""
    peaks = _probe.reserved_peaks()
    return (sum(peaks), max(peaks)) if peaks else (None, None)


def _take_environment(go: _orders.Go) -> None:
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


def _continue_reruns(item: Any, done: int) -> None:
    """Make pytest-rerunfailures count this test's executions from ``done``.

    The parent reran the test after its child crashed or timed out: the reruns left are
    the ones its earlier children did not use. pytest-rerunfailures reads a test's count
    from its failures database (``config.failures_db``, not a public API: hence this one
    function, which does nothing where it is absent).
    """
    db: Any = getattr(item.config, "failures_db", None)
    get = getattr(db, "get_test_failures", None)
    if get is None:
        return
    nodeid = item.nodeid

    def get_test_failures(crashitem: str) -> int:
        count = int(get(crashitem))
        return max(count, done) if crashitem == nodeid else count

    db.get_test_failures = get_test_failures


class _Sink(io.TextIOBase):
    """Where the child's terminal reporter writes.

    While the child boots and ends: a file of its own (its header and collection lines
    are not the user's business; an error before the test is read from there). During
    the test: the child's output file, where what pytest writes (``--setup-show``,
    live logs, a plugin's dump) and what bypasses capture keep their order; the parent
    replays that in the test's place. With -s the output streams live and the reporter
    keeps its own file. Line-buffered: a plugin may end the process right after writing.
    """

    encoding = "utf-8"

    def __init__(self, path: str) -> None:
        self.own = self.target = _line_file(path, "w")
        self.current = path

    def to_output(self, path: str) -> None:
        self.target = _line_file(path, "a")
        self.current = path

    def reopen(self, path: str) -> None:
        """A fork's own file from now on (a configured template's fork)."""
        if self.target is not self.own:
            self.target.close()
        self.own.close()
        self.own = self.target = _line_file(path, "w")
        self.current = path

    def to_own(self) -> None:
        if self.target is not self.own:
            self.target.close()
            self.target = self.own
            self.current = self.own.name

    def write(self, text: str) -> int:
        return self.target.write(text)

    def flush(self) -> None:
        self.target.flush()

    def isatty(self) -> bool:
        return False


def _line_file(path: str, mode: str) -> IO[str]:
    return open(path, mode, buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115


def _quiet_reporter(relay: Relay) -> Any:
    """pytest's terminal reporter without its per-test lines: the parent prints those.

    Nor its session's end once ``relay`` said "done": the summary would go to the
    child's own terminal file, which nobody reads after the test (an early end's words
    are read from it only before), and the plugins' ``pytest_terminal_summary`` hooks it
    calls cost a child its exit time for nothing (hypothesis's imports the whole of
    hypothesis, assert-rewritten: ~0.5 s of CPU per child). The session's own end
    (``pytest_sessionfinish``, ``pytest_unconfigure``) still runs.
    """
    base = _terminal_reporter()

    class QuietReporter(base):  # type: ignore[misc, valid-type]
        @pytest.hookimpl(wrapper=True)
        def pytest_sessionfinish(self, session: Any, exitstatus: Any) -> Any:
            if relay.done:
                return (yield)
            return (yield from super().pytest_sessionfinish(session, exitstatus))

        def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
            pass

        def pytest_runtest_logreport(self, report: Any) -> None:
            pass

        def pytest_runtest_logfinish(self, nodeid: str) -> None:
            pass

    return QuietReporter


def _terminal_reporter() -> Any:
    """pytest's TerminalReporter class: public from pytest 8.4, internal before."""
    reporter = getattr(pytest, "TerminalReporter", None)
    if reporter is None:
        from _pytest.terminal import TerminalReporter as reporter
    return reporter


def _bounded(content: str) -> str:
    if len(content) <= SECTION_LIMIT:
        return content
    cut = len(content) - SECTION_LIMIT
    return f"[spawnrun: {cut} characters cut, the last {SECTION_LIMIT} follow]\n" + content[cut:]
