"""The ``pytest11`` entry point: options, marker, and the decision "spawn or not".

Runs in the parent (and, inert, in every child: there it only registers the marker
and options so the child's configuration matches the parent's). Wiring only; process
code lives in ``_runner``, ``_jobs``, ``_loop`` and ``_drive``; decisions in ``dispatch``.
Those are imported when a session needs them, not with the plugin: pytest loads it in
every run, and fast mode starts its template from here (``_headstart``).
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import threading
from collections.abc import Generator
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING
from typing import Any

import pytest

from spawnrun.child import _child
from spawnrun.config import _parse
from spawnrun.config import _settings
from spawnrun.config._plan import CAPACITY_KEY
from spawnrun.config._plan import INVENTORY_KEY
from spawnrun.config._plan import ITEM_KEY
from spawnrun.config._plan import PER_GPU_KEY
from spawnrun.config._plan import PLAN_KEY
from spawnrun.config._plan import SETTINGS_KEY
from spawnrun.config._plan import SPAWNS_KEY
from spawnrun.config._plan import _cannot_run
from spawnrun.config._plan import _plan
from spawnrun.config._plan import _plan_from
from spawnrun.config._plan import _plan_of
from spawnrun.config._plan import _scopes
from spawnrun.config._plan import _should_spawn
from spawnrun.config._plan import _skipped_statically
from spawnrun.config._plan import _spawns
from spawnrun.devices import _devices
from spawnrun.devices import _inventory
from spawnrun.devices import _ledger
from spawnrun.devices import _packing
from spawnrun.driver import _cudawatch
from spawnrun.driver import _early
from spawnrun.driver import _ending
from spawnrun.driver import _heap
from spawnrun.launch import _forkserver
from spawnrun.launch import _headstart
from spawnrun.launch import _runner
from spawnrun.launch import _starting
from spawnrun.learn import _learned
from spawnrun.learn import _unforked
from spawnrun.proc import _bytecode
from spawnrun.proc import _probe
from spawnrun.wire import _reports

if TYPE_CHECKING:
    from spawnrun.driver import _drive

SCHEDULER_KEY: pytest.StashKey[_drive.Driver] = pytest.StashKey()
#: Peaks measured in this run (node id -> bytes on its fullest device), for the cache.
PEAKS_KEY = pytest.StashKey[dict[str, int]]()
COLLECTED_KEY = pytest.StashKey[_learned.Collected]()
#: The run's spawned tests' durations (setup, call and teardown), node id -> seconds.
DURATIONS_KEY = pytest.StashKey[dict[str, float]]()
LOADS_KEY = pytest.StashKey[dict[str, float]]()
#: The files whose tests earlier runs spawned (``_early.remembered``), read once.
REMEMBERED_KEY = pytest.StashKey[dict[str, "_early.Guess"]]()
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


def _xdist_worker() -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


def _xdist_controller(config: pytest.Config) -> bool:
    """The xdist controller runs no test itself: it needs no zygote."""
    return _settings.xdist_controller(config.getoption)


#: Under xdist, in the controller: the private directory of the workers' device ledger.
LEDGER_KEY = pytest.StashKey[str]()
#: The workerinput key that hands the ledger's directory to each worker.
LEDGER_INPUT = "spawnrun_ledger"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    ledger = node.config.stash.get(LEDGER_KEY, None)
    if ledger is not None:
        node.workerinput[LEDGER_INPUT] = ledger


#: Tests at once by default where the run has no devices: one per core, at most this.
DEVICELESS_JOBS = 8


def _default_jobs(gpus: int, per_gpu: int, cpus: int) -> int:
    """Every device filled to its cap, as far as there are cores; one per GPU at least.
    Without devices, one per core (at most ``DEVICELESS_JOBS``), as tests without
    devices (``count=0``) run beside each other on a GPU machine: a run on a machine
    without GPUs took one test at a time, whatever its cores."""
    if gpus == 0:
        return max(1, min(DEVICELESS_JOBS, cpus))
    return max(1, gpus, min(gpus * per_gpu, cpus))


@pytest.hookimpl
def pytest_configure(config: pytest.Config) -> None:
    if _child.owns(config):
        # The parent validated every setting; the child only registers the same markers
        # (for --strict-markers), from the same ini file and environment.
        marker = _settings.marker_name(config)
        _register_markers(config, marker, _settings.forked_alias(config, marker))
        return
    # The run's machinery, in the parent only: children never import it.
    from spawnrun.driver import _drive
    from spawnrun.driver import _poison
    from spawnrun.driver import _status

    settings = _settings.resolve(config)
    _register_markers(config, settings.marker, settings.forked_alias)
    inventory = _inventory.inventory(settings.gpus, os.environ, settings.gpu_vendor)
    # NVML lookups and children's environments name devices through it, from now on.
    _inventory.activate(inventory)
    config.add_cleanup(lambda: _inventory.activate(None))
    cpus = _parse.usable_cpus()
    per_gpu = settings.per_gpu or _packing.default_per_gpu(cpus, len(inventory.ids))
    if settings.pack == "off":
        per_gpu = 1
    capacity = _devices.capacities(inventory.ids, settings.gpu_memory)
    # Under xdist each worker runs one child at a time; the workers are the parallelism.
    if _xdist_worker():
        limit = 1
    else:
        limit = settings.jobs or _default_jobs(len(inventory.ids), per_gpu, cpus)
    ledger = None
    if _xdist_worker():
        ledger = getattr(config, "workerinput", {}).get(LEDGER_INPUT)
    elif _xdist_controller(config):
        ledger_dir = str(_ledger.private_dir())
        config.stash[LEDGER_KEY] = ledger_dir
        # Also when a later plugin's configure fails and no session ever finishes.
        config.add_cleanup(lambda: shutil.rmtree(ledger_dir, ignore_errors=True))
    config.stash[SETTINGS_KEY] = settings
    _warn_fast_mode_only(config, settings)
    config.stash[INVENTORY_KEY] = inventory
    config.stash[CAPACITY_KEY] = capacity
    config.stash[PER_GPU_KEY] = per_gpu
    global _peaks, _collected, _durations, _loads
    _peaks = config.stash[PEAKS_KEY] = {}
    _durations = config.stash[DURATIONS_KEY] = {}
    _loads = config.stash[LOADS_KEY] = {}
    _collected = None
    if not _xdist_controller(config):  # its workers collect, it does not
        _collected = config.stash[COLLECTED_KEY] = _learned.Collected(config)
    lookahead = settings.lookahead
    if lookahead is None:
        lookahead = _parse.default_lookahead()
    holder = None
    if (
        settings.method == "forkserver"
        and not _xdist_controller(config)
        and settings.runs_children(config.getoption)
    ):
        holder = config.stash[_starting.ZYGOTE_KEY] = _forkserver.ZygoteHolder(
            list(settings.preload)
        )
    head = config.stash.get(_headstart.KEY, None)
    if holder is None and head is not None:
        head.close()  # the template started early is not wanted after all
    scheduler = config.stash[SCHEDULER_KEY] = _drive.Driver(
        _ledger.allocator_for(inventory.ids, ledger, capacity, per_gpu),
        limit,
        settings.settle,
        lookahead,
        holder,
    )
    if _boots_early(config, settings):
        scheduler.early = _early.Early(lookahead)
    scheduler.config = config
    scheduler.told_next = _xdist_worker()
    scheduler.status = _status.Status(config, several=limit > 1)
    scheduler.poison = _poison.patterns(settings.poison)
    scheduler.replace_above = settings.scope_memory
    scheduler.guessing = settings.pack == "auto"
    scheduler.cpus = cpus
    config.pluginmanager.register(_Spawns(), "spawnrun-spawns")
    config.pluginmanager.register(_AfterEachTest(), "spawnrun-after-each-test")
    _cudawatch.watch()
    _install_sigterm(config)


def _warn_fast_mode_only(config: pytest.Config, settings: _settings.Settings) -> None:
    """Settings that only fast mode reads, set where it is off, say they do nothing."""
    if settings.method == "forkserver" or settings.no_spawn or settings.forced_inprocess:
        return
    for name in ("template", "preload"):
        source = _settings.source_of(config, name)
        if source != "the default":
            config.issue_config_time_warning(
                pytest.PytestWarning(
                    f"spawnrun: {source} does nothing here: it is read in fast mode only "
                    "(--spawn-method forkserver), and this run spawns each child"
                ),
                stacklevel=2,
            )


def _boots_early(config: pytest.Config, settings: _settings.Settings) -> bool:
    """Whether children may start while the parent collects (``_early``).

    Not where no test will run (``--collect-only``, in-process runs), nor under xdist (a
    worker learns which files are its own only after collection). In fast mode only
    where every spawned test shares a class's or module's child: an early child is
    spawned (the zygote is not ready yet), which costs a whole interpreter's imports
    where a fork of the zygote, or of its file's template, costs a few milliseconds.
    """
    if not settings.runs_children(config.getoption) or config.getoption("setupplan", False):
        return False
    if settings.method == "forkserver" and settings.scope == "test":
        return False
    return not (_xdist_worker() or _xdist_controller(config))


def _register_markers(config: pytest.Config, marker: str, forked_alias: bool) -> None:
    # Only the configured name: a project's own gpu marker stays untouched when
    # spawn_marker names another.
    config.addinivalue_line("markers", _settings.marker_doc(marker))
    if forked_alias:
        config.addinivalue_line("markers", _settings.forked_doc(marker))


def _install_sigterm(config: pytest.Config) -> None:
    # Python dies on SIGTERM without running any cleanup, which would orphan the
    # children (each leads its own session). Turn it into an interrupt instead,
    # unless someone else already handles SIGTERM.
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        _runner.kill_all_live()
        raise KeyboardInterrupt("SIGTERM")

    def restore() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, on_sigterm)
    config.add_cleanup(restore)


@pytest.hookimpl
def pytest_report_header(config: pytest.Config) -> list[str]:
    settings = config.stash.get(SETTINGS_KEY, None)
    if settings is None:
        return []
    if settings.forced_inprocess:
        return [settings.forced_inprocess]
    if settings.no_spawn:
        return ["spawnrun: --no-spawn given, every test runs in-process"]
    what = "every test" if settings.spawn_gpu else f"tests marked {settings.marker}"
    scheduler = config.stash[SCHEDULER_KEY]
    how = "a fresh spawn child"
    if settings.method == "forkserver":
        how = "a fresh forked child (fast mode, --spawn-method forkserver)"
    lines = [
        f"spawnrun: {what} run in {how}, up to {scheduler.limit} at once, "
        f"{scheduler.lookahead} booted ahead",
        config.stash[INVENTORY_KEY].describe(),
    ]
    capacity = config.stash[CAPACITY_KEY]
    if capacity and settings.pack != "off" and None in capacity.values():
        lines.append(
            "spawnrun: each GPU test runs alone on its GPU, even with a memory= budget: "
            "how much memory the GPUs have is unknown here (NVML is not available). "
            "To let budgeted tests share a GPU, give it: --spawn-gpu-memory 80GiB"
        )
    elif capacity and settings.pack != "off":
        sizes = sorted({_packing.show(c) for c in capacity.values()})
        lines.append(
            f"spawnrun: packing {settings.pack}: tests with a memory budget share a GPU, "
            f"up to {scheduler.allocator.per_gpu} at once, within its memory "
            f"({', '.join(sizes)}) less {_packing.show(_packing.RESERVE)} per test"
        )
    return lines


@pytest.hookimpl
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if SETTINGS_KEY not in config.stash:
        return
    # Once, when every plugin has configured itself (and coverage, if any, runs): all
    # children get these options.
    environ = {}
    if _bytecode.wanted(config.stash[SETTINGS_KEY].pycache):
        head = config.stash.get(_headstart.KEY, None)
        early = head.child_environ.get(_bytecode.ENV) if head is not None else None
        environ[_bytecode.ENV] = early or _starting.pycache_dir(config)
        _bytecode.write_into(environ[_bytecode.ENV])  # until collection ends
        config.add_cleanup(_bytecode.stop)  # a collection that never ends, too
    settings = config.stash[SETTINGS_KEY]
    # Fast mode forks children from a template that configured pytest once, unless
    # each child is to configure its own (``--spawn-template library``).
    configured = settings.method == "forkserver" and settings.template != "library"
    config.stash[_starting.SHARED_KEY] = _starting.shared(config, environ, configured)
    holder = config.stash.get(_starting.ZYGOTE_KEY, None)
    if holder is not None:
        holder.child_environ = environ
        holder.start(config, config.stash.get(_headstart.KEY, None))


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
        _boot_early(parent.config, file_path)
    return collectors


def _boot_early(config: pytest.Config, path: Path) -> None:
    """Start a child for a test file whose tests will likely be spawned, if one is due.

    Likely: every test is (``--spawn-gpu``), the file names the spawn marker (its
    default count is guessed), or an earlier run spawned its tests (what the first one
    needed is guessed). Where too few devices are there, such tests are skipped: none
    is started. A test that needs others dismisses it.
    """
    scheduler = config.stash.get(SCHEDULER_KEY, None)
    # Each collected file is read for a guess only while it may be of use.
    primes = _starting.may_prime(config)
    if scheduler is None or not (scheduler.early.wants() or primes):
        return
    settings = config.stash[SETTINGS_KEY]
    if REMEMBERED_KEY not in config.stash:
        config.stash[REMEMBERED_KEY] = _early.remembered(config)
    guess = _early.guess(path, settings.marker, config.stash[REMEMBERED_KEY], config.rootpath)
    marked, count, need, source = guess or (False, 0, None, "")
    if not (marked or settings.spawn_gpu):
        return  # an unmarked test spawns with --spawn-gpu only
    if count is None:
        count = settings.count
    ids = config.stash[INVENTORY_KEY].ids
    capacity = config.stash[CAPACITY_KEY]
    if marked and count > len(ids):
        return  # such tests are skipped here (a machine without GPUs, say)
    per_gpu = config.stash.get(PER_GPU_KEY, 1)
    plan = _plan_from(marked, count, settings, {}, ids, capacity, None, None, per_gpu)
    if need is not None:  # the budget the file's first spawned test had last time
        plan = replace(plan, need=need, budget_source=source, alone_because="")
    if scheduler.early.wants():
        scheduler.expect(str(path), plan)  # the dispatcher decides whether, and where
    elif primes:  # fast mode: a fork of a configured template, rather than a spawn
        devices = list(ids) if plan.every else list(ids[: plan.count])
        env = _starting.child_env(config, plan, devices, capacity)
        # The first tests wait for it where the cores are fewer than what would configure
        # pytest at once (it, the parent, the first jobs); else they do beside it.
        wait = scheduler.cpus < scheduler.limit + 2
        _starting.prime(config, str(path), env, wait)


@pytest.hookimpl
def pytest_collection_finish(session: pytest.Session) -> None:
    scheduler = session.config.stash.get(SCHEDULER_KEY, None)
    if scheduler is not None:
        spawned: dict[Path, _early.Guess] = {}
        for item in session.items:
            if item.path not in spawned and _spawns(item):  # the file's first spawned test
                plan = _plan_of(item)
                need = None if plan.need is _packing.ALONE else plan.need
                spawned[item.path] = (not plan.every, plan.count, need, plan.budget_source)
        settings = session.config.stash[SETTINGS_KEY]
        in_process = settings.no_spawn or settings.forced_inprocess
        # Not from a worker (it writes no cache; the controller collects none), nor
        # from a run that spawns nothing because it was told so.
        if not _xdist_worker() and not in_process:
            _early.remember(session.config, spawned, {i.path for i in session.items})
    _bytecode.stop()  # the tests see bytecode settings as they were
    holder = session.config.stash.get(_starting.ZYGOTE_KEY, None)
    if holder is not None:
        # Preload in the template what collection imported.
        holder.collected({Path(str(item.path)) for item in session.items})
    if scheduler is not None:
        # Once the zygote forks what collection imported: children may boot ahead now.
        scheduler.suite([(it, _plan_of(it)) for it in session.items if _spawns(it)])


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Validate every selected test's marker now, so a typo is a usage error before
    # anything runs, not a surprise halfway through a GPU suite; and decide, once, what
    # each spawned test needs.
    settings = config.stash.get(SETTINGS_KEY, None)
    if settings is None:
        return
    inventory = config.stash[INVENTORY_KEY]
    ids = inventory.ids
    capacity = config.stash[CAPACITY_KEY]
    learned = _learned.peaks(config) if settings.pack == "auto" else {}
    # Tests whose fork an earlier run doubted: spawned fresh, never forked.
    unforked = _unforked.remembered(config) if settings.method == "forkserver" else {}
    known = _unforked.known_failures(config) if settings.method == "forkserver" else {}
    for item in items:
        overrides = _settings.marker_overrides(item, settings)
        item.stash[ITEM_KEY] = overrides
        spawns = _should_spawn(item, settings)
        plan = _plan(item, settings, overrides, ids, capacity, learned)
        if item.nodeid in unforked:
            why = _unforked.REMEMBERED.format(why=unforked[item.nodeid])
            plan = replace(plan, unforked=why)
        elif item.nodeid in known:
            plan = replace(plan, known_failure=known[item.nodeid])
        item.stash[PLAN_KEY] = plan
        reason = ""
        if spawns or plan.count:
            reason = inventory.refuses(plan.count) or _cannot_run(plan, ids, capacity)
        if reason:
            # Skipped where it stands, in-process: no child for a test that cannot run.
            item.add_marker(pytest.mark.skip(reason=reason))
            spawns = False
        elif spawns and _skipped_statically(item):
            spawns = False  # pytest skips it here, as in the child, without a child
        item.stash[SPAWNS_KEY] = spawns
    items[:] = _scopes(config, settings, items, config.stash[SCHEDULER_KEY].limit)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    """``--spawn-explain``: say where each test would run; run nothing."""
    config = session.config
    settings = config.stash.get(SETTINGS_KEY, None)
    if settings is None or not settings.explain:
        return None
    from spawnrun.config import _explain
    from spawnrun.learn import _boots

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    scheduler = config.stash[SCHEDULER_KEY]
    fast = settings.method == "forkserver"
    header = [
        config.stash[INVENTORY_KEY].describe(),
        f"spawnrun: up to {scheduler.limit} test(s) at once, "
        f"at most {scheduler.allocator.per_gpu} per GPU; packing {settings.pack}; "
        f"children {'forked from templates (fast mode)' if fast else 'spawned'}",
    ]
    backfill, gather = scheduler.backfill(), scheduler.gather()
    header += [
        _on_off(
            "backfilling",
            backfill,
            "by the durations earlier runs recorded",
            "no duration recorded yet, one job at a time, or under xdist",
        ),
        _on_off(
            "gathering",
            gather,
            f"up to {gather} tests that need their GPUs alone wait for one drain",
            "one job at a time, under xdist, or a failure stops the session",
        ),
    ]
    durations = scheduler.durations if backfill else None
    text = _explain.lines(session.items, settings, dict(_boots.load(config)), header, durations)
    if reporter is not None:
        reporter.write_sep("-", "spawnrun: where each test would run (nothing ran)")
        for line in text:
            reporter.write_line(line)
    return True


def _on_off(mechanism: str, on: int, why_on: str, why_off: str) -> str:
    """``--spawn-explain``'s line for a scheduling mechanism the run may turn off."""
    return f"spawnrun: {mechanism} {'on' if on else 'off'} ({why_on if on else why_off})"


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
    scheduler = config.stash.get(SCHEDULER_KEY, None)
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
    scheduler.submit(item, nextitem, _plan_of(item))
    if scheduler.limit == 1:
        # One at a time: the test's reports arrive inside its own protocol, as
        # pytest-xdist's workers require and as plain pytest would do.
        scheduler.drain()
    return True


