"""A deterministic world for the dispatcher: simulated children, a fake clock, and pytest.

``World.run`` drives ``spawnrun.dispatch.Dispatcher`` as the driver does: it submits the
tests in pytest's order and, for each, waits until the dispatcher has placed it, while
the simulated processes boot, run, crash, linger and exit on a clock that jumps from
event to event. It keeps its own record of every process and checks, after every batch:

* a device never holds more than its capacity (budgets plus a reserve each) or its cap,
  and a test that runs alone shares its device with no live process. The oracle is the
  world's truth, never the dispatcher's records: each process's need is what its test's
  plan declares (or, after ``Again``, what its rerun runs with), and a process holds its
  devices from its start until it has exited and NVML released its memory (``settle``
  after its exit at most: past that the driver takes the memory as gone), whether or not
  the dispatcher still counts it; only a process that outlived its kill by
  ``kill_grace`` (unkillable) is left out, as the design gives it up;
* the tests whose code runs at once take at most ``jobs`` job slots (each its
  ``slots``); a process sent a kill runs none (SIGKILL), though it still holds its
  devices as above;
* actions respect the processes: a go only to a booted idle child, no action to one
  that has exited;
* a scope's child runs its tests in the order they were submitted;
* a child booted unclaimed (deferred) touches no device memory until its go gives it
  devices (one whose boot makes a context holds the devices it saw from its start, and
  the checks above count it), and one whose boot initialized the driver runs only on
  the devices it saw.

Other xdist workers share the devices through a ledger that the world keeps as the
truth: a peer's claim is taken when it fits beside the claims there (the world's own
live processes included). As the driver does, the world reads the ledger only when it
feeds the dispatcher (a batch of events or a tick), and tells ``Peers`` when the claims
changed at least ``peer_lag`` seconds before; nothing else tells a peer's release. A
start onto devices a peer took meanwhile is ``Denied``, with the ledger's claims, as
the driver's ledger claim would be; the safety checks count peers' claims too.

Every wait has a wake-up (``Late``): before the clock moves on, each child the
dispatcher counts as moving by itself (starting, running, exiting, killed, settling)
has a deadline or an event the world will send it, and while a test waits and the
dispatcher sees a peer's claim, it is fed again within ``poll``. A state in which the
simulated pytest waits and nothing is due (no process event, no tick asked for) is a
hang, and so is a loop of feeds at one instant or a run past a bounded number of steps:
``Hang`` is raised with the dispatcher's state, never a simulator that loops.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace

from spawnrun.devices import _packing
from spawnrun.dispatch import Dispatcher
from spawnrun.dispatch import batch
from spawnrun.dispatch import events as ev
from spawnrun.dispatch.events import Kind
from spawnrun.dispatch.events import Outcome
from spawnrun.dispatch.live import dump
from spawnrun.dispatch.units import MOVING
from spawnrun.dispatch.units import State

#: What a simulated test does. "pass"/"fail": reports and exits; "crash": dies while
#: running; "boot-die": dies while booting; "start-fail": cannot be started; "exit-3":
#: exits with status 3 after "done"; "linger": does not exit after "done" until killed;
#: "unkillable": not even then; "interrupt": calls pytest.exit; "poison": fails with an
#: error that says the process is broken; "guess": fails where it runs with a budget
#: (a learned one that was too small), so the driver asks for it again (``Done.again``),
#: and passes alone.
FATES = (
    "pass",
    "fail",
    "crash",
    "boot-die",
    "start-fail",
    "exit-3",
    "linger",
    "unkillable",
    "interrupt",
    "poison",
    "guess",
)
FAILING = {"fail", "crash", "boot-die", "start-fail", "poison"}


class Hang(AssertionError):
    pass


class Unsafe(AssertionError):
    pass


class Late(AssertionError):
    """A wait with no wake-up: a child that nothing will move, or a peer not polled."""


#: The world's events that reach a child (what may end its state).
_TO_CHILD = (ev.Booted, ev.Done, ev.Exited, ev.Released, ev.Refused, ev.StartFailed)


@dataclass
class Spec:
    test: ev.Test
    duration: float = 0.5
    boot: float = 1.0
    fate: str = "pass"
    exit_after: float = 0.05
    release: float = 0.0
    #: What its file's collection does to the devices a child sees ("", ev.DRIVER: a
    #: conftest asks CUDA for devices, ev.CONTEXT: it allocates).
    touches: str = ""
    #: Order-dependent: it fails where it starts before this test has (which writes
    #: what it reads).
    needs_first: str = ""


@dataclass
class Proc:
    child: int
    kind: Kind
    devices: tuple[str, ...]
    need: int | None
    test: str
    members: tuple[str, ...]
    booted: bool = False
    exited: bool = False
    released: bool = False
    running: str = ""
    ran: list[str] = field(default_factory=list)
    last_fate: str = "pass"
    #: Booted unclaimed, seeing ``seen``: its devices come with its go.
    deferred: bool = False
    seen: tuple[str, ...] = ()
    #: What its boot did to the devices it saw.
    touched: str = ""
    #: From its exit to NVML's release of its memory (inf: never).
    release_after: float = 0.0
    #: What the driver claimed for it in the ledger (the dispatcher's record).
    claimed: int | None = None
    #: When it exits, and when its memory is free (the truth the safety checks use:
    #: NVML's release, or ``settle`` after its exit at most); None: not yet known.
    exit_at: float | None = None
    freed_at: float | None = None
    #: It was sent a kill and did not die (unkillable): from then it runs none of its
    #: test's code, so it takes no job slot; it holds its devices until this time, when
    #: the design gives it up.
    defied_at: float | None = None


@dataclass
class Result:
    ends: dict[str, list[str]]
    warnings: list[tuple[str, str]]
    stuck: list[str]
    time: float
    procs: dict[int, Proc]
    stopped: bool
    dispatcher: Dispatcher
    actions: list[ev.Action]


class World:
    def __init__(
        self,
        settings: ev.Settings,
        specs: list[Spec],
        maxfail: int = 0,
        expect: tuple[tuple[str, int, int | None], ...] = (),
        peers: tuple[tuple[float, float, str, int | None], ...] = (),
        peer_lag: float = 0.0,
        told_next: bool = False,
        suite: bool = True,
        template_refuses: frozenset[str] = frozenset(),
        dispatcher: Callable[[ev.Settings], Dispatcher] = Dispatcher,
        record: bool = False,
    ) -> None:
        self.settings = settings
        self.specs = {s.test.id: s for s in specs}
        self.order = [s.test.id for s in specs]
        self.maxfail = maxfail
        self.expect = expect
        self.peers = peers
        self.peer_lag = peer_lag
        #: An xdist worker: pytest tells only the next test (``Next``) before each.
        self.told_next = told_next
        #: The ledger's truth: the claims peers hold now, by peer index.
        self.peer_claims: dict[int, tuple[str, int | None]] = {}
        self.denied: set[int] = set()
        #: Events the driver tells in the same feed as the action that caused them.
        self.told_now: list[ev.Event] = []
        self.suite = suite
        self.template_refuses = template_refuses
        self.d = dispatcher(settings)
        #: Each test's plan as the world knows it (declared; a rerun's need after
        #: ``Again``), and each early key's need: the truth of what a process needs.
        self.plan = {s.test.id: s.test for s in specs}
        self.expect_need = {key: need for key, _count, need in expect}
        #: The ledger's claims last told to the dispatcher, and when they last changed.
        self.told_peers: tuple[tuple[str, int | None], ...] = ()
        self.ledger_changed = 0.0
        #: When the dispatcher was last fed, and feeds at that instant (a livelock bound).
        self.fed = 0.0
        self.feeds_now = 0
        #: ``record``: each batch of actions, as returned and as performed.
        self.record = record
        self.batches: list[tuple[list[ev.Action], list[ev.Action]]] = []
        self.now = 0.0
        self.queue: list[tuple[float, int, ev.Event]] = []
        self.seq = itertools.count()
        self.procs: dict[int, Proc] = {}
        self.ends: dict[str, list[str]] = {}
        self.warnings: list[tuple[str, str]] = []
        self.stuck: list[str] = []
        self.failures = 0
        self.stopped = False
        self.stop_due: tuple[str, str] | None = None
        self.stop_after = ""
        self.steps = 0
        self.log: list[ev.Action] = []
        #: When each test got its go, and the budget it last ran with.
        self.went: dict[str, float] = {}
        self.needs: dict[str, int | None] = {}
        self.agains: list[str] = []
        #: Whether each test's last run started before the test it needs first.
        self.out_of_order: dict[str, bool] = {}
        #: The ``Again`` actions that asked for a run in the test's order.
        self.in_order: list[str] = []
        #: The kind of child each test last ran in.
        self.kinds: dict[str, Kind] = {}
        capacity = dict(settings.capacity)
        self.capacity = {dv: capacity.get(dv) for dv in settings.devices}

    def __repr__(self) -> str:
        specs = ",\n  ".join(repr(s) for s in self.specs.values())
        return (
            f"World({self.settings!r},\n  [{specs}],\n  maxfail={self.maxfail}, "
            f"expect={self.expect!r}, peers={self.peers!r}, peer_lag={self.peer_lag!r}, "
            f"told_next={self.told_next!r}, "
            f"template_refuses={set(self.template_refuses)!r})"
        )

    # Driving -------------------------------------------------------------------------

    def run(self) -> Result:
        first: list[ev.Event] = []
        for key, count, need in self.expect:
            first.append(ev.Expect(0.0, key, count, need))
        if self.expect:
            first.append(ev.Collected(0.0, frozenset(s.test.key for s in self.specs.values())))
        if self.suite:
            first.append(ev.Suite(0.0, tuple(s.test for s in self.specs.values())))
        for index, (start, _end, _device, _need) in enumerate(self.peers):
            if start > 0.0 or not self._peer_takes(index):
                self._at(start, _PeerTakes(start, index))
        if first:
            self._apply(self._feed(*first))
        for at, tid in enumerate(self.order):
            if self.stopped:
                break
            events: list[ev.Event] = []
            if self.told_next:
                events.append(ev.Next(self.now, tuple(self.order[at + 1 : at + 2])))
            events.append(ev.Submit(self.now, self.specs[tid].test))
            self._apply(self._feed(*events))
            self._until(lambda tid=tid: self.d.placed(tid) or self.stopped, f"placing {tid}")
        if not self.stopped:
            self._apply(self._feed(ev.Last(self.now)))
        self._until(self._drained, "draining")
        return Result(
            self.ends,
            self.warnings,
            self.stuck,
            self.now,
            self.procs,
            self.stopped,
            self.d,
            self.log,
        )

    def _drained(self) -> bool:
        submitted = self.d.submitted
        return all(t in self.ends for t in submitted) and all(
            p.released or p.child in self._given_up() for p in self.procs.values()
        )

    def _given_up(self) -> set[int]:
        children = self.d.children
        return {i for i in self.procs if children[i].state is State.GONE}

    def _feed(self, *events: ev.Event) -> list[ev.Action]:
        """Feed the dispatcher, as the driver does: with the ledger's claims first, when
        they changed (``peer_lag`` ago at least) since it was last told."""
        if self.now == self.fed:
            self.feeds_now += 1
            if self.feeds_now > 2000:
                raise Hang(f"over 2000 feeds at {self.now}s (a livelock):\n{self._state()}")
        else:
            self.fed, self.feeds_now = self.now, 1
        claims = tuple(self.peer_claims.values())
        if claims != self.told_peers and self.now - self.ledger_changed >= self.peer_lag:
            self.told_peers = claims
            events = (ev.Peers(self.now, claims), *events)
        return self.d.handle(*events)

    def _until(self, done, what: str) -> None:  # type: ignore[no-untyped-def]
        while not done():
            self.steps += 1
            if self.steps > 20000:
                raise Hang(f"no end after 20000 steps while {what}")
            wake = self.d.next_wake()
            due = self.queue[0][0] if self.queue else None
            if due is None and wake is None:
                raise Hang(f"nothing due while {what}:\n{self._state()}")
            self._check_wake_ups(min(t for t in (due, wake) if t is not None))
            if due is not None and (wake is None or due <= wake):
                self.now = max(self.now, due)
                batch = []
                while self.queue and self.queue[0][0] <= self.now:
                    event = heapq.heappop(self.queue)[2]
                    if self._observe(event):
                        batch.append(event)
                if batch:
                    self._apply(self._feed(*batch))
            else:
                self.now = max(self.now, wake)  # type: ignore[type-var]
                self._apply(self._feed(ev.Tick(self.now)))

    def _check_wake_ups(self, until: float) -> None:
        """Before the clock moves on to ``until``: every child the dispatcher counts as
        moving by itself has a deadline or an event coming, and a test that waits while
        the dispatcher sees a peer's claim is fed again within ``poll``."""
        if until <= self.now:
            return
        d = self.d
        if d.queue and d.peers_hold() and until - self.fed > d.settings.poll + 1e-9:
            raise Late(
                f"{d.queue[0]} waits beside a peer's claim; no feed from {self.fed}s "
                f"to {until}s (poll {d.settings.poll}s)"
            )
        coming = {getattr(e, "child", None) for _, _, e in self.queue if isinstance(e, _TO_CHILD)}
        for child in d.not_gone():
            if child.state in MOVING and child.deadline is None and child.id not in coming:
                raise Late(f"at {self.now}s nothing will move {child.describe()}")

    def _observe(self, event: ev.Event) -> bool:
        """The world's side of an event; False: it is the world's own, not the driver's."""
        if isinstance(event, _PeerTakes):
            if not self._peer_takes(event.peer):
                self._at(self.now + 0.1, _PeerTakes(self.now + 0.1, event.peer))
            return False
        if isinstance(event, _PeerLeaves):
            del self.peer_claims[event.peer]
            self.ledger_changed = self.now  # told at the next feed: nothing wakes for it
            return False
        proc = self.procs.get(getattr(event, "child", -1))
        if isinstance(event, _Freed):
            if proc is not None:
                proc.released = True
            return False
        if isinstance(event, ev.Exited) and proc is not None:
            mine = self.d.children.get(proc.child)
            # The driver tells a release of every child that holds a claim when it exits:
            # one claimed while it booted unclaimed, and gone before its go, too.
            freed = proc.devices or (mine is not None and mine.devices)
            if freed and not math.isinf(proc.release_after):  # NVML may never say so
                when = self.now + proc.release_after
                self._at(when, ev.Released(when, proc.child))
        if isinstance(event, ev.Booted) and proc is not None:
            proc.booted = True
        if isinstance(event, ev.Done) and proc is not None:
            proc.running = ""
        return True

    def _peer_takes(self, index: int) -> bool:
        """Peer ``index`` takes its claim if it fits beside the ledger's claims now."""
        start, end, device, need = self.peers[index]
        if not self._ledger_pool().fits(device, need):
            return False
        self.peer_claims[index] = (device, need)
        self.ledger_changed = self.now
        self._at(self.now + (end - start), _PeerLeaves(self.now + (end - start), index))
        return True

    def _ledger(self) -> ev.Peers:
        return ev.Peers(self.now, tuple(self.peer_claims.values()))

    def _ledger_pool(self, without: int = 0) -> _packing.Pool:
        """The ledger as it is: every live process's claim and every peer's."""
        s = self.settings
        pool = _packing.Pool(s.devices, self.capacity, s.per_gpu, s.reserve)
        gone = self._given_up()
        for p in self.procs.values():
            if p.child != without and not p.released and p.child not in gone:
                pool.take(p.devices, p.claimed, f"c{p.child}")
        for index, (device, need) in self.peer_claims.items():
            pool.take((device,), need, f"peer{index}")
        return pool

    def _state(self) -> str:
        waiting = [t for t in self.d.queue]
        return dump(self.d, waiting[0]) if waiting else repr(self.d.not_gone())

    def _at(self, when: float, event: ev.Event) -> None:
        heapq.heappush(self.queue, (when, next(self.seq), event))

    # Effects -------------------------------------------------------------------------

    def _apply(self, actions: list[ev.Action]) -> None:
        """Perform what the events caused, tell a stop, then perform the decisions; a
        stop that a decision's report caused is told at once too, as the driver does
        (it queues ``Stop`` as it replays the report that stopped the session)."""
        self._perform(actions)
        self._tell_stop()
        self._perform(self.d.step())
        while self.told_now or self.stop_due:
            self._tell_stop()
            batch, self.told_now = self.told_now, []
            if batch:
                self._perform(self._feed(*batch))
            self._perform(self.d.step())

    def _tell_stop(self) -> None:
        if self.stop_due:
            why, after = self.stop_due
            self.stop_due = None
            self._perform(self._feed(ev.Stop(self.now, why, after)))

    def _perform(self, actions: list[ev.Action]) -> None:
        self.log.extend(actions)
        if len(self.log) > 50000:  # a loop at one instant (start, fail, start...) is a hang
            raise Hang(f"over 50000 actions by {self.now}s:\n{self._state()}")
        ordered = batch.performed(actions)  # in the driver's order
        if self.record:
            self.batches.append((list(actions), list(ordered)))
        for action in ordered:
            getattr(self, "_" + type(action).__name__.lower())(action)
        self._check_safety()

    def _truth(self, test: str, key: str = "") -> int | None:
        """What a process for ``test`` (or an early child for ``key``) needs, by the
        world's plan: never the dispatcher's record."""
        if test:
            return self.plan[test].need
        return self.expect_need.get(key, ev.ALONE)

    def _start(self, a: ev.Start) -> None:
        need = self.d.children[a.child].need  # what the driver claims in the ledger
        if a.devices and self.peer_claims:
            pool = self._ledger_pool()
            if not all(pool.fits(dv, need) for dv in a.devices):
                # The ledger refuses it: no process is started, and the driver says so
                # in the same feed, with the ledger's claims.
                self.denied.add(a.child)
                self.told_now += [ev.Denied(self.now, a.child), self._ledger()]
                return
        truth = self._truth(a.test, a.key)
        proc = Proc(a.child, a.kind, a.devices, truth, a.test, a.members, deferred=a.deferred)
        proc.claimed = need
        self.procs[a.child] = proc
        spec = self.specs.get(a.test)
        touched = ""
        if spec is not None and a.kind in (Kind.SPAWN, Kind.SCOPE):
            touched = proc.touched = spec.touches
        elif a.kind is Kind.EARLY:  # it collects the file of the tests with its key
            files = [s.touches for s in self.specs.values() if s.test.key == a.key]
            touched = proc.touched = files[0] if files else ""
        if a.deferred:
            proc.seen = a.devices
            # Unclaimed, it holds device memory only if its boot makes a context.
            proc.devices = a.devices if touched == ev.CONTEXT else ()
        fate = spec.fate if spec is not None and a.kind is not Kind.TEMPLATE else "pass"
        boot = spec.boot if spec is not None else 1.0
        if a.kind is Kind.FORK:
            boot = 0.01
        if a.kind is Kind.TEMPLATE:
            boot = 1.5
        if fate == "start-fail" and a.kind is not Kind.EARLY:
            # As the driver does: told in the feed that started it (its exit never
            # comes, so nothing else would tell it before the world drains).
            proc.exited = proc.released = True
            proc.exit_at = proc.freed_at = self.now
            self.told_now.append(ev.StartFailed(self.now, a.child, "EMFILE"))
        elif fate == "boot-die" and a.kind is not Kind.EARLY:
            self._exit(proc, self.now + boot / 2, 1)
        elif a.kind is Kind.TEMPLATE and a.key in self.template_refuses:
            self._at(self.now + boot, ev.Refused(self.now + boot, a.child, "a thread runs"))
            proc.booted = True
        else:
            self._at(self.now + boot, ev.Booted(self.now + boot, a.child, touched))

    def _go(self, a: ev.Go) -> None:
        if a.child in self.denied:
            raise Unsafe(f"go to child {a.child}, which the ledger denied")
        proc = self.procs[a.child]
        if proc.exited or proc.running:
            raise Unsafe(f"go to child {a.child} that is exited or busy ({proc})")
        if not proc.booted:
            raise Unsafe(f"go to child {a.child} before it booted")
        if a.test not in self.d.submitted:
            raise Unsafe(f"{a.test} runs before pytest reached it")
        if proc.deferred and not proc.ran:
            wants = self.specs[a.test].test
            if not a.devices and (wants.count or wants.every):
                raise Unsafe(f"child {a.child} runs {a.test} with no devices")
            if proc.touched == ev.CONTEXT:
                raise Unsafe(f"child {a.child} runs {a.test}: its boot made an unclaimed context")
            if proc.touched == ev.DRIVER and a.devices != proc.seen:
                raise Unsafe(f"child {a.child} saw {proc.seen} at its boot, runs on {a.devices}")
            proc.devices = a.devices
        elif a.devices != proc.devices:
            raise Unsafe(f"go to child {a.child} on {a.devices}; it has {proc.devices}")
        if proc.ran and self.order.index(a.test) < self.order.index(proc.ran[-1]):
            raise Unsafe(f"child {a.child} got {a.test} after {proc.ran}: out of order")
        spec = self.specs[a.test]
        proc.running = a.test
        proc.ran.append(a.test)
        if a.devices:
            proc.need = self._truth(a.test)
        start = self.went[a.test] = self.now
        end = start + spec.duration
        fate = spec.fate
        proc.last_fate = fate
        if fate == "crash":
            self._exit(proc, start + spec.duration / 2, -11)
            return
        self.needs[a.test] = proc.need if a.devices else ev.ALONE
        self.kinds[a.test] = proc.kind
        again = fate == "guess" and self.needs[a.test] is not ev.ALONE
        first = spec.needs_first
        self.out_of_order[a.test] = bool(first) and first not in self.went
        done = ev.Done(
            end,
            a.child,
            a.test,
            interrupt=fate == "interrupt",
            poisoned=fate == "poison",
            again=again,
            alone=again,  # a budget's guess runs again alone; an order's with its need
            failed=fate in FAILING or again or self.out_of_order[a.test],
        )
        self._at(end, done)
        members = proc.members
        if proc.kind is Kind.EARLY:  # its members came with the test it was given
            members = tuple(self.d.children[a.child].members) or (a.test,)
        more = proc.kind in (Kind.SCOPE, Kind.EARLY) and members[-1:] != (a.test,)
        if fate in ("linger", "unkillable") or (more and fate != "poison"):
            return  # waits for its next test, a dismissal or a kill
        self._exit(proc, end + spec.exit_after, 3 if fate == "exit-3" else 0)

    def _exit(self, proc: Proc, when: float, code: int) -> None:
        if proc.exited:
            return
        proc.exited = True
        self._at(when, ev.Exited(when, proc.child, code))
        spec = self.specs.get(proc.running or proc.test)
        release = spec.release if spec is not None else 0.0
        proc.release_after = release  # its Released is told with its exit (_observe)
        proc.exit_at = when
        proc.freed_at = when + min(release, self.settings.settle)
        if not math.isinf(release):
            self._at(when + release, _Freed(when + release, proc.child))

    def _dismiss(self, a: ev.Dismiss) -> None:
        if a.child in self.denied:
            return  # never started
        proc = self.procs[a.child]
        if proc.last_fate in ("linger", "unkillable") and proc.ran:
            return
        self._exit(proc, self.now + 0.05, 0)

    def _kill(self, a: ev.Kill) -> None:
        if a.child in self.denied:
            return
        proc = self.procs[a.child]
        when = self.now + 0.01
        if proc.exit_at is not None and proc.exit_at <= when:
            return  # it exits by itself first
        if proc.last_fate == "unkillable" and proc.ran:
            if proc.defied_at is None:
                proc.defied_at = self.now + self.settings.kill_grace
            return
        self._drop_pending(proc)
        self._exit(proc, when, -9)

    def _drop_pending(self, proc: Proc) -> None:
        """What the process would still have done: gone with it (a kill)."""
        keep = []
        for at, seq, e in self.queue:
            mine = getattr(e, "child", None) == proc.child
            if mine and isinstance(e, (ev.Done, ev.Booted, ev.Exited, ev.Released, _Freed)):
                continue
            keep.append((at, seq, e))
        self.queue = keep
        heapq.heapify(self.queue)
        proc.running = ""
        proc.exited = False
        proc.exit_at = proc.freed_at = None

    def _replay(self, a: ev.Replay) -> None:
        self._ended(a.test, "replay")
        for proc in self.procs.values():
            if proc.running == a.test:
                proc.running = ""
        if self.specs[a.test].fate in FAILING or self.out_of_order.get(a.test):
            self._failed(a.test)

    def _report(self, a: ev.Report) -> None:
        self._ended(a.test, "report:" + a.outcome.name)
        if a.outcome is Outcome.STUCK:
            self.stuck.append(a.test)
        if a.outcome is not Outcome.STOPPED:
            self._failed(a.test)

    def _again(self, a: ev.Again) -> None:
        self.agains.append(a.test)
        if a.alone:  # its rerun runs with no budget
            self.plan[a.test] = replace(self.plan[a.test], need=ev.ALONE)
        if a.order:
            self.in_order.append(a.test)

    def _drop(self, a: ev.Drop) -> None:
        self._ended(a.test, "drop")

    def _warn(self, a: ev.Warn) -> None:
        self.warnings.append((a.test, a.text))

    def _interrupt(self, a: ev.Interrupt) -> None:
        self._stop("interrupted", after=a.test)

    def _ended(self, test: str, how: str) -> None:
        if how != "drop":
            self._check_told(test)
        self.ends.setdefault(test, []).append(how)

    def _check_told(self, test: str) -> None:
        """A report reaches pytest as in-process: never for a test after the one whose
        report stopped the session, and only once every test pytest reached before it
        has ended (any test may stop the session: ``pytest.exit``)."""
        submitted = self.d.submitted
        if self.stopped and self.stop_after in submitted:
            if submitted.index(test) > submitted.index(self.stop_after):
                raise Unsafe(f"{test} reported after {self.stop_after} stopped the session")
        earlier = submitted[: submitted.index(test)]
        untold = [t for t in earlier if t not in self.ends]
        if untold:
            raise Unsafe(f"{test} reported before {untold}, which pytest reached first")

    def _failed(self, test: str) -> None:
        self.failures += 1
        if self.maxfail and self.failures >= self.maxfail:
            self._stop("-x", after=test)

    def _stop(self, why: str, after: str = "") -> None:
        if not self.stopped:
            self.stopped = True
            self.stop_due = (why, after)
            self.stop_after = after

    # Safety --------------------------------------------------------------------------

    def _holds(self, proc: Proc) -> bool:
        """Whether ``proc`` holds its devices now, by the world's truth: from its start
        until its memory is free (NVML's release, or ``settle`` after its exit at most),
        given up by the dispatcher or not; not once it outlived a kill by ``kill_grace``
        (the design gives an unkillable process up)."""
        if not proc.devices:
            return False
        if proc.defied_at is not None and self.now >= proc.defied_at:
            return False
        return proc.freed_at is None or self.now < proc.freed_at

    def _check_safety(self) -> None:
        jobs = self.settings.jobs
        # A process sent a kill runs none of its test's code (SIGKILL: the test is
        # reported, and the next one may take its slot) even while it has not yet died:
        # not a slot's holder. Its devices it holds until it exits or is given up.
        running = [
            p.running
            for p in self.procs.values()
            if p.running and not p.exited and p.defied_at is None
        ]
        taken = sum(min(self.specs[t].test.slots, jobs) for t in running)
        if len(running) > 1 and taken > jobs:
            raise Unsafe(f"{running} run at once, taking {taken} job slots of {jobs}")
        holding = [p for p in self.procs.values() if self._holds(p)]
        for device in self.settings.devices:
            holders = [(f"child {p.child}", p.need) for p in holding if device in p.devices]
            holders += [
                (f"peer {i}", need) for i, (dv, need) in self.peer_claims.items() if dv == device
            ]
            alone = [who for who, need in holders if need is None]
            if alone and len(holders) > 1:
                raise Unsafe(f"gpu {device}: {alone} alone with others: {holders}")
            if len(holders) > self.settings.per_gpu:
                raise Unsafe(f"gpu {device}: {len(holders)} processes, cap {self.settings.per_gpu}")
            capacity = self.capacity[device]
            if capacity is not None and len(holders) > 1:
                used = sum((need or 0) + self.settings.reserve for _, need in holders)
                if used > capacity:
                    raise Unsafe(f"gpu {device}: {used} bytes held of {capacity}: {holders}")


@dataclass(frozen=True)
class _Freed(ev.Event):
    """The world's own note that a process's devices are free (not sent to the dispatcher)."""

    child: int


@dataclass(frozen=True)
class _PeerTakes(ev.Event):
    """The world's own: peer ``peer`` tries to take its claim in the ledger."""

    peer: int


@dataclass(frozen=True)
class _PeerLeaves(ev.Event):
    peer: int
