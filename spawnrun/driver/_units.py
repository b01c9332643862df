"""The driver's record of the dispatcher's children, and what their units did, as events.

Runs in the parent. A ``Unit`` is one dispatcher child and what holds its process now
(the test's ``_jobs.Job`` while it boots or runs, the ``_ending.Ending`` after its test,
a child started while collecting until a test takes it, a dismissed process until it is
gone). ``Units`` builds the dispatcher from the run's limits and turns what the units did
since the last look into its events: booted, done, exited, released, refused. It decides
nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

from spawnrun.devices import _inventory
from spawnrun.devices import _ledger
from spawnrun.devices import _packing
from spawnrun.dispatch import Dispatcher
from spawnrun.dispatch import events as ev
from spawnrun.dispatch.events import Kind
from spawnrun.dispatch.units import State as Life
from spawnrun.driver import _early
from spawnrun.driver._ending import EXIT_KILL
from spawnrun.driver._ending import Ending
from spawnrun.driver._ending import Stage
from spawnrun.driver._jobrecord import State
from spawnrun.driver._jobs import Job
from spawnrun.driver._loop import Loop
from spawnrun.launch import _runner
from spawnrun.learn import _boots
from spawnrun.learn import _evidence
from spawnrun.learn import _learned
from spawnrun.learn import _unforked

#: The dispatcher's own exit, kill and settle limits are backstops: the ending's
#: (``_ending``) come first and say more.
_BACKSTOP = 30.0
#: Tests that need their devices alone which may wait together for one drain.
GATHER = 32


def early_key(path: str, plan: _packing.Plan) -> str:
    """What a child started while collecting ``path`` must share with the test it serves."""
    return f"{path}|{plan.count}|{plan.every}|{plan.need}|{plan.budget_source}"


@dataclass
class Unit:
    """One dispatcher child and what holds its process now."""

    cid: int
    kind: Kind
    devices: tuple[str, ...]
    job: Job | None = None
    ending: Ending | None = None
    early: _early.EarlyChild | None = None
    #: A process dismissed before it ran a test, until it is gone.
    grave: _runner.ChildProcess | None = None
    #: The job of the test it ran last (the donor of a scope's next test).
    last: Job | None = None
    booted: bool = False
    exited: bool = False
    refused: bool = False


class Units(Loop):
    """The dispatcher, the children it knows, and their lives told back to it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._core: Dispatcher | None = None
        self.config: pytest.Config | None = None
        self.units: dict[int, Unit] = {}
        #: Every spawned test the run knows (the suite's), and the job of each.
        self.items: dict[str, tuple[pytest.Item, _packing.Plan]] = {}
        self.by_id: dict[str, Job] = {}
        #: Tests pytest reached whose reports are not replayed yet (nor dropped).
        self.pending: list[str] = []
        #: Children started while collecting: what each key's child is started with.
        self.expected: dict[str, tuple[str, _packing.Plan]] = {}
        self.early_seen = 0
        #: An xdist worker: pytest's order is not the suite's (``Next`` before each test).
        self.told_next = False
        self.stop_told = False
        self.interrupting: Job | None = None
        self.finishing = False
        self._feeding = False
        self._queued: list[ev.Event] = []
        #: Under xdist: the ledger, our claims in it (child -> devices), and the other
        #: workers' claims as last told.
        self.ledger = self.allocator if isinstance(self.allocator, _ledger.Ledger) else None
        self.claims: dict[int, tuple[str, ...]] = {}
        self.peers: tuple[tuple[str, int | None], ...] | None = None
        #: What earlier runs measured of each test's duration (``_learned``), once read.
        self._durations: dict[str, float] | None = None
        #: ... and of the cores each kept busy, once read.
        self._loads: dict[str, float] | None = None
        #: The run's usable cores (0: job slots are not weighed by CPU load).
        self.cpus = 0

    # The dispatcher ------------------------------------------------------------------

    @property
    def durations(self) -> dict[str, float]:
        if self._durations is None:
            config = self.config
            self._durations = _learned.durations(config) if config is not None else {}
        return self._durations

    @property
    def loads(self) -> dict[str, float]:
        if self._loads is None:
            config = self.config
            self._loads = _learned.loads(config) if config is not None else {}
        return self._loads

    def has_core(self) -> bool:
        return self._core is not None

    @property
    def core(self) -> Dispatcher:
        if self._core is None:
            alloc = self.allocator
            settle = (self.settle or 0.0) + _BACKSTOP
            self._core = Dispatcher(
                ev.Settings(
                    devices=tuple(alloc.ids),
                    capacity=tuple(alloc.capacity.items()),
                    per_gpu=alloc.per_gpu,
                    reserve=_packing.RESERVE,
                    jobs=self.limit,
                    lookahead=self.lookahead,
                    early=self.early.limit,
                    exit_grace=EXIT_KILL + _BACKSTOP,
                    kill_grace=_BACKSTOP,
                    settle=settle,
                    defer=self._may_defer(),
                    boots=_boots.load(self.config) if self.config is not None else (),
                    backfill=self.backfill(),
                    gather=self.gather(),
                    ordered=self.stops(),
                )
            )
        return self._core

    def backfill(self) -> int:
        """How many tests may wait in the queue past a head that waits for devices, so
        that later ones can be backfilled: not under xdist (its controller hands each
        worker its tests), and only with earlier runs' durations to go by."""
        if self.ledger is not None or self.limit < 2 or not self.durations:
            return 0
        return max(2 * self.limit, self.lookahead)

    def gather(self) -> int:
        """How many tests that need their devices alone may wait, passed over while
        others hold their devices, so that one drain serves several: not under xdist
        (its controller hands each worker its tests), not with one test at a time, and
        not when a failure stops the session (``-x``, ``--maxfail``, ``--stepwise``: the
        tests pytest reached before it would still run)."""
        if self.ledger is not None or self.limit < 2 or self.config is None:
            return 0
        option = self.config.option
        if getattr(option, "maxfail", 0) or getattr(option, "stepwise", False):
            return 0
        return max(GATHER, 2 * self.limit)

    def stops(self) -> bool:
        """Whether a failure may stop the session (``-x``, ``--maxfail``, ``--stepwise``,
        ``--sw-skip``): then what pytest reports must be what in-process pytest would,
        in its order, so spawned tests end to pytest in its order (``Settings.ordered``)
        and an in-process test waits for the spawned tests before it (``before_here``)."""
        if self.config is None:
            return False
        option = self.config.option
        return bool(getattr(option, "maxfail", 0) or getattr(option, "stepwise", False))

    def _may_defer(self) -> bool:
        """Whether children may boot unclaimed: not under xdist (a claim is the ledger's
        at a child's start), and on NVIDIA devices (what a boot touched is asked of the
        CUDA driver)."""
        if self.ledger is not None or not self.allocator.ids:
            return False
        return _inventory.active().vendor == "nvidia"

    def _forget_early(self, unit: Unit) -> None:
        if unit.early is not None and unit.early in self.early.waiting:
            self.early.waiting.remove(unit.early)
        unit.early = None

    def _pending_observations(self) -> bool:
        return any(self._changed(u) for u in self.units.values())

    def _changed(self, unit: Unit) -> bool:
        job = unit.job
        if job is not None:
            if job.state is State.DONE:
                return True
            if not unit.booted and job.state in (State.WAITING, State.RUNNING, State.DUMPING):
                return True
        return False

    def _observe(self) -> list[ev.Event]:
        """What the units did since the last look, as the dispatcher's events."""
        now = time.monotonic()
        out: list[ev.Event] = []
        for unit in list(self.units.values()):
            out += self._observe_unit(unit, now)
        return out

    def _observe_unit(self, unit: Unit, now: float) -> list[ev.Event]:
        out: list[ev.Event] = []
        cid = unit.cid
        if unit.early is not None and unit.job is None:
            child = unit.early.child
            if child.gone or child.exitcode is not None:
                self._forget_early(unit)
                unit.grave = child
                if not child.gone:
                    child.reaped()
        job = unit.job
        if job is not None:
            why = self.refusals.get(job.plan.scope) if job.plan.scope else None
            if why is not None and not unit.refused:
                unit.refused = True
                out.append(ev.Refused(now, cid, why or "its forkserver is off"))
            if not unit.booted and job.state in (State.WAITING, State.RUNNING, State.DUMPING):
                unit.booted = True
                out.append(ev.Booted(now, cid, job.boot_touched))
            if job.state is State.DONE:
                unit.job, unit.last = None, job
                if job.ending is None:  # it could never be started
                    out.append(ev.StartFailed(now, cid, self._start_error(job)))
                    self.units.pop(cid, None)
                    return out
                unit.ending = job.ending
                if job.ending.after_done:
                    if not unit.booted:
                        unit.booted = True
                        out.append(ev.Booted(now, cid))
                    more = job.ending.stage is Stage.HANDOVER
                    interrupt = job.interrupted is not None
                    poisoned = bool(job.replaced)
                    again = self._again(job)
                    alone = again and self._budget_guess(job)
                    nodeid = job.item.nodeid
                    failed = any(r.failed for r in job.replay.reports)
                    done = ev.Done(
                        now, cid, nodeid, interrupt, poisoned, more, again, alone, failed
                    )
                    out.append(done)
                else:
                    unit.exited = True
                    out.append(ev.Exited(now, cid, -1))
        ending = unit.ending
        if ending is not None and ending.stage is Stage.HANDOVER:
            mine = self.core.children.get(cid)
            if mine is not None and mine.state not in (Life.BETWEEN, Life.RUNNING):
                ending.dismiss()  # the dispatcher has it exit: no next test comes
        if ending is not None:
            gone = ending.stage in (Stage.REAPING, Stage.SETTLING, Stage.GONE)
            if gone and not unit.exited:
                unit.exited = True
                out.append(ev.Exited(now, cid, 0))
            if ending.stage is Stage.GONE:
                ending.held = []  # free: a test granted now does not share with it
                out.append(ev.Released(now, cid))
                self.units.pop(cid, None)
        if unit.grave is not None and (unit.grave.gone or unit.grave.exitcode is not None):
            if not unit.exited:
                unit.exited = True
                out.append(ev.Exited(now, cid, 0))
            out.append(ev.Released(now, cid))
            self.units.pop(cid, None)
        return out

    def _again(self, job: Job) -> bool:
        """Whether the test runs again, once, because its first run's failure is of a
        kind a guess of the run's can cause (``_evidence``): out of memory on a learned
        budget (torch capped it there), or beside another test while budgets are
        learned (a neighbour's guess may have been too small): it runs again alone. Not
        a scope's test (its child runs others; a template's test ran in a fork of its
        own), nor one that stopped the session. Any other failure counts as it is:
        plain pytest runs a test once.

        A fork (fast mode) is a guess too: a forked test whose error names forking, or
        whose fork saw it rewrite what the template's imports had read (``Done.doubt``),
        runs again in a fresh spawned child with its own need. One that failed otherwise
        counts as it is, and the next run spawns it instead of forking it
        (``_unforked``): no evidence, no second run."""
        if _packing.shared_scope(job.plan.scope):
            return False
        if job.interrupted is not None or job.replaced:
            return False
        config, nodeid, reports = job.item.config, job.item.nodeid, job.replay.reports
        failed = any(r.failed for r in reports)
        failure = _unforked.failure(reports)
        if not job.forked and job.plan.unforked:
            _unforked.spawned(config, nodeid, failure)
        outcome = _unforked.outcome(reports)
        if job.forked and (failed or job.doubt):
            if not job.doubt and failure and failure == job.plan.known_failure:
                # It failed as its fork and its spawned run both did before.
                _unforked.accepted(config, nodeid)
                return False
            evidence = _evidence.fork(reports, job.doubt)
            if evidence:
                _unforked.note(config, nodeid, evidence, outcome, failure)
                job.again_why = f"{evidence}, in a fork of a template"
                return True
        if self._budget_guess(job):
            return True  # out of memory on a guessed budget: alone, with none
        if job.forked and (failed or _evidence.unsure(reports)):
            # A failure of its own, or an xfail that held in its call: that counts, once,
            # and the next run spawns it (what a fork read may read otherwise spawned).
            why = _unforked.FAILED_IN_FORK if failed else _unforked.XFAILED_IN_FORK
            _unforked.unsure(config, nodeid, why, outcome, failure)
        return False

    def _budget_guess(self, job: Job) -> bool:
        """Whether it failed where a guessed budget (learned, or a first run's share) may
        be to blame, and its failure says it ran out of memory (or it skipped for want of
        memory), or its process tree held more than that budget whatever its outcome (it
        runs again alone, with none: that run's peak is what is learned)."""
        if not self.guessing:
            return False
        if job.tree_over_guess:
            job.again_why = "its process tree held more than its guessed budget"
            return True
        if not (job.guessed or job.beside_guess):
            return False
        evidence = _evidence.memory(job.replay.reports)
        if evidence:
            job.again_why = f"{evidence}, on a guessed budget"
        return bool(evidence)

    def _start_error(self, job: Job) -> str:
        for report in job.replay.reports:
            if report.failed:
                return str(report.longrepr).splitlines()[0]
        return "it could not be started"

    def _poll_peers(self, force: bool = False) -> None:
        """Tell the dispatcher what other workers hold, when that changed."""
        if self.ledger is None:
            return
        others = self.ledger.others()
        if others is None:
            return  # out of reach now: the last claims told stand
        if force or others != self.peers:
            self.peers = others
            self._queued.append(ev.Peers(time.monotonic(), others))
