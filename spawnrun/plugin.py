"""The ``pytest11`` entry point: options, marker, hooks, and the decision "spawn or not".

Runs in the parent (and, inert, in every child: there it only registers the marker
and options so the child's configuration matches the parent's). Hooks and wiring only:
the session's machinery lives in ``driver._session`` (the driver configured, children's
start, the session's end), ``driver._collection`` (early boots, the suite handed over)
and ``driver._terminal`` (header, summary, ``--spawn-explain``); each test's plan in
``config._plan``; process code in ``_runner``, ``_jobs``, ``_loop`` and ``_drive``;
decisions in ``dispatch``. The driver's own modules are imported when a session needs
them, not with the plugin: pytest loads it in every run, and fast mode starts its
template from here (``_headstart``).
"""

from __future__ import annotations

import faulthandler
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from spawnrun.child import _child
from spawnrun.config import _plan
from spawnrun.config import _settings
from spawnrun.config._plan import PLAN_KEY
from spawnrun.config._plan import SETTINGS_KEY
from spawnrun.config._plan import _skipped_statically
from spawnrun.config._plan import _spawns
from spawnrun.devices import _packing
from spawnrun.driver import _collection
from spawnrun.driver import _cudawatch
from spawnrun.driver import _early
from spawnrun.driver import _heap
from spawnrun.driver import _reruns
from spawnrun.driver import _session
from spawnrun.driver import _terminal
from spawnrun.launch import _headstart
from spawnrun.launch import _starting
from spawnrun.learn import _learned
from spawnrun.proc import _probe
from spawnrun.wire import _reports

#: Whether the run was told that /proc is missing (once).
NO_PROC_KEY = pytest.StashKey[bool]()


@pytest.hookimpl
def pytest_addoption(parser: pytest.Parser) -> None:
    _settings.add_options(parser)


@pytest.hookimpl
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before the conftests import torch: fast mode's template imports it meanwhile.
    _headstart.start(early_config)


@pytest.hookimpl
def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from spawnrun import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    ledger = node.config.stash.get(_session.LEDGER_KEY, None)
    if ledger is not None:
        node.workerinput[_session.LEDGER_INPUT] = ledger


@pytest.hookimpl
def pytest_configure(config: pytest.Config) -> None:
    if _child.owns(config):
        # The parent validated every setting; the child only registers the same markers
        # (for --strict-markers), from the same ini file and environment.
        marker = _settings.marker_name(config)
        _settings.register_markers(config, marker, _settings.forked_alias(config, marker))
        return
    _session.configure(config)
    global _peaks, _collected, _durations, _loads
    _peaks = config.stash[_session.PEAKS_KEY]
    _durations = config.stash[_session.DURATIONS_KEY]
    _loads = config.stash[_session.LOADS_KEY]
    _collected = config.stash.get(_session.COLLECTED_KEY, None)
    config.pluginmanager.register(_Spawns(), "spawnrun-spawns")
    config.pluginmanager.register(_AfterEachTest(config), "spawnrun-after-each-test")
    config.pluginmanager.register(_reruns.Logged(config), "spawnrun-reruns")


@pytest.hookimpl
def pytest_report_header(config: pytest.Config) -> list[str]:
    return _terminal.header(config)


@pytest.hookimpl
def pytest_sessionstart(session: pytest.Session) -> None:
    if SETTINGS_KEY in session.config.stash:
        _session.start(session)


@pytest.hookimpl
def pytest_itemcollected(item: pytest.Item) -> None:
    if _collected is not None:
        _collected.item(item.nodeid)


@pytest.hookimpl
def pytest_collectreport(report: pytest.CollectReport) -> None:
    if _collected is not None:  # the hook has no config to ask
        _collected.report(report)


@pytest.hookimpl
def pytest_collectstart() -> None:
    # torch may first be imported by a test module: watch its CUDA init from then on.
    _cudawatch.watch()


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(
    file_path: Path, parent: pytest.Collector
) -> Generator[None, list[pytest.Collector], list[pytest.Collector]]:
    collectors = yield
    # Listed, not yet imported: a child may import it beside the parent (``_early``).
    if any(isinstance(c, pytest.Module) for c in collectors) and _early.asked_for(
        parent, file_path
    ):
        _collection.boot_early(parent.config, file_path)
    return collectors