class _AfterEachTest:
    """Runs after every test's protocol, spawned or not (a wrapper around them all)."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        result = yield
        scheduler = item.config.stash[SCHEDULER_KEY]
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
    config = session.config
    _store_learned(config)
    scheduler = session.config.stash.get(SCHEDULER_KEY, None)
    if scheduler is None:
        return
    from spawnrun.learn import _boots

    if scheduler.has_core() and not _xdist_worker():
        _boots.store(config, scheduler.core.boots)
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        scheduler.interrupted = scheduler.running()  # named in the summary
        scheduler.kill_all()
    else:
        scheduler.finish()  # children still exiting, reaping or settling
    workeroutput = getattr(config, "workeroutput", None)
    if isinstance(workeroutput, dict):  # an xdist worker: its controller prints it
        workeroutput[WORKER_SUMMARY] = _summary_lines(config)
    holder = session.config.stash.get(_starting.ZYGOTE_KEY, None)
    if holder is not None:
        holder.close()
    # Children finish in any order; the summary lists tests in collection order.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        order = {item.nodeid: i for i, item in enumerate(session.items)}
        for reports in reporter.stats.values():
            reports.sort(key=lambda r: order.get(getattr(r, "nodeid", ""), len(order)))


def _store_learned(config: pytest.Config) -> None:
    """Keep what this run measured in pytest's cache: peaks (``--spawn-pack auto``),
    durations (backfilling) and what tests imported (fast mode's learned preloads)."""
    peaks = config.stash.get(PEAKS_KEY, None)
    if peaks is None or _xdist_worker():
        return  # under xdist the controller stores what its workers' reports carry
    collected = config.stash.get(COLLECTED_KEY, None)
    _learned.store(config, _learned.CACHE_PEAKS, peaks, collected)
    durations = config.stash.get(DURATIONS_KEY, {})
    _learned.store(config, _learned.CACHE_DURATIONS, durations, collected)
    loads = config.stash.get(LOADS_KEY, {})
    _learned.store(config, _learned.CACHE_LOADS, loads, collected)
    _learned.store_preloads(config)
    _unforked.save(config)
    holder = config.stash.get(_starting.ZYGOTE_KEY, None)
    if holder is not None:
        _headstart.remember(config, holder)


#: Under xdist: each worker's summary lines, sent in its ``workeroutput``.
WORKER_SUMMARY = "spawnrun_summary"
WORKER_SUMMARIES_KEY = pytest.StashKey[dict[str, list[str]]]()


def _summary_lines(config: pytest.Config) -> list[str]:
    scheduler = config.stash.get(SCHEDULER_KEY, None)
    settings = config.stash.get(SETTINGS_KEY, None)
    # Which tests ran alone, listed where budgets are learned: asked for, or (the default)
    # once an earlier run recorded peaks.
    auto = settings is not None and settings.pack == "auto"
    if auto and _settings.source_of(config, "pack") == "the default":
        auto = bool(_learned.peaks(config))
    if scheduler is not None:  # what tests' processes ended as they left counts too
        scheduler.reaped += config.stash.get(_ending.LEFT_RUNNING_KEY, 0)
        config.stash[_ending.LEFT_RUNNING_KEY] = 0
    lines = scheduler.summary(list_alone=auto) if scheduler is not None else []
    holder = config.stash.get(_starting.ZYGOTE_KEY, None)
    if holder is not None:
        lines += holder.declined_lines()
    lines += _unforked.lines(config)
    if scheduler is not None and _xdist_worker():
        lines += scheduler.split_groups()
    return lines


@pytest.hookimpl
def pytest_unconfigure(config: pytest.Config) -> None:
    if SCHEDULER_KEY in config.stash:
        # pytest's final collections follow, then the interpreter's; an xdist worker's
        # process ends with its session too.
        _heap.freeze_if_spared(config, _xdist_worker())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's controller: keep what a worker's spawned tests came to, for the summary."""
    lines = getattr(node, "workeroutput", {}).get(WORKER_SUMMARY)
    if isinstance(lines, list) and lines:
        worker = str(getattr(node, "workerinput", {}).get("workerid", "?"))
        summaries = node.config.stash.setdefault(WORKER_SUMMARIES_KEY, {})
        summaries[worker] = [str(line) for line in lines]


@pytest.hookimpl
def pytest_terminal_summary(terminalreporter: Any) -> None:
    config = terminalreporter.config
    scheduler = config.stash.get(SCHEDULER_KEY, None)
    lines = _summary_lines(config)
    for worker, theirs in sorted(config.stash.get(WORKER_SUMMARIES_KEY, {}).items()):
        lines += [f"[{worker}] {line}" for line in theirs]
    if lines:
        terminalreporter.write_sep("-", "spawnrun")
        for line in lines:
            terminalreporter.write_line(line)
    if scheduler is not None and scheduler.interrupted:
        from spawnrun.driver import _status

        terminalreporter.write_sep("!", _reports.INTERRUPTED_RUNNING)
        for running in scheduler.interrupted:
            terminalreporter.write_line(_status.describe(running))
    if scheduler is not None and scheduler.long_settles:
        terminalreporter.section("spawnrun: waits for device memory")
        for nodeid, seconds in scheduler.long_settles:
            terminalreporter.write_line(f"{seconds:.1f}s after {nodeid}")


#: True while a test's report is being logged: only its own line names its devices.
_logging_report = False
#: The run's measured peaks (``PEAKS_KEY``); the logreport hook has no config to ask.
_peaks: dict[str, int] | None = None
#: What this run's collection yielded (``COLLECTED_KEY``), for pruning learned peaks.
_collected: _learned.Collected | None = None
#: The run's durations of spawned tests (``DURATIONS_KEY``).
_durations: dict[str, float] | None = None
#: The run's CPU loads of spawned tests (``LOADS_KEY``).
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
