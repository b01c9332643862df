"""The run's session in the parent: its driver configured, its children's start, its end.

Runs in the parent only (the plugin's hooks call it; in a child they return first).
``configure`` resolves the settings and builds the driver from them, the devices and the
cores (under xdist a worker runs one child at a time and the controller keeps the device
ledger's directory), and turns SIGTERM into an interrupt; ``start`` gives every child
the run's options and starts fast mode's zygote; ``end`` keeps what the run learned in
pytest's cache and ends the children. A child loads the plugin, and so this module: the
driver's own modules (``_drive``, ``_status``, ``_poison``) are imported by ``configure``,
not with it.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING
from typing import Any

import pytest

from spawnrun.config import _parse
from spawnrun.config import _settings
from spawnrun.config._plan import CAPACITY_KEY
from spawnrun.config._plan import INVENTORY_KEY
from spawnrun.config._plan import PER_GPU_KEY
from spawnrun.config._plan import SETTINGS_KEY
from spawnrun.devices import _devices
from spawnrun.devices import _inventory
from spawnrun.devices import _ledger
from spawnrun.devices import _packing
from spawnrun.driver import _cudawatch
from spawnrun.driver import _early
from spawnrun.driver import _replay
from spawnrun.launch import _forkserver
from spawnrun.launch import _headstart
from spawnrun.launch import _runner
from spawnrun.launch import _starting
from spawnrun.learn import _learned
from spawnrun.learn import _unforked
from spawnrun.proc import _bytecode

if TYPE_CHECKING:
    from spawnrun.driver import _drive

SCHEDULER_KEY: pytest.StashKey[_drive.Driver] = pytest.StashKey()
#: Peaks measured in this run (node id -> bytes on its fullest device), for the cache.
PEAKS_KEY = pytest.StashKey[dict[str, int]]()
COLLECTED_KEY = pytest.StashKey[_learned.Collected]()
#: The run's spawned tests' durations (setup, call and teardown), node id -> seconds.
DURATIONS_KEY = pytest.StashKey[dict[str, float]]()
LOADS_KEY = pytest.StashKey[dict[str, float]]()
#: Under xdist, in the controller: the private directory of the workers' device ledger.
LEDGER_KEY = pytest.StashKey[str]()
#: The workerinput key that hands the ledger's directory to each worker.
LEDGER_INPUT = "spawnrun_ledger"
#: Tests at once by default where the run has no devices: one per core, at most this.
DEVICELESS_JOBS = 8


def xdist_worker() -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


def xdist_controller(config: pytest.Config) -> bool:
    """The xdist controller runs no test itself: it needs no zygote."""
    return _settings.xdist_controller(config.getoption)


def _default_jobs(gpus: int, per_gpu: int, cpus: int) -> int:
    """Every device filled to its cap, as far as there are cores; one per GPU at least.
    Without devices, one per core (at most ``DEVICELESS_JOBS``), as tests without
    devices (``count=0``) run beside each other on a GPU machine: a run on a machine
    without GPUs took one test at a time, whatever its cores."""
    if gpus == 0:
        return max(1, min(DEVICELESS_JOBS, cpus))
    return max(1, gpus, min(gpus * per_gpu, cpus))


def configure(config: pytest.Config) -> None:
    """The parent's run: settings, devices, the driver (``SCHEDULER_KEY``) and what the
    run learns into (``PEAKS_KEY``, ``DURATIONS_KEY``, ``LOADS_KEY``, ``COLLECTED_KEY``)."""
    # The run's machinery, in the parent only: children never import it.
    from spawnrun.driver import _drive
    from spawnrun.driver import _poison
    from spawnrun.driver import _status

    settings = _settings.resolve(config)
    _settings.register_markers(config, settings.marker, settings.forked_alias)
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
    if xdist_worker():
        limit = 1
    else:
        limit = settings.jobs or _default_jobs(len(inventory.ids), per_gpu, cpus)
    ledger = None
    if xdist_worker():
        ledger = getattr(config, "workerinput", {}).get(LEDGER_INPUT)
    elif xdist_controller(config):
        ledger_dir = str(_ledger.private_dir())
        config.stash[LEDGER_KEY] = ledger_dir
        # Also when a later plugin's configure fails and no session ever finishes.
        config.add_cleanup(lambda: shutil.rmtree(ledger_dir, ignore_errors=True))
    config.stash[SETTINGS_KEY] = settings
    _warn_fast_mode_only(config, settings)
    config.stash[INVENTORY_KEY] = inventory
    config.stash[CAPACITY_KEY] = capacity
    config.stash[PER_GPU_KEY] = per_gpu
    config.stash[PEAKS_KEY] = {}
    config.stash[DURATIONS_KEY] = {}
    config.stash[LOADS_KEY] = {}
    if not xdist_controller(config):  # its workers collect, it does not
        config.stash[COLLECTED_KEY] = _learned.Collected(config)
    lookahead = settings.lookahead
    if lookahead is None:
        lookahead = _parse.default_lookahead()
    holder = None
    if (
        settings.method == "forkserver"
        and not xdist_controller(config)
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
    scheduler.told_next = xdist_worker()
    scheduler.status = _status.Status(config, several=limit > 1)
    scheduler.poison = _poison.patterns(settings.poison)
    scheduler.replace_above = settings.scope_memory
    scheduler.guessing = settings.pack == "auto"
    scheduler.cpus = cpus
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
    return not (xdist_worker() or xdist_controller(config))


def _install_sigterm(config: pytest.Config) -> None:
    # Python dies on SIGTERM without running any cleanup, which would orphan the
    # children (each leads its own session). Turn it into an interrupt instead,
    # unless someone else already handles SIGTERM.
    if threading.current_thread() is not threading.main_thread():
        return
    head = config.stash.get(_headstart.KEY, None)
    early = head.on_sigterm if head is not None else None  # the head start's, until now
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, early):
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        _runner.kill_all_live()
        raise KeyboardInterrupt("SIGTERM")

    def restore() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, on_sigterm)
    config.add_cleanup(restore)


def start(session: pytest.Session) -> None:
    """Once every plugin has configured itself (and coverage, if any, runs): the options
    and environment all children get; fast mode's zygote started with them."""
    config = session.config
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