@pytest.hookimpl
def pytest_collection_finish(session: pytest.Session) -> None:
    _collection.finish(session)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Validate every selected test's marker now, so a typo is a usage error before
    # anything runs, not a surprise halfway through a GPU suite; and decide, once, what
    # each spawned test needs.
    if SETTINGS_KEY not in config.stash:
        return
    try:
        items[:] = _plan.plan_items(config, items, config.stash[_session.SCHEDULER_KEY].limit)
    except pytest.UsageError as exc:
        if not _session.xdist_worker():
            raise
        # A worker that raises here ends its session while xdist's controller waits for
        # its tests: an INTERNALERROR (``assert not crashitem``). A failed collection
        # report reaches the controller instead, which shows it once and runs nothing.
        report = pytest.CollectReport("", "failed", f"{_USAGE_ERROR}: {exc}", [])
        config.hook.pytest_collectreport(report=report)
        items[:] = []


#: How a usage error found while a worker plans its tests is reported under xdist.
_USAGE_ERROR = "spawnrun: usage error"


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    """``--spawn-explain``: say where each test would run; run nothing."""
    return True if _terminal.explain(session) else None


class _Spawns:
    """spawnrun's ``pytest_runtest_protocol``, registered at configure time.

    Among ``tryfirst`` implementations the one registered last runs first: registered
    after every plugin pytest loaded, spawnrun takes its tests before another plugin
    that runs tests its own way can (pytest-forked's ``--forked`` would fork the pytest
    process, CUDA and all). What spawnrun does not spawn, such plugins still run.
    """

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> bool | None:
        return _runtest_protocol(item, nextitem)


def _runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    config = item.config
    scheduler = config.stash.get(_session.SCHEDULER_KEY, None)
    if scheduler is None:
        return None
    if not _spawns(item):
        if not _skipped_statically(item):
            _heap.ran_here(config)
        scheduler.reached(nextitem)  # replay children that ended meanwhile
        if scheduler.pending and scheduler.stops():
            # A failure may stop the session: as in-process, this test runs only once
            # the spawned tests before it have reported, and not at all if one of them
            # stopped the session (pytest would never have reached it).
            scheduler.drain()
            if item.session.shouldfail or item.session.shouldstop:
                return True
        return None
    if not config.stash.get(NO_PROC_KEY, False) and not _probe.proc_mounted():
        config.stash[NO_PROC_KEY] = True
        _reports.record_warning(config, _reports.warning(_reports.NO_PROC), "")
    # pytest's faulthandler_timeout would dump the parent's own wait: the child, which
    # gets the same setting, dumps the test's stacks instead.
    faulthandler.cancel_dump_traceback_later()
    _cudawatch.check(config)
    scheduler.submit(item, nextitem, item.stash[PLAN_KEY])
    if scheduler.limit == 1:
        # One at a time: the test's reports arrive inside its own protocol, as
        # pytest-xdist's workers require and as plain pytest would do.
        scheduler.drain()
    return True


class _AfterEachTest:
    """Runs after every test's protocol, spawned or not (a wrapper around them all), and
    after every report junitxml takes (which test each of its test cases is)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> Generator[None, None, None]:
        cases = _session.junit_cases(self.config)
        before = len(cases) if cases is not None else 0
        yield
        if cases is not None:
            _session.junit_cases_of(self.config, cases[before:], report.nodeid)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        result = yield
        scheduler = item.config.stash[_session.SCHEDULER_KEY]
        session = item.session
        if session.shouldfail or session.shouldstop:
            scheduler.abort()
        elif nextitem is None:
            # The last test: wait for all children now, so the exit status counts them.
            scheduler.last()
            if item.config.stash[_starting.SHARED_KEY].coverage:
                # And for them to be gone: their coverage data is saved as they leave,
                # and pytest-cov combines it when the run loop ends (before sessionfinish).
                scheduler.finish()
        return result


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _session.end(session, exitstatus):
        return
    workeroutput = getattr(session.config, "workeroutput", None)
    if isinstance(workeroutput, dict):  # an xdist worker: its controller prints it
        workeroutput[_terminal.WORKER_SUMMARY] = _terminal.summary_lines(session.config)
    _session.close(session)


@pytest.hookimpl
def pytest_unconfigure(config: pytest.Config) -> None:
    if _session.SCHEDULER_KEY in config.stash:
        # pytest's final collections follow, then the interpreter's; an xdist worker's
        # process ends with its session too.
        _heap.freeze_if_spared(config, _session.xdist_worker())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's controller: keep what a worker's spawned tests came to, for the summary."""
    _terminal.keep_worker_summary(node)


