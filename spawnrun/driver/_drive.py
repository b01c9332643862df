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
(``_ledger.Ledger``): the driver takes a child's claim there as it performs ``Start``,
before any process exists (a peer that got there first: ``Denied``, and nothing is
started), gives it back once the dispatcher has forgotten the child, and tells the
dispatcher what the other workers hold (``Peers``) each time it feeds it. A worker's
order is the controller's: booting ahead takes only the test pytest says comes next
(``Next``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from spawnrun.devices import _devices
from spawnrun.devices import _packing
from spawnrun.dispatch import events as ev
from spawnrun.dispatch.units import State as Life
from spawnrun.driver import _replay
from spawnrun.driver._ending import EXIT_KILL
from spawnrun.driver._ending import Stage
from spawnrun.driver._jobrecord import State
from spawnrun.driver._perform import Performer
from spawnrun.driver._units import early_key
from spawnrun.wire._reports import STOPPED


class Driver(Performer):
    """The run's spawned tests, through the dispatcher: what pytest and the loop tell it."""

    def _test(self, item: pytest.Item, plan: _packing.Plan) -> ev.Test:
        slots = _packing.cpu_slots(self.loads.get(item.nodeid), self.cpus, self.limit)
        if slots > 1:
            self.slotted[item.nodeid], self.slots_of_run = slots, self.limit
        return ev.Test(
            item.nodeid,
            count=plan.count,
            need=plan.need,
            every=plan.every,
            scope=plan.scope,
            forked=plan.forked,
            key=early_key(str(item.path), plan),
            file=str(item.path),
            duration=self.durations.get(item.nodeid),
            slots=slots,
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
        self._feed(*self._next(nextitem, now), ev.Submit(now, self._test(item, plan)))
        with self._waiting():
            while not self.core.placed(item.nodeid):
                self.loop_once(self._redraw())

    def reached(self, nextitem: pytest.Item | None) -> None:
        """pytest ran a test in-process: children that ended meanwhile are told, and an
        xdist worker tells what comes next (its own order), to boot it ahead."""
        told = self._next(nextitem, time.monotonic())
        if told:
            self._feed(*told)
        self.loop_once(0)

    def _next(self, nextitem: pytest.Item | None, now: float) -> list[ev.Event]:
        """An xdist worker's ``Next``: the spawned test pytest reaches after this one."""
        if not self.told_next:
            return []
        after = nextitem.nodeid if nextitem is not None else ""
        return [ev.Next(now, (after,) if after in self.items else ())]

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

    def split_groups(self) -> list[str]:
        """An xdist worker's word on groups (``group=``) whose tests xdist spread over
        workers: each worker's share of a group has a child of its own."""
        if not self.has_core():
            return []
        ran = set(self.core.submitted)
        groups: dict[str, list[str]] = {}
        for nodeid, (_, plan) in self.items.items():
            if plan.scope.startswith("group "):
                groups.setdefault(plan.scope, []).append(nodeid)
        out = []
        for scope, members in sorted(groups.items()):
            here = sum(1 for m in members if m in ran)
            if 0 < here < len(members):
                out.append(
                    f"{scope}: {here} of its {len(members)} tests ran in this worker, in a "
                    "child of their own: xdist split the group over workers (keep it on one "
                    "with --dist loadgroup and @pytest.mark.xdist_group)"
                )
        return out

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
