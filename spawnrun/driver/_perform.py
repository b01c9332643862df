"""The dispatcher's actions performed on real children.

Runs in the parent. ``Performer`` does what each action says and nothing else: ``Start``
(the xdist ledger's claim first: a peer that got there first is ``Denied``), ``Go``,
``Dismiss``, ``Kill``, ``Replay``, ``Report`` (worded here: a crash, a timeout, a stop, a
test nothing could start), ``Drop``, ``Warn`` and ``Interrupt``.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

from spawnrun.devices import _packing
from spawnrun.dispatch import batch
from spawnrun.dispatch import events as ev
from spawnrun.dispatch.events import Kind
from spawnrun.dispatch.events import Outcome
from spawnrun.dispatch.state import Phase
from spawnrun.driver import _early
from spawnrun.driver import _replay
from spawnrun.driver import _reruns
from spawnrun.driver._jobrecord import LISTENING
from spawnrun.driver._jobrecord import State
from spawnrun.driver._jobs import Job
from spawnrun.driver._units import Unit
from spawnrun.driver._units import Units
from spawnrun.launch import _starting
from spawnrun.learn import _unforked
from spawnrun.wire import _reports
from spawnrun.wire._reports import OUT_OF_ORDER
from spawnrun.wire._reports import STOPPED


class Performer(Units):
    """What the dispatcher decided, done."""

    def _token(self, cid: int) -> str:
        return f"{os.getpid()}:u{cid}"

    def _claim(self, action: ev.Start) -> bool:
        """Take the ledger's claim for a child about to start; False: a peer has them."""
        if self.ledger is None or not action.devices or action.deferred:
            return True
        need = self.core.children[action.child].need
        if not self.ledger.take_exact(list(action.devices), need, self._token(action.child)):
            self._queued.append(ev.Denied(time.monotonic(), action.child))
            self._poll_peers(force=True)
            return False
        self.claims[action.child] = action.devices
        return True

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
                if job.deferred and child.devices:
                    # Booting unclaimed, it claimed at its turn the devices it sees.
                    self._assign(unit, job, child.devices)
                self._grant(job)

    def _assign(self, unit: Unit, job: Job, devices: tuple[str, ...]) -> None:
        """An unclaimed child's devices, claimed in the dispatcher: its claim (what it
        shares, its budget, its visibility variables) is the job's from now on."""
        job.assign(list(devices))
        unit.devices = devices

    # Actions -------------------------------------------------------------------------

    def _perform(self, actions: list[ev.Action]) -> None:
        for action in batch.performed(actions):  # the simulator's order too
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
            elif isinstance(action, ev.Again):
                self._again_alone(action.test, action.alone, action.order)
            elif isinstance(action, ev.Drop):
                self._drop_test(action.test)
            elif isinstance(action, ev.Warn):
                self._warn(action.test, action.text)
            elif isinstance(action, ev.Interrupt):
                self._interrupt()

    def _again_alone(self, nodeid: str, alone: bool = True, order: bool = False) -> None:
        """The test runs again: a fresh job, whose reports are the ones replayed.

        ``alone``: it failed on a guessed budget (its own or a neighbour's), and runs
        alone, with no budget; else (its fork's outcome was in doubt, or ``order``: it
        failed after it ran out of pytest's order, and runs again once the tests before
        it have ended; or it died in a fork) it runs spawned, not forked, with its own
        need. The first run's job still ends its child (it is not counted as a test);
        its failures are kept and shown as reruns before the reports that count
        (``Replay.carry``); its turn (what the parent's environment and teardown were
        when pytest reached the test) carries over. A template's test runs again in a
        child of its own, and the template goes on with its next test."""
        old = self.by_id.pop(nodeid, None)
        item, plan = self.items[nodeid]
        forked = old is not None and old.forked
        why = self._why_again(old, order)
        unforked = why if old is not None and forked else plan.unforked
        scope = _packing.shared_scope(plan.scope)
        if order:
            self.out_of_order.append(nodeid)
        if alone:
            guess = plan.budget_source if plan.learned else "a neighbour's guessed budget"
            because = f"ran again alone: {why} ({guess})"
            if order:
                because = f"ran again alone, in its order: it failed after it {OUT_OF_ORDER}"
            else:
                self.again.append(nodeid)
            plan = replace(
                plan, need=_packing.ALONE, alone_because=because, budget_source="", learned=False
            )
        self.items[nodeid] = (item, replace(plan, scope=scope, unforked=unforked))
        new = self._job_of(nodeid)
        if old is not None:
            new.replay.carry(old.replay, why)
            old.turned = False
            new.turned, new.parent_error = True, old.parent_error
            new.env_set, new.env_unset = dict(old.env_set), list(old.env_unset)
            new.timeout = old.timeout

    def _why_again(self, old: Job | None, order: bool) -> str:
        """What the first run's evidence against the guess was (its own words)."""
        if old is None:
            return ""
        if old.again_why:
            return old.again_why
        if order:
            return f"it failed after it {OUT_OF_ORDER}"
        if old.forked:
            # It died in its fork (the dispatcher's rule: ``Exited`` while it ran).
            died = "timed out" if old.timeouts else "crashed"
            why = f"it {died} in a fork of a template"
            reports = old.replay.reports
            config, nodeid = old.item.config, old.item.nodeid
            outcome, failure = _unforked.outcome(reports), _unforked.failure(reports)
            _unforked.note(config, nodeid, why, outcome, failure)
            return why
        return "it failed on a guess of the run's"

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
        if action.deferred:  # it sees its guessed devices but claims none until its go
            job.deferred, job.claimed = True, []
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
        # Not taken (the test's child also collects another file: a group): it is ended,
        # never left waiting for a test, which the run's exit would wait for too.
        self.graveyard.extend(own.close())
        self.graveyard.extend(job.take_retired())
        unit.job = job

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
            if unit.job.deferred:
                self._assign(unit, unit.job, action.devices)
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
        _reruns.before_emit(job.replay)
        job.replay.emit(job.parent_error)
        reports = job.replay.reports
        _unforked.confirmed(
            job.item.config, nodeid, _unforked.outcome(reports), _unforked.failure(reports)
        )
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
