"""The dispatcher's state: tests, children, devices and claims, and the moves on them.

Runs in the parent; pure. ``Entry`` is a test's record, ``Run`` holds the state and the
primitive moves (start a child, end a test, tell what ended, give a claim back), each of
which records its action; ``queries.Queries`` asks about it, and ``core.Dispatcher``
makes the decisions on top of both. Imports only its siblings and ``devices._packing``.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace

from spawnrun.devices import _packing
from spawnrun.dispatch import events as ev
from spawnrun.dispatch.events import Kind
from spawnrun.dispatch.units import IDLE
from spawnrun.dispatch.units import Child
from spawnrun.dispatch.units import Illegal
from spawnrun.dispatch.units import State

PEER = "peer"


class Phase(enum.Enum):
    KNOWN = "not reached"
    WAITING = "waiting"
    STARTED = "started"
    ENDED = "ended"


@dataclass
class Entry:
    test: ev.Test
    phase: Phase = Phase.KNOWN
    child: int = 0
    submitted: float = 0.0
    #: Its child booted ahead died before its turn: its report when the turn comes.
    failed_ahead: str = ""
    warned: bool = False
    ended_by: str = ""
    #: pytest went on past it while it waited for devices (``Settings.backfill``).
    passed: bool = False
    #: It runs again, alone, after a failure a guess may have caused (``Done.again``).
    again: bool = False
    #: It started while a test submitted before it still waited (backfilled, or past a
    #: gathered test): a failure then runs it again, after the tests before it.
    overtook: bool = False
    #: ... and so it runs again: not before every test submitted before it has ended.
    in_order: bool = False
    #: Its run failed (``Done.failed``), or its report is a failure.
    failed: bool = False
    #: The run's started entries, which this entry joins and leaves as its phase
    #: changes (``Queries.in_slot`` is asked at every decision; summing every test's
    #: entry there made a run of N tests cost N squared).
    started: dict[str, Entry] | None = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name == "phase" and self.started is not None:
            if value is Phase.STARTED:
                self.started[self.test.id] = self
            else:
                self.started.pop(self.test.id, None)


def boot_key(test: ev.Test, fork: bool) -> tuple[bool, str]:
    """What boot times are kept by (``Run.boot_seconds``): a fork's or a child's, of a
    file (a test's file, else its id)."""
    return fork, test.file or test.id


class Run:
    def __init__(self, settings: ev.Settings) -> None:
        self.settings = settings
        capacity = dict(settings.capacity)
        self.pool = _packing.Pool(
            settings.devices,
            {d: capacity.get(d) for d in settings.devices},
            settings.per_gpu,
            settings.reserve,
        )
        self.tests: dict[str, Entry] = {}
        #: Test ids in the order pytest reaches them (the suite's, then submissions'),
        #: and each one's place in it.
        self.order: list[str] = []
        self.position: dict[str, int] = {}
        self.submitted: list[str] = []
        #: The place in ``order`` of the furthest test submitted (-1: none yet).
        self.furthest = -1
        #: The entries whose phase is ``STARTED`` (kept by ``Entry``).
        self.started: dict[str, Entry] = {}
        self.queue: list[str] = []
        #: Every child this run started, gone ones too (a late event names its child).
        self.children: dict[int, Child] = {}
        #: The children not yet gone, pruned as they are looked at: what the queries
        #: walk, many times per event (a suite of thousands of tests ran as many
        #: children, and walking them all made each event cost as much as the run).
        self.current: dict[int, Child] = {}
        #: The children that took each scope (``scope_child`` looks among them only;
        #: gone ones are pruned as it looks, and one whose scope changed is passed over).
        self.by_scope: dict[str, list[Child]] = {}
        #: Each scope's tests in ``order``'s order, and how many at its head have ended
        #: (an ended test stays ended): ``first_of_scope`` starts past them.
        self.scoped: dict[str, list[str]] = {}
        self.scope_ended: dict[str, int] = {}
        self.templates: dict[str, Child] = {}
        #: Templates that may not fork and scopes not shared after all (key -> why).
        self.refused: dict[str, str] = {}
        #: What a boot of each file touched (``ev.Booted.touched``), as earlier runs and
        #: this one saw it: a file's children boot unclaimed once it is known not to
        #: make a context.
        self.boots: dict[str, str] = dict(settings.boots)
        #: The longest boot seen this run, by (a fork?, file): from a child's start to
        #: its ``Booted``, for backfilling.
        self.boot_seconds: dict[tuple[bool, str], float] = {}
        #: Free memory per device as NVML last said (absent: unknown).
        self.free: dict[str, int | None] = {}
        self.stopping = ""
        #: The test whose report stopped the session (those before it go on), the one
        #: that interrupted it, and whether the driver was told.
        self.stopped_after = ""
        self.interrupting = ""
        self.interrupt_told = False
        self.last = False
        self.collecting = True
        #: The tests pytest reaches next where the suite's order is not its order (an
        #: xdist worker's, told by ``Next``); None: the suite's order.
        self.told_next: tuple[str, ...] | None = None
        self.now = 0.0
        self.out: list[ev.Action] = []
        #: For the summary and the properties: tests reported stuck, children given up.
        self.stuck = 0
        self.lost = 0
        self._ids = 0
        #: Ended tests whose replay, report or drop waits for the tests submitted before
        #: them; how many submitted tests were told in order.
        self.held: dict[str, ev.Action] = {}
        self.told = 0
        #: A failure was told: nothing more is until the next batch of events (the
        #: driver's ``Stop`` comes in it, if that failure stopped the session).
        self.paused = False

    # Moves ---------------------------------------------------------------------------

    def emit(self, action: ev.Action) -> None:
        self.out.append(action)

    def know(self, test: ev.Test) -> Entry:
        if test.scope and test.scope in self.refused:
            test = replace(test, scope="")
        entry = self.tests.get(test.id)
        if entry is None:
            entry = self.tests[test.id] = Entry(test, started=self.started)
            self.position[test.id] = len(self.order)
            self.order.append(test.id)
        elif entry.phase is Phase.KNOWN:
            entry.test = test  # the plan at its turn is the one that counts
        if test.scope:
            self._index_scope(test.id, test.scope)
        return entry

    def _index_scope(self, tid: str, scope: str) -> None:
        """``tid`` among its scope's tests, in ``order``'s order (a plan at its turn may
        name another scope than the first: it is then in both; queries check)."""
        ids = self.scoped.setdefault(scope, [])
        if tid in ids[-1:]:
            return
        at = self.position[tid]
        if not ids or self.position[ids[-1]] < at:
            ids.append(tid)
        elif tid not in ids:
            bisect.insort(ids, tid, key=self.position.__getitem__)
            self.scope_ended[scope] = 0  # counted again from the head

    def end(self, entry: Entry, action: ev.Action) -> None:
        if entry.phase is Phase.ENDED:
            raise Illegal(f"{entry.test.id} ended twice ({entry.ended_by}, then {action})")
        entry.phase, entry.ended_by = Phase.ENDED, type(action).__name__
        self.held[entry.test.id] = action  # told in submission order (``tell``)

    def tell(self) -> None:
        """What ended is told in submission order, as in-process pytest would report it
        (a test may stop the session: ``pytest.exit``, KeyboardInterrupt; what ended
        after it is then dropped, never replayed). ``Settings.ordered``: nothing after a
        failure in the same batch (the driver tells ``Stop`` before the next, if that
        failure stopped the session)."""
        while self.told < len(self.submitted) and not self.paused:
            tid = self.submitted[self.told]
            entry = self.tests[tid]
            if entry.phase is not Phase.ENDED:
                return
            self.told += 1
            action = self.held.pop(tid, None)
            if action is None:
                continue
            self.emit(action)
            self.paused = self.settings.ordered and self._fails(tid, action)

    def _fails(self, test: str, action: ev.Action) -> bool:
        """Whether telling ``action`` reports a failure (which may stop the session)."""
        if isinstance(action, ev.Report):
            return action.outcome is not ev.Outcome.STOPPED
        return isinstance(action, ev.Replay) and self.tests[test].failed

    def unshare(self, child: Child, why: str) -> None:
        """The child's scope is not shared: it runs its test, later ones get their own."""
        self.refused.setdefault(child.scope, why)
        child.members = child.members[:1]
        for entry in self.tests.values():
            if entry.test.scope == child.scope and entry.phase in (Phase.KNOWN, Phase.WAITING):
                entry.test = replace(entry.test, scope="")
        child.scope = ""

    def warn(self, test: str, text: str) -> None:
        self.emit(ev.Warn(test, "spawnrun: " + text))

    def start(
        self,
        kind: Kind,
        devices: tuple[str, ...],
        need: int | None,
        test: ev.Test | None = None,
        members: list[str] | None = None,
        key: str = "",
        parent: int = 0,
        deferred: bool = False,
    ) -> Child:
        self._ids += 1
        scope = test.scope if test is not None else ""
        claimed = () if deferred else devices
        child = Child(self._ids, kind, claimed, need, scope=scope, key=key, parent=parent)
        child.deferred, child.seen = deferred, devices if deferred else ()
        child.test = test.id if test is not None else ""
        child.members = list(members or [])
        child.since = self.now
        self.children[child.id] = self.current[child.id] = child
        if scope:
            self.by_scope.setdefault(scope, []).append(child)
        if claimed:
            self.pool.take(claimed, need, f"c{child.id}")
        members_ = tuple(child.members)
        self.emit(
            ev.Start(child.id, kind, devices, child.test, scope, members_, key, parent, deferred)
        )
        return child

    def assign(self, child: Child, devices: tuple[str, ...]) -> None:
        """A deferred child's devices, claimed from now on (its go tells it them)."""
        child.devices = devices
        if devices:
            self.pool.take(devices, child.need, f"c{child.id}")

    def go(self, child: Child, entry: Entry) -> None:
        child.test = entry.test.id
        timeout = entry.test.timeout
        child.move(State.RUNNING, self.now, None if timeout is None else self.now + timeout)
        self.emit(ev.Go(child.id, entry.test.id, child.devices))

    def dismiss(self, child: Child) -> None:
        if child.state in (State.STARTING, *IDLE):
            child.move(State.EXITING, self.now, self.now + self.settings.exit_grace)
            self.emit(ev.Dismiss(child.id))

    def settled(self, child: Child) -> None:
        child.move(State.GONE, self.now)
        self.give_back(child)

    def give_back(self, child: Child) -> None:
        if child.devices:
            self.pool.give_back(child.devices, f"c{child.id}")

    def set_peers(self, claims: tuple[tuple[str, int | None], ...]) -> None:
        for device in self.pool.ids:
            self.pool.claims[device] = [c for c in self.pool.held(device) if c.token != PEER]
        for device, need in claims:
            if device in self.pool.ids:
                self.pool.held(device).append(_packing.Claim(PEER, need))