@pytest.hookimpl
def pytest_terminal_summary(terminalreporter: Any) -> None:
    _reruns.show_first_runs(terminalreporter, terminalreporter.config)
    _terminal.write_summary(terminalreporter)


#: True while a test's report is being logged: only its own line names its devices.
_logging_report = False
#: The run's measured peaks (``_session.PEAKS_KEY``): the logreport hook has no config.
_peaks: dict[str, int] | None = None
#: What this run's collection yielded (``_session.COLLECTED_KEY``), to prune learned peaks.
_collected: _learned.Collected | None = None
#: The run's durations of spawned tests (``_session.DURATIONS_KEY``).
_durations: dict[str, float] | None = None
#: The run's CPU loads of spawned tests (``_session.LOADS_KEY``).
_loads: dict[str, float] | None = None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> Generator[None, None, None]:
    global _logging_report
    _logging_report = True
    try:
        yield
    finally:
        _logging_report = False
    properties = dict(getattr(report, "user_properties", ()) or ())
    if report.when != "teardown":
        return
    # Replayed here from a child, or from an xdist worker in the controller. A test can
    # write these properties itself (``record_property``): only what the cache may hold
    # is kept (``_learned.valid``).
    peak = properties.get(_reports.LEARNED_PEAK)  # MiB
    if isinstance(peak, (int, float)) and not isinstance(peak, bool) and _peaks is not None:
        try:
            measured = int(peak * 2**20)
        except (OverflowError, ValueError):  # infinity, NaN
            measured = -1
        if _learned.valid(_learned.CACHE_PEAKS, measured):
            _peaks[report.nodeid] = measured
    wall = properties.get(_reports.WALL_PROPERTY)  # a spawned test's, from its go to its end
    if _learned.valid(_learned.CACHE_DURATIONS, wall) and _durations is not None:
        _durations[report.nodeid] = float(wall)  # type: ignore[arg-type]
    load = properties.get(_reports.CPU_LOAD_PROPERTY)
    if _learned.valid(_learned.CACHE_LOADS, load) and _loads is not None:
        _loads[report.nodeid] = float(load)  # type: ignore[arg-type]


@pytest.hookimpl(wrapper=True)
def pytest_report_teststatus(
    report: pytest.TestReport, config: pytest.Config
) -> Generator[None, Any, Any]:
    result = yield
    if report.outcome == "rerun":  # type: ignore[comparison-overlap]
        # A first run kept where a test ran again (``_reruns``): pytest-rerunfailures'
        # outcome and letter, which its own hook gives where it is installed.
        result = ("rerun", "R", ("RERUN", {"yellow": True}))
    # With -v, a spawned test's own line names its devices: "PASSED [gpu 1]". Nowhere
    # else: the short summary keeps "FAILED <nodeid>" as tools parse it.
    properties = dict(getattr(report, "user_properties", ()) or ())
    devices = properties.get("spawnrun_devices")
    budget = properties.get(_reports.BUDGET_PROPERTY)
    if devices and isinstance(budget, (int, float)):
        devices = f"{devices}, {_packing.show(int(budget * 2**20))}"
    if (
        _logging_report
        and devices
        and config.get_verbosity() > 0
        and result
        and isinstance(result, tuple)
        and len(result) == 3
    ):
        category, letter, word = result
        if isinstance(word, tuple) and word[0]:
            word = (f"{word[0]} [gpu {devices}]", word[1])
        elif isinstance(word, str) and word:
            word = f"{word} [gpu {devices}]"
        result = (category, letter, word)
    return result


def _stands_aside(item: pytest.Item) -> bool:
    return item.config.stash.get(SETTINGS_KEY, None) is not None and _spawns(item)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item) -> bool | None:
    # pytest-timeout in the parent would fire its alarm inside spawnrun's own wait;
    # the child runs pytest-timeout for the test itself, so the parent stands aside.
    return True if _stands_aside(item) else None


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    return True if _stands_aside(item) else None