def end(session: pytest.Session, exitstatus: int) -> bool:
    """What the run learned kept; the children killed (interrupted) or waited for.
    False where the run has no driver (nothing more to end)."""
    config = session.config
    _store_learned(config)
    scheduler = config.stash.get(SCHEDULER_KEY, None)
    if scheduler is None:
        return False
    from spawnrun.learn import _boots

    if scheduler.has_core() and not xdist_worker():
        _boots.store(config, scheduler.core.boots)
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        scheduler.interrupted = scheduler.running()  # named in the summary
        scheduler.kill_all()
    else:
        scheduler.finish()  # children still exiting, reaping or settling
    return True


def close(session: pytest.Session) -> None:
    """After ``end`` (and an xdist worker's summary): the zygote closed, and the reports
    of children that finished in any order put back in collection order."""
    holder = session.config.stash.get(_starting.ZYGOTE_KEY, None)
    if holder is not None:
        holder.close()
    # Children finish in any order; the summary and junitxml list tests in collection
    # order (junitxml wrote them as their reports came; its writer runs after this).
    order = {item.nodeid: i for i, item in enumerate(session.items)}
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for reports in reporter.stats.values():
            reports.sort(key=lambda r: order.get(getattr(r, "nodeid", ""), len(order)))
    cases = junit_cases(session.config)
    tests = session.config.stash.get(JUNIT_TESTS_KEY, {})
    if cases is not None:
        cases.sort(key=lambda case: order.get(tests.get(id(case), ""), len(order)))


#: Which test each of junitxml's test cases is (by the case's ``id()``): junitxml
#: clears a case's attributes once it is complete.
JUNIT_TESTS_KEY = pytest.StashKey[dict[int, str]]()


def junit_cases(config: pytest.Config) -> list[Any] | None:
    """junitxml's test cases in the order it will write them (None: no --junitxml)."""
    cases = getattr(_replay.junitxml(config), "node_reporters_ordered", None)
    return cases if isinstance(cases, list) else None


def junit_cases_of(config: pytest.Config, cases: list[Any], nodeid: str) -> None:
    """The test cases junitxml made for a report of ``nodeid``."""
    if cases:
        tests = config.stash.setdefault(JUNIT_TESTS_KEY, {})
        tests.update((id(case), nodeid) for case in cases)


def _store_learned(config: pytest.Config) -> None:
    """Keep what this run measured in pytest's cache: peaks (``--spawn-pack auto``),
    durations (backfilling) and what tests imported (fast mode's learned preloads)."""
    peaks = config.stash.get(PEAKS_KEY, None)
    if peaks is None or xdist_worker():
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
