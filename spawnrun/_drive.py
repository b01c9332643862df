"""The driver: the dispatcher's actions performed on real children, their life told back.

Runs in the parent. Every scheduling decision is the dispatcher's (``spawnrun.dispatch``):
which test starts when, on which devices, in which child; which scope's child runs a
test; what boots ahead; which child started while collecting a test takes; which idle
child is dismissed; what a stop ends; what is reported as stuck. The driver has none: it
performs ``Start``, ``Go``, ``Dismiss``, ``Kill``, ``Replay``, ``Report``, ``Drop``,
``Warn`` and ``Interrupt``, and turns what the units (``_jobs.Job`` for a test,
``_ending.Ending`` for a child after its test) do into events: booted, done, exited,
released, a scope not shared after all (a template that runs its own test).

What stays in the units is what a child's messages mean: reports, a crash's evidence, a
timeout's stack dump (the dispatcher's timeouts are off; the job's deadline ends the
test and its report says so), crash reruns under pytest-rerunfailures and the parent's
collection as a fallback (both on the same devices and claim), the exit grace, reaping
and NVML's release.

One dispatcher child is one ``Unit``: the test's job while it boots or runs, the ending
between a scope's tests and after the last, a child started while collecting until a
test takes it, or a dismissed process until it is gone. Its claim is held from its
``Start`` until ``Released`` (the ending is gone: exited, reaped, released by NVML).

Under pytest-xdist the workers share the devices through a file ledger
(``_devices.Ledger``): the driver takes a child's claim there as it performs ``Start``,
before any process exists (a peer that got there first: ``Denied``, and nothing is
started), gives it back once the dispatcher has forgotten the child, and tells the
dispatcher what the other workers hold (``Peers``) each time it feeds it. A worker's
order is the controller's: booting ahead takes only the test pytest says comes next
(``Next``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from dataclasses import replace
from typing import Any

import pytest

from spawnrun import _devices
from spawnrun import _early
from spawnrun import _packing
from spawnrun import _replay
from spawnrun import _reports
from spawnrun import _runner
from spawnrun import _starting
from spawnrun._ending import EXIT_KILL
from spawnrun._ending import Ending
from spawnrun._ending import Stage
from spawnrun._jobs import LISTENING
from spawnrun._jobs import Job
from spawnrun._jobs import State
from spawnrun._loop import Loop
from spawnrun._reports import STOPPED
from spawnrun.dispatch import Dispatcher
from spawnrun.dispatch import events as ev
from spawnrun.dispatch.events import Kind
from spawnrun.dispatch.events import Outcome
from spawnrun.dispatch.state import Phase
from spawnrun.dispatch.units import State as Life

#: The dispatcher's own exit, kill and settle limits are backstops: the ending's
#: (``_ending``) come first and say more.
_BACKSTOP = 30.0


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


class Driver(Loop):
    """The run's spawned tests, through the dispatcher."""

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
        self.ledger = self.allocator if isinstance(self.allocator, _devices.Ledger) else None
        self.claims: dict[int, tuple[str, ...]] = {}
        self.peers: tuple[tuple[str, int | None], ...] | None = None

    # The dispatcher ------------------------------------------------------------------

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
                )
            )
        return self._core

    def _test(self, item: pytest.Item, plan: _packing.Plan) -> ev.Test:
        return ev.Test(
            item.nodeid,
            count=plan.count,
            need=plan.need,
            every=plan.every,
            scope=plan.scope,
            key=early_key(str(item.path), plan),
        )

    def _feed(self, *events: ev.Event) -> None:
        """Tell the dispatcher, perform what follows, until nothing more happens."""
        self._queued.extend(events)
        if self._feeding:
            return  # told in the running feed's next round
        self._feeding = True
        try:
            self._poll_peers()
            for _ in range(1000):
                batch, self._queued = self._queued, []
                batch += self._observe()
                if self.free_memory_known():
                    batch.append(ev.Free(time.monotonic(), self._free()))
                self._perform(self.core.handle(*batch))
                self._perform(self.core.handle(*self._take_queued()))
                self._perform(self.core.step())
                self._grant_started()
                self._release_forgotten()
                if not self._queued and not self._pending_observations():
                    return
        finally:
            self._feeding = False

    # The ledger (xdist) -------------------------------------------------------------

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

    def _token(self, cid: int) -> str:
        return f"{os.getpid()}:u{cid}"

    def _claim(self, action: ev.Start) -> bool:
        """Take the ledger's claim for a child about to start; False: a peer has them."""
        if self.ledger is None or not action.devices:
            return True
        need = self.core.children[action.child].need
        if not self.ledger.take_exact(list(action.devices), need, self._token(action.child)):
            self._queued.append(ev.Denied(time.monotonic(), action.child))
            self._poll_peers(force=True)
            return False
        self.claims[action.child] = action.devices
        return True

    def _release_forgotten(self) -> None:
        """Give back the ledger claims of children the dispatcher has forgotten."""
        if self.ledger is None:
            return
        for cid, devices in list(self.claims.items()):
            child = self.core.children.get(cid)
            if child is None or child.state is Life.GONE:
                del self.claims[cid]
                self.ledger.give_back(list(devices), self._token(cid))

    def _take_queued(self) -> list[ev.Event]:
        batch, self._queued = self._queued, []
        return batch

    def free_memory_known(self) -> bool:
        return bool(self.allocator.ids) and _devices.nvml_available()

    def _free(self) -> tuple[tuple[str, int | None], ...]:
        return tuple((d, self.allocator.free_memory(d)) for d in self.allocator.ids)

    # pytest's side -------------------------------------------------------------------

    def suite(self, tests: list[tuple[pytest.Item, _packing.Plan]]) -> None:
        """Collection is over: every spawned test in pytest's order, with its plan.

        Children started while collecting for a file whose tests need none are dismissed.
        """
        for item, plan in tests:
            self.items[item.nodeid] = (item, plan)
        self.early.open = False
        now = time.monotonic()
        keys = frozenset(early_key(str(i.path), p) for i, p in tests)
        suite = tuple(self._test(i, p) for i, p in tests)
        self._feed(ev.Collected(now, keys), ev.Suite(now, suite))

    def expect(self, path: str, plan: _packing.Plan) -> None:
        """While collecting: ``path``'s tests are likely spawned as ``plan`` says."""
        key = early_key(path, plan)
        if key in self.expected:
            return
        self.expected[key] = (path, plan)
        count = len(self.allocator.ids) if plan.every else plan.count
        self._feed(ev.Expect(time.monotonic(), key, count, plan.need))

    def wants_early(self) -> bool:
        return self.early.open and self.early.limit > 0

    def submit(
        self,
        item: pytest.Item,
        nextitem: pytest.Item | None,
        plan: _packing.Plan,
    ) -> None:
        parent_error = _replay.parent_teardown(item, nextitem)
        self.items.setdefault(item.nodeid, (item, plan))
        job = self._job_of(item.nodeid)
        job.timeout = plan.timeout
        job.turn(parent_error)
        if self.limit == 1:
            job.replay.start()  # one at a time: its line shows while it runs, as in-process
        self.pending.append(item.nodeid)
        now = time.monotonic()
        told: list[ev.Event] = []
        if self.told_next:
            after = nextitem.nodeid if nextitem is not None else ""
            told.append(ev.Next(now, (after,) if after in self.items else ()))
        self._feed(*told, ev.Submit(now, self._test(item, plan)))
        with self._waiting():
            while not self.core.placed(item.nodeid):
                self.loop_once(self._redraw())

    def reached(self, nextitem: pytest.Item | None) -> None:
        """pytest ran a test in-process: children that ended meanwhile are told, and an
        xdist worker tells what comes next (its own order), to boot it ahead."""
        if self.told_next:
            after = nextitem.nodeid if nextitem is not None else ""
            self._feed(ev.Next(time.monotonic(), (after,) if after in self.items else ()))
        self.loop_once(0)

    def _scope_tests(self, scope: str) -> list[str]:
        return [nodeid for nodeid, (_, plan) in self.items.items() if plan.scope == scope]

    def last(self) -> None:
        self._feed(ev.Last(time.monotonic()))
        self.drain()

    def drain(self) -> None:
        with self._waiting():
            while self.pending:
                self.loop_once(self._redraw())

    def abort(self) -> None:
        """The session stops (-x, --maxfail): what pytest reached before runs to its end."""
        if not self.stop_told:
            self.stop_told = True
            after = self.pending[-1] if self.pending else ""
            self._feed(ev.Stop(time.monotonic(), STOPPED, after))
        self.drain()

    def finish(self, limit: float = EXIT_KILL + 5.0) -> None:
        self.finishing = True  # what still runs now has no report to come
        if not self.stop_told:
            self.stop_told = True
            self._feed(ev.Stop(time.monotonic(), "the session ended"))
        self._feed(ev.Last(time.monotonic()))
        end = time.monotonic() + limit
        while self._alive() and time.monotonic() < end:
            self.loop_once(min(1.0, max(0.0, end - time.monotonic())))
        self.kill_all()

    def kill_all(self) -> None:
        for unit in self.units.values():
            if unit.early is not None:
                self.graveyard.append(unit.early.child)
            if unit.grave is not None:
                self.graveyard.append(unit.grave)
            if unit.ending is not None and unit.ending not in self.endings and unit.last:
                self.endings[unit.ending] = unit.last
        self.early.waiting = []
        self.units = {}
        super().kill_all()
        if self.ledger is not None:
            for cid, devices in self.claims.items():
                self.ledger.give_back(list(devices), self._token(cid))
            self.claims = {}

    def _alive(self) -> bool:
        return bool(self.jobs or self.endings or self.graveyard or self.units)

    # The loop's side -----------------------------------------------------------------

    def _watched(self) -> list[Any]:
        return [u.early.child.sentinel for u in self.units.values() if u.early is not None]

    def _deadlines(self) -> list[float]:
        wake = self.core.next_wake()
        return [] if wake is None else [wake]

    def _after_events(self) -> None:
        for job in list(self.jobs):
            self.graveyard.extend(job.take_retired())
            if job.boot_seconds is not None and not job.boot_counted:
                job.boot_counted = True
                self.boot_times.append(job.boot_seconds)
        self._feed(ev.Tick(time.monotonic()))
        for job in [j for j in self.jobs if j.state is State.DONE]:
            self.jobs.remove(job)
            if job.ending is not None and job.ending.stage is not Stage.GONE:
                self.endings[job.ending] = job
            else:
                self._count(job)
        for ending, owner in list(self.endings.items()):
            if ending.stage is Stage.GONE:
                self._gone(ending, owner)

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
                out.append(ev.Booted(now, cid))
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
                    out.append(ev.Done(now, cid, job.item.nodeid, interrupt, poisoned, more))
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

    def _start_error(self, job: Job) -> str:
        for report in job.replay.reports:
            if report.failed:
                return str(report.longrepr).splitlines()[0]
        return "it could not be started"

    def _grant_started(self) -> None:
        """Tests the dispatcher started (a slot and a claim) run as soon as booted."""
        core = self.core
        for unit in list(self.units.values()):
            child = core.children.get(unit.cid)
            if child is None or not child.test:
                continue
            entry = core.tests.get(child.test)
            if unit.early is not None and unit.job is None:
                self._take_early(unit, child.test, list(child.members))
            job = unit.job
            if job is None or entry is None or job.item.nodeid != child.test:
                continue
            if entry.phase is Phase.STARTED and entry.child == unit.cid and not job.granted:
                self._grant(job)

    # Actions -------------------------------------------------------------------------

    def _perform(self, actions: list[ev.Action]) -> None:
        for action in actions:
            if isinstance(action, ev.Start):
                self._start(action)
            elif isinstance(action, ev.Go):
                self._go(action)
            elif isinstance(action, ev.Dismiss):
                self._dismiss(action.child)
            elif isinstance(action, ev.Kill):
                self._kill(action)
            elif isinstance(action, ev.Replay):
                self._replay_test(action.test)
            elif isinstance(action, ev.Report):
                self._report(action)
            elif isinstance(action, ev.Drop):
                self._drop_test(action.test)
            elif isinstance(action, ev.Warn):
                self._warn(action.test, action.text)
            elif isinstance(action, ev.Interrupt):
                self._interrupt()

    def _job_of(self, nodeid: str) -> Job:
        job = self.by_id.get(nodeid)
        if job is None:
            item, plan = self.items[nodeid]
            if plan.scope in self.refusals:
                plan = replace(plan, scope="")  # its template may not fork: its own child
            job = self.by_id[nodeid] = Job(
                item,
                plan,
                [],
                self.settle,
                self.allocator.capacity,
                [],
                self.poison,
                self.replace_above,
                self.refusals,
                None,
            )
        return job

    def _place(self, job: Job, devices: tuple[str, ...], members: list[str]) -> None:
        if job.plan.every:
            job.devices, job.claimed = [], list(devices)
        else:
            job.devices, job.claimed = list(devices), list(devices)
        job.then = [m for m in members if m != job.item.nodeid]
        job.reset_candidates()
        if job not in self.jobs:
            self.jobs.append(job)

    def _start(self, action: ev.Start) -> None:
        if not self._claim(action):
            return  # another worker has its devices: nothing was started
        unit = self.units[action.child] = Unit(action.child, action.kind, action.devices)
        if action.kind is Kind.EARLY:
            path, plan = self.expected[action.key]
            config = self._config()
            env = _starting.child_env(config, plan, list(action.devices), self.allocator.capacity)
            try:
                child = _starting.start_early(config, path, env)
            except Exception as exc:  # noqa: BLE001 - its file's tests start their own
                self.units.pop(action.child)
                self._queued.append(ev.StartFailed(time.monotonic(), action.child, repr(exc)))
                return
            unit.early = _early.EarlyChild(path, child, list(action.devices), env)
            self.early.add(unit.early)
            return
        job = self._job_of(action.test)
        self._place(job, action.devices, list(action.members))
        unit.job = job
        job.start()
        self.graveyard.extend(job.take_retired())
        if job.child is None and job.state is not State.DONE:
            # It could not be started ahead of its turn: its turn reports why.
            unit.job = None
            self.jobs.remove(job)
            self.units.pop(action.child)
            why = job.start_error or "it could not be started"
            self._queued.append(ev.StartFailed(time.monotonic(), action.child, why))

    def _take_early(self, unit: Unit, test: str, members: list[str]) -> None:
        """The dispatcher gave ``test`` the child started while collecting its file."""
        early = unit.early
        assert early is not None
        self._forget_early(unit)
        job = self._job_of(test)
        self._place(job, unit.devices, members)
        own = _early.Early(1)
        own.waiting = [early]
        job.early = own
        job.start()  # takes it if its arguments and environment are the test's
        job.early = None
        self.early.taken += own.taken
        self.graveyard.extend(job.take_retired())
        unit.job = job

    def _forget_early(self, unit: Unit) -> None:
        if unit.early is not None and unit.early in self.early.waiting:
            self.early.waiting.remove(unit.early)
        unit.early = None

    def _config(self) -> pytest.Config:
        assert self.config is not None, "the plugin sets the driver's config"
        return self.config

    def _grant(self, job: Job) -> None:
        job.held = list(job.claimed)  # from its go on: what it shares is counted then
        self._note_sharing(job)
        if self.limit == 1:
            job.replay.start_live()  # -s: the node id line before what the test prints
        job.go()

    def _go(self, action: ev.Go) -> None:
        unit = self.units.get(action.child)
        if unit is None:
            return
        if unit.job is not None and unit.job.item.nodeid == action.test:
            if not unit.job.granted:
                self._grant(unit.job)
            return
        if unit.early is not None:
            child = self.core.children[action.child]
            self._take_early(unit, action.test, list(child.members))
            if unit.job is not None:
                self._grant(unit.job)
            return
        donor = unit.last
        job = self._job_of(action.test)
        if donor is not None and unit.ending is not None and job.adopt(donor):
            if job not in self.jobs:
                self.jobs.append(job)
            unit.ending, unit.job = None, job
            self._grant(job)
            return
        # Its child left between tests before the dispatcher could know: the test never
        # ran in it; its report says so.
        self._queued.append(ev.Exited(time.monotonic(), action.child, -1))

    def _dismiss(self, cid: int) -> None:
        unit = self.units.get(cid)
        if unit is None:
            return
        if unit.early is not None and unit.job is None:
            child = unit.early.child
            self._forget_early(unit)
            child.close_pipe()  # it reads no test: its pytest ends by itself
            unit.grave = child
            self.graveyard.append(child)
        elif unit.job is not None and unit.job.state in LISTENING:
            job = unit.job
            job.retire_child()
            retired = job.take_retired()
            self.graveyard.extend(retired)
            unit.grave = retired[-1] if retired else None
            unit.job = None
            if job in self.jobs:
                self.jobs.remove(job)
            if unit.grave is None:
                self._queued.append(ev.Exited(time.monotonic(), cid, 0))
        elif unit.ending is not None:
            unit.ending.dismiss()

    def _kill(self, action: ev.Kill) -> None:
        unit = self.units.get(action.child)
        if unit is None or action.reason == "the session stopped":
            return  # the Report or Drop that follows ends its test
        if unit.ending is not None:
            unit.ending.abort()
        elif unit.job is not None and unit.job.child is not None:
            unit.job.child.kill()
        elif unit.grave is not None:
            unit.grave.kill()

    def _done_with(self, nodeid: str) -> Job | None:
        if nodeid in self.pending:
            self.pending.remove(nodeid)
        return self.by_id.get(nodeid)

    def _replay_test(self, nodeid: str) -> None:
        job = self._done_with(nodeid)
        if job is None:
            return
        job.replayed = True
        if not job.turned or self.finishing:
            return  # the session is over: as in-process, no report comes now
        if job.state is State.DONE and job not in self.jobs and job.ending not in self.endings:
            self._count_test(job)  # it ended before its turn, and was counted without it
        if job.interrupted is not None:
            job.replay.emit(None, interrupted=True)
            self.interrupting = job
            return
        job.replay.emit(job.parent_error)
        session = job.item.session
        if not self.stop_told and (session.shouldfail or session.shouldstop):
            # Its report stopped the session (-x, --maxfail): the dispatcher stops after it.
            self.stop_told = True
            reason = str(session.shouldfail or session.shouldstop)
            self._queued.append(ev.Stop(time.monotonic(), reason, nodeid))

    def _report(self, action: ev.Report) -> None:
        job = self.by_id.get(action.test)
        if job is None:
            self._done_with(action.test)
            return
        if job.reported and job.replay.reports:
            self._replay_test(action.test)  # its own words: a crash's evidence, a timeout
            return
        outcome, item = action.outcome, job.item
        if outcome is Outcome.STOPPED:
            if job.state in LISTENING and job.child is not None:
                job.abort(STOPPED)
                self._after_abort(job)
            else:
                skipped = (str(item.path), (item.location[1] or 0) + 1, STOPPED)
                job.replay.add(_reports.make(item, job.replay.pending_phase(), "skipped", skipped))
                job.replay.ensure_teardown()
        else:
            text = {
                Outcome.STUCK: action.detail,
                Outcome.START_FAILED: f"{_reports.NOT_STARTED}: {action.detail}",
                Outcome.UNFIT: f"spawnrun: this test cannot run here: {action.detail}",
            }.get(outcome, f"spawnrun: the test {outcome.value}: {action.detail}")
            job.replay.fail("setup", f"{text}\nnode id: {item.nodeid}")
            job.replay.ensure_teardown()
            if job.state in LISTENING and job.child is not None:
                job.abort(STOPPED, report=False)
                self._after_abort(job)
        self._replay_test(action.test)

    def _after_abort(self, job: Job) -> None:
        """A job its stop ended: its child is the ending's now."""
        for unit in self.units.values():
            if unit.job is job:
                unit.job, unit.last, unit.ending = None, job, job.ending
                unit.exited = False

    def _drop_test(self, nodeid: str) -> None:
        job = self._done_with(nodeid)
        if job is None:
            return
        job.replayed = True
        if job.state in LISTENING and job.child is not None:
            job.abort(STOPPED, report=False)
            self._after_abort(job)
        job.turned = bool(job.went)  # counted as isolated only if it ran

    def _warn(self, nodeid: str, text: str) -> None:
        pair = self.items.get(nodeid)
        if pair is None:
            return
        item = pair[0]
        warning = _reports.warning(text, str(item.path), (item.location[1] or 0) + 1)
        _reports.record_warning(item.config, warning, nodeid)

    def _interrupt(self) -> None:
        job, self.interrupting = self.interrupting, None
        if job is not None and job.interrupted is not None:
            self.pending = []
            _replay.raise_interrupt(job.interrupted)
