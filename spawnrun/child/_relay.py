"""The child's pytest plugin: find the test, say so, wait for the go, stream its reports.

Runs in the child only (a spawned child, a fork of a template). ``_child`` sets the
process up and registers a ``Relay``; from pytest's collection on, the relay serves the
test: ``Booted``, the go, each phase and report as pytest logs it, ``Done``; a scope's
child waits for its next test, a file's template forks one process per test
(``_template``). The relay owns the boot: pytest's configuration as the child needs it
(its terminal reporter writing into a ``_sink.Sink``, junitxml's recording fixtures),
its collection (``_collection``) and the serving of the test and its scope's next ones;
a test's own turn, from the go to "done", is its base class's (``_turn.Turn``).
Messages carry plain data only, whatever the test put in them.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import time
import traceback
import types
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import IO
from typing import Any

import pytest

from spawnrun.child import _collection
from spawnrun.child import _environ
from spawnrun.child import _forksafe
from spawnrun.child import _sink
from spawnrun.child import _stackhook
from spawnrun.child import _template
from spawnrun.child import _turn
from spawnrun.child._leave import DUMP_SIGNAL
from spawnrun.proc import _bytecode
from spawnrun.proc import _libraries
from spawnrun.proc import _probe
from spawnrun.wire import _orders
from spawnrun.wire import _replies

#: Plugins that run each test in a fork of the process (pytest-forked, and a local copy
#: loaded as ``-p forked``): gone from the child before any test runs.
FORKING_PLUGINS = ("pytest_forked", "forked")

#: How much of the child's own terminal output explains an early end.
_EARLY_TAIL = 8000


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


class Relay(_turn.Turn):
    """Child-side pytest plugin: finds the test, waits for the go, streams reports."""

    def __init__(self, spec: _orders.ChildSpec, conn: Connection, stacks: IO[str]) -> None:
        super().__init__(spec, conn, stacks)
        self.booted = False
        self.collect_errors: list[str] = []
        #: What pytest reported as internal errors (a hook that raised), as text.
        self.internal_errors: list[str] = []
        self.wanted = _collection.wanted_paths(spec.args, spec.invocation_dir)
        #: Undo what only its configuration and collection may see (``_availability``,
        #: ``_metadata``), before the test runs.
        self.undo: list[Callable[[], None]] = []

    # pytest hooks ---------------------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: Any) -> None:
        self.config = config
        _refuse_debuggers()
        self.undo.append(_collection.list_wanted(self._wanted))
        # pytest's own faulthandler plugin points faulthandler at stderr during
        # configure; take it back so crash stacks land where the parent reads them.
        arm_faulthandler(self.stacks)
        # The parent prints the replayed reports; the child's terminal reporter stays,
        # since plugins (pytest-timeout, --setup-show) write through it, but without its
        # own per-test lines, and into a file (see ``_sink.Sink``).
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
            sink = self.sink = _sink.Sink(
                os.path.join(os.path.dirname(self.spec.stacks_path), "terminal.log")
            )
            reporter = _sink.quiet_reporter(lambda: self.done)
            pm.register(reporter(config, sink), "terminalreporter")

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
        pytest's own directory collectors do not even see the rest (``_collection.list_wanted``)."""
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
            why = _collection.not_found(self.spec, session, self.collect_errors)
            self.send(_replies.Booted(os.getpid(), False, why))
            self.booted = True
            return
        problem = _collection.bind_parents(item, self.spec, self.spec.params)
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
        self.mark_terminal()
        _turn.take_environment(go)
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
            self.run(item, nextitem)
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

    def _next_test(self, by_id: dict[str, Any]) -> Any:
        """Say this test is done, and wait for the next one of the scope (None: stop)."""
        self.done_for_now()
        _probe.reset_peaks()
        return self.await_go(by_id)

    def _end_scope(self, session: Any) -> None:
        """Stopped between tests: tear the scope's fixtures down, free the devices."""
        self.done = True  # the last test said "done"; what follows is told as After
        try:
            session._setupstate.teardown_exact(None)
        except BaseException:  # noqa: BLE001 - told to the parent, never raised here
            self.notes.append("error tearing the scope's fixtures down:\n" + traceback.format_exc())
        _probe.release_devices()
        self.finish()

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


def _zygote_refusal() -> str:
    """Why this process may not fork its tests ("" if it may): the template's own rules."""
    return _forksafe.unsafe_state()


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
