"""The queries on the dispatcher's state: what fits, what holds, what comes next.

Runs in the parent; pure. ``Queries`` adds to ``state.Run`` what the decisions ask many
times per event: which devices a test's claim fits on, which children are live, idle or
booted ahead, a scope's child and its head, the tests pytest reaches next, when a child
holding devices will let them go (for backfilling), when the driver must wake, whether
pytest may go on past a test. One move is made here: a child started early that turns out
to fit no test is dismissed as ``child_for`` looks at it. Imports only its siblings and
``devices._packing``.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Iterator

from spawnrun.devices import _packing
from spawnrun.dispatch import events as ev
from spawnrun.dispatch.events import Kind
from spawnrun.dispatch.state import PEER
from spawnrun.dispatch.state import Phase
from spawnrun.dispatch.state import Run
from spawnrun.dispatch.state import boot_key
from spawnrun.dispatch.units import IDLE
from spawnrun.dispatch.units import Child
from spawnrun.dispatch.units import State


class Queries(Run):
    def not_gone(self) -> list[Child]:
        """The children not yet gone, in the order they started."""
        gone = [i for i, c in self.current.items() if c.state is State.GONE]
        for i in gone:
            del self.current[i]
        return list(self.current.values())

    def live_children(self) -> list[Child]:
        return [c for c in self.not_gone() if c.alive]

    def live_or_settling(self) -> Iterator[Child]:
        return iter(self.not_gone())

    def wanted(self, test: ev.Test) -> int:
        return len(self.pool.ids) if test.every else test.count

    def choose(
        self,
        test: ev.Test,
        without: frozenset[int] | set[int] = frozenset(),
        among: tuple[str, ...] | None = None,
    ) -> tuple[str, ...] | None:
        """Devices the test's claim fits on now (ignoring the claims of ``without``;
        only ``among`` them, if given)."""
        count = self.wanted(test)
        if count == 0:
            return ()
        pool = self.pool
        if without:
            tokens = {f"c{i}" for i in without}
            claims = {d: [c for c in pool.held(d) if c.token not in tokens] for d in pool.ids}
            pool = _packing.Pool(pool.ids, pool.capacity, pool.per_gpu, pool.reserve, claims)
        chosen = pool.choose(count, test.need, self.free.get, among)
        return None if chosen is None else tuple(chosen)

    def bound_to(self, test: ev.Test) -> tuple[str, ...] | None:
        """The devices the test's own unclaimed child must get (None: any): those it
        saw, if its boot initialized the driver or may still do so (it boots)."""
        for child in self.live_children():
            if child.test != test.id or not self.waits_for_devices(child):
                continue
            if child.state not in (State.STARTING, *IDLE):
                continue  # dismissed: it runs nothing
            if child.bound or child.state is State.STARTING:
                return child.seen
        return None

    def guess(self, test: ev.Test) -> tuple[str, ...]:
        """The devices an unclaimed child sees while it boots: the least held."""
        order = {d: i for i, d in enumerate(self.pool.ids)}
        held = sorted(self.pool.ids, key=lambda d: (len(self.pool.held(d)), order[d]))
        return tuple(sorted(held[: self.wanted(test)], key=order.__getitem__))

    def deferrable(self, test: ev.Test) -> bool:
        """Whether a child for ``test`` may boot unclaimed: its file's boot is known to
        make no context (so it touches no device memory before its go); not a fork."""
        if not self.settings.defer or test.template or self.wanted(test) == 0:
            return False
        if not self.can_ever_fit(test):
            return False  # its report says so at its turn; no child is booted for it
        return self.boots.get(test.file or test.id, ev.CONTEXT) != ev.CONTEXT

    def waits_for_devices(self, child: Child) -> bool:
        """A deferred child whose devices are not assigned yet."""
        return child.deferred and not child.devices

    #: A recorded duration is taken as this much longer, and this many seconds more:
    #: runs vary, and a test backfilled must end before the head's start.
    SLACK = (1.25, 0.25)

    def ends_at(self, child: Child) -> float | None:
        """When a child holding devices will let them go, by its test's record (None:
        unknown; an idle child, dismissed for a head, or one ending: now)."""
        if child.state in (*IDLE, State.EXITING, State.KILLED, State.SETTLING):
            return self.now
        entry = self.tests.get(child.test) if child.test else None
        if entry is None or entry.test.duration is None:
            return None
        if child.state is State.RUNNING:
            return child.since + entry.test.duration
        boot = self.boot_seconds.get(boot_key(entry.test, child.kind is Kind.FORK))
        if child.state is not State.STARTING or boot is None:
            return None
        return child.since + boot + entry.test.duration

    def shadow(self, head: ev.Test) -> float | None:
        """The earliest the head could start if every child that holds a device it may
        use lets it go when its record says (None: some holder's end is unknown)."""
        among = self.bound_to(head) or self.pool.ids
        ends: dict[str, list[float]] = {d: [] for d in among}
        for child in self.live_or_settling():
            if self.idle_holder(child, head):
                continue  # it runs a test backfilled, or is dismissed for the head
            for device in set(child.devices) & set(among):
                end = self.ends_at(child)
                if end is None:
                    return None
                ends[device].append(end)
        wanted = self.wanted(head)
        if wanted == 0 or wanted > len(ends):
            return None
        if head.need is not None:  # a budget: perhaps as soon as any holder has gone
            return min((min(e) if e else self.now) for e in ends.values())
        # Alone: once every holder of each of ``wanted`` devices has gone.
        return sorted((max(e) if e else self.now) for e in ends.values())[wanted - 1]

    def would_end(self, test: ev.Test) -> float | None:
        """When ``test`` would end if it started now (its child's boot included), by
        its record and the longest boot of its file seen this run (None: unknown)."""
        if test.duration is None or test.scope:
            return None
        own = self.child_for(test)
        booted = own is not None and own.state in IDLE
        boot = 0.0 if booted else self.boot_seconds.get(boot_key(test, bool(test.template)))
        if boot is None:
            return None
        factor, extra = self.SLACK
        return self.now + (boot + test.duration) * factor + extra

    def fits_now(self, test: ev.Test) -> bool:
        """Whether ``test`` could run now: its own booted child holds its devices, or
        its claim fits."""
        own = self.child_for(test)
        if own is not None and own.state is State.READY and own.devices:
            return True
        return self.choose(test) is not None

    def can_ever_fit(self, test: ev.Test) -> bool:
        count = self.wanted(test)
        empty = _packing.Pool(self.pool.ids, self.pool.capacity, self.pool.per_gpu, 0)
        return count == 0 or empty.choose(count, test.need) is not None

    def unfit_why(self, test: ev.Test) -> str:
        need = "alone" if test.need is None else _packing.show(test.need)
        return f"it needs {self.wanted(test)} device(s) ({need}); the run has {self.pool.ids}"

    def in_slot(self) -> int:
        """The job slots the started tests take."""
        jobs = self.settings.jobs
        return sum(min(e.test.slots, jobs) for e in self.started.values())

    def slot_for(self, test: ev.Test) -> bool:
        """Whether ``test`` may start now as far as job slots go: its slots are free, or
        no test has started (one that needs more slots than the run has runs alone)."""
        used = self.in_slot()
        return used == 0 or used + min(test.slots, self.settings.jobs) <= self.settings.jobs

    def scope_child(self, scope: str) -> Child | None:
        serving = (State.STARTING, State.READY, State.RUNNING, State.BETWEEN)
        took = self.by_scope.get(scope)
        if not took:
            return None
        took[:] = [c for c in took if c.state is not State.GONE]
        found = [c for c in took if c.scope == scope and c.state in serving]
        found = [c for c in found if c.kind in (Kind.SCOPE, Kind.EARLY) and c.members]
        return max(found, key=lambda c: c.id) if found else None  # the latest started

    def child_for(self, test: ev.Test) -> Child | None:
        """A child booted ahead or started early that can run ``test``."""
        for child in self.live_children():
            if child.test == test.id and child.state in (State.STARTING, State.READY):
                return child
        for child in self.live_children():
            if child.kind is not Kind.EARLY or child.test or child.key != test.key:
                continue
            if child.state not in (State.STARTING, State.READY):
                continue
            if len(child.devices) != self.wanted(test) or child.need != test.need:
                self.dismiss(child)  # the guess was wrong: it runs nothing
                continue
            child.test, child.scope = test.id, test.scope
            if test.scope:
                self.by_scope.setdefault(test.scope, []).append(child)
            child.members = self.members(test)
            return child
        return None

    def members(self, test: ev.Test) -> list[str]:
        if not test.scope:
            return [test.id]
        waiting = (Phase.KNOWN, Phase.WAITING)
        at = self.position[test.id]
        later = [
            t
            for t in self.order[at + 1 :]
            if self.tests[t].test.scope == test.scope and self.tests[t].phase in waiting
        ]
        return [test.id, *later]

    def first_of_scope(self, test: ev.Test) -> bool:
        return self.scope_head(test.scope) == test.id

    def scope_head(self, scope: str) -> str:
        """The first of ``scope``'s tests not ended, where no child serves the scope
        ("" where one does, or none is left)."""
        if self.scope_child(scope) is not None:
            return ""
        ids = self.scoped.get(scope, [])
        ended = self.scope_ended.get(scope, 0)
        while ended < len(ids) and self.tests[ids[ended]].phase is Phase.ENDED:
            ended += 1
        self.scope_ended[scope] = ended
        for at in range(ended, len(ids)):
            entry = self.tests[ids[at]]
            if entry.test.scope == scope and entry.phase is not Phase.ENDED:
                return ids[at]
        return ""

    def upcoming(self, n: int) -> list[ev.Test]:
        """The next ``n`` tests pytest has not reached that would start a child.

        A scope's later tests run in its first test's child: they are passed over, so
        the next scope's child boots while a long scope still runs.
        """
        if self.told_next is not None:
            ahead: Iterable[str] = [t for t in self.told_next if t in self.tests]
        else:
            ahead = (self.order[i] for i in range(self.furthest + 1, len(self.order)))
        out: list[ev.Test] = []
        scopes: set[str] = set()
        for tid in ahead:
            entry = self.tests[tid]
            scope = entry.test.scope
            if entry.phase is not Phase.KNOWN or scope in scopes:
                continue
            if scope:
                scopes.add(scope)
                child = self.scope_child(scope)
                if child is not None and tid in child.members:
                    continue
            out.append(entry.test)
            if len(out) >= n:
                break
        return out

    def is_ahead(self, child: Child) -> bool:
        """Booted for a test that has not got its slot yet (not reached, or waiting)."""
        if child.state not in (State.STARTING, State.READY) or not child.test:
            return False
        return self.tests[child.test].phase in (Phase.KNOWN, Phase.WAITING)

    def idle_holder(self, child: Child, head: ev.Test) -> bool:
        """A child that holds devices while it waits for a test other than the head."""
        if not child.devices or child.kind is Kind.FORK or child.test == head.id:
            return False
        if child.state in IDLE:
            return not (child.members[:1] == [head.id])
        unassigned = child.kind is Kind.EARLY and not child.test
        return child.state is State.STARTING and (unassigned or self.is_ahead(child))

    def peers_hold(self) -> bool:
        """Whether another xdist worker holds a device (its claims are polled)."""
        return any(c.token == PEER for d in self.pool.ids for c in self.pool.held(d))

    def next_wake(self) -> float | None:
        """When the driver must send a ``Tick`` at the latest (None: only events matter)."""
        if self.paused and self.held:
            return self.now  # what waits to be told goes on at the next batch
        times = [c.deadline for c in self.live_or_settling() if c.deadline is not None]
        if self.queue and self.peers_hold():
            times.append(self.now + self.settings.poll)
        for tid in self.queue:
            entry = self.tests[tid]
            if not entry.warned:
                times.append(entry.submitted + self.settings.patience)
        return min(times) if times else None

    def placed(self, test: str) -> bool:
        """Whether pytest may go on past ``test`` (it started, ended, or waits in its scope)."""
        entry = self.tests.get(test)
        if entry is None or entry.phase in (Phase.STARTED, Phase.ENDED):
            return entry is not None
        if entry.phase is Phase.WAITING and entry.passed:
            return True
        if entry.phase is not Phase.WAITING or not entry.test.scope:
            return False
        child = self.scope_child(entry.test.scope)
        busy = (State.STARTING, State.READY, State.RUNNING)
        return child is not None and child.state in busy and test in child.members
