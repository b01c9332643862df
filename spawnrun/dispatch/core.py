"""The dispatcher: every scheduling decision of a run, as events in and actions out.

Runs in the parent; pure (no processes, pipes, clock, NVML or pytest objects), so the
simulator (``tests/sim``) and property tests drive it exactly as the driver does.
Policy, in full:

* **Job slots.** Started tests take at most ``jobs`` slots: one each, or as many as the
  cores an earlier run measured a test keeping busy need (``Test.slots``), so that tests
  that each run many threads do not share the cores beyond what they hold (16 timm tests
  of 16 threads each at once took several times as long as one by one). A test that
  needs more than the run has waits until nothing else has started.
* **Turns in submission order.** Submitted tests wait in one queue; the first that
  cannot start (the *head*) stops the scan, so later tests never starve it. A test whose
  scope's child is still running the scope's previous test waits *behind its scope* and
  does not block the queue: other scopes' children run meanwhile.
* **Every child that can see a device holds a claim on it** from its start until it is
  gone (exited and released by NVML, or past ``settle``): children started early too.
  Claims go through ``_packing.Pool``: budgets within capacity and the per-device cap,
  a test alone on its devices nobody else holds.
* **A child whose boot touches no device memory boots unclaimed** (``Settings.defer``):
  once a boot of its file is known (this run or an earlier one, ``Booted.touched``) to
  make no context, a child booted ahead, or at a turn whose devices are taken, sees the
  least held devices but claims nothing; at its go it claims its devices (those it saw,
  if its boot initialized the driver). At its test's turn, a child still booting claims
  the devices it sees as soon as they are free, and takes its slot: its boot then runs
  under the driver's boot limit. Files never booted, or whose boot makes a context,
  boot holding their claims.
* **No hold and wait.** An idle child (booted ahead, started early, a scope's child
  between tests) never keeps the head from its devices: when dismissing idle holders
  lets the head fit, they are dismissed. Booting ahead happens while no test is blocked,
  or while every slot is taken (a slot frees by itself): then the tests waiting for a
  slot boot first.
* **Backfilling** (``Settings.backfill``): while the head waits for devices that running
  tests hold, later tests that fit now and, by what earlier runs recorded
  (``Test.duration``), end before the head could start (``shadow``) run meanwhile; pytest
  goes on past such a head so that they reach the queue. Unrecorded: nothing changes.
* **Gathering** (``Settings.gather``): a test that needs its devices alone, whose
  devices others hold, waits passed over (pytest goes on) while later tests that fit
  run; it runs once its devices are empty, so that one drain serves several such tests
  instead of each draining the device at its turn (a scope's test only while its scope
  has no child). Not once the session stops, not past
  ``gather`` such tests waiting (the earliest is the head again), and not once pytest
  reached its last test with nothing but them left to start.
* **A scope's child runs its members in order.** A test that is not its child's next
  member gets a child of its own (the old one is dismissed once idle).
* **Nothing waits without a wake-up.** After each batch of events, if the head waits and
  no child is in a state that ends by itself (a live process or a deadline), no other
  worker holds a device, the head is reported as one that could not be run, with what
  it waited for, and the run goes on (``live.explain``).
* **Ends** are ``ends.Ends``'s: what each way a child ends means for its test.
* **Starts** are ``starts.Starts``'s: placing a test at its turn, backfilling,
  preempting idle holders, booting ahead; this module scans the queue, gathers, and
  takes the events.
"""

from __future__ import annotations

from spawnrun.dispatch import events as ev
from spawnrun.dispatch import live
from spawnrun.dispatch.events import Kind
from spawnrun.dispatch.events import Outcome
from spawnrun.dispatch.starts import Placed
from spawnrun.dispatch.starts import Starts
from spawnrun.dispatch.state import Entry
from spawnrun.dispatch.state import Phase
from spawnrun.dispatch.units import Child


class Dispatcher(Starts):
    def handle(self, *events: ev.Event) -> list[ev.Action]:
        """Take a batch of events (those of one loop turn) and return what follows.

        Only what the events end or kill: the driver replays those reports (which may
        stop the session: ``Stop``) before it asks ``step`` what to start next.
        """
        self.out = []
        self.paused = False  # a stop that the failure told last caused is among them
        for event in events:
            self.now = max(self.now, event.now)
            self._on(event)
        self._tell()
        out, self.out = self.out, []
        return out

    def _tell(self) -> None:
        """What ended, in submission order; then an interrupt, once the tests pytest
        reached before its test have been told."""
        self.tell()
        if self.interrupting and not self.interrupt_told and not self.earlier_running():
            if self.interrupting not in self.held:
                self.interrupt_told = True
                self.emit(ev.Interrupt(self.interrupting))

    def step(self) -> list[ev.Action]:
        """The decisions: what starts, runs, is dismissed, or is reported stuck now."""
        self.out = []
        self._schedule()
        self._tell()
        out, self.out = self.out, []
        return out

    # Events --------------------------------------------------------------------------

    def _on(self, event: ev.Event) -> None:
        if isinstance(event, ev.Suite):
            for test in event.tests:
                self.know(test)
        elif isinstance(event, ev.Submit):
            self._submit(event.test)
        elif isinstance(event, ev.Expect):
            self._expect(event)
        elif isinstance(event, ev.Collected):
            self.collecting = False
            for child in self.live_children():
                if child.kind is Kind.EARLY and not child.test and child.key not in event.keys:
                    self.dismiss(child)
        elif isinstance(event, ev.Peers):
            self.set_peers(event.claims)
        elif isinstance(event, ev.Next):
            self.told_next = event.tests
        elif isinstance(event, ev.Free):
            self.free = dict(event.free)
        elif isinstance(event, ev.Stop):
            self._stop(event.reason, event.after)
        elif isinstance(event, ev.Last):
            self.last = True
        elif isinstance(event, ev.Tick):
            self._deadlines()
        else:
            self._child_event(event)

    def _submit(self, test: ev.Test) -> None:
        entry = self.know(test)
        if entry.phase is not Phase.KNOWN:
            return  # submitted twice (a rerun plugin): the first one counts
        entry.phase, entry.submitted = Phase.WAITING, self.now
        self.submitted.append(test.id)
        self.furthest = max(self.furthest, self.position[test.id])
        if self.stopping:
            self.end(entry, ev.Drop(test.id))
        elif entry.failed_ahead:
            self.end(entry, ev.Report(test.id, Outcome.START_FAILED, entry.failed_ahead))
        elif not self.can_ever_fit(test):
            self.end(entry, ev.Report(test.id, Outcome.UNFIT, self.unfit_why(test)))
        else:
            self.queue.append(test.id)

    def _expect(self, event: ev.Expect) -> None:
        early = [c for c in self.live_children() if c.kind is Kind.EARLY and not c.test]
        if not self.collecting or self.stopping or len(early) >= self.settings.early:
            return
        probe = ev.Test("", count=event.count, need=event.need)
        devices = self.choose(probe)
        if devices is not None:
            self.start(Kind.EARLY, devices, event.need, key=event.key)

    # Decisions -----------------------------------------------------------------------

    def _schedule(self) -> None:
        self._dismiss_unneeded()
        for _ in range(len(self.queue) + 1):
            head, placed = self._scan()
            booting = placed == "booting"
            if head is None or booting or not self.slot_for(self.tests[head].test):
                # Every slot taken is progress that frees one: the tests that wait for
                # it boot meanwhile (their claims are preempted if the head needs them).
                # So is a head whose own child boots. (A head is in the queue; so are
                # tests passed over by gathering, which boot ahead too.)
                self._boot_ahead(waiting=bool(self.queue))
            if head is None or booting:
                return
            if live.can_move(self, head):
                return
            entry = self.tests[head]
            self.queue.remove(head)
            self.stuck += 1
            self.end(entry, ev.Report(head, Outcome.STUCK, live.dump(self, head)))

    def _scan(self) -> tuple[str | None, Placed]:
        """Start what may start now, in order; the head and why it waits, if one does
        ("blocked": for a slot or devices; "booting": for its own child's boot)."""
        if self.stopping and not self.stopped_after:
            return None, ""
        behind = self._others_behind()
        for at, tid in enumerate(list(self.queue)):  # after a stop: reached before its test
            entry = self.tests[tid]
            if behind is not None and self._gathers(entry, behind[at] > 0):
                entry.passed = True  # pytest goes on; it runs once its devices are empty
                continue
            placed = self._place(entry)
            if placed == "started":
                entry.overtook = entry.overtook or self._overtakes(tid)
            if placed in ("started", "ended"):
                if tid in self.queue:
                    self.queue.remove(tid)
            elif placed in ("blocked", "booting"):
                if placed == "blocked":
                    self._backfill(self.tests[tid])
                # A head whose own child boots takes its devices as soon as they are
                # free (its boot limit starts then): idle holders go for it too.
                self._preempt(self.tests[tid].test)
                return tid, placed
        return None, ""

    def _others_behind(self) -> list[int] | None:
        """For each queued test, how many tests that start by themselves (not gathered,
        of no scope: a scope's later test may wait for its earlier one) wait behind it;
        None: nothing is gathered now (``Settings.gather``). Not once the session stops,
        not while a failure waits to be told (``Settings.ordered``), not past the limit of
        such tests waiting, and not once pytest reached its last test with nothing but
        them left to start (then one drain serves them all)."""
        if not self.settings.gather or self.stopping:
            return None
        if self.settings.ordered and any(self._fails(t, a) for t, a in self.held.items()):
            # A failure waits to be told until every test before it has ended: none of
            # them may wait, passed over, for tests that all wait for it (a deadlock).
            return None
        gatherable = [self._gatherable(self.tests[t]) for t in self.queue]
        alone = sum(gatherable)
        held = [self._held_back(self.tests[t]) for t in self.queue]
        waits = sum(g or h for g, h in zip(gatherable, held, strict=True))
        if alone > self.settings.gather or (self.last and waits == len(self.queue)):
            return None
        others, behind = 0, []
        for tid, gathered, back in zip(
            reversed(self.queue), reversed(gatherable), reversed(held), strict=True
        ):
            behind.append(others)
            others += not (gathered or back or self.tests[tid].test.scope)
        behind.reverse()
        return behind

    def _gatherable(self, entry: Entry) -> bool:
        test = entry.test
        return (
            test.need is ev.ALONE
            and self.wanted(test) > 0
            # A scope's test only while its scope has no child holding devices (such
            # a child runs the scope's members in order, on the devices it holds).
            and (not test.scope or self._scope_holds_nothing(test.scope))
            and not entry.again  # it runs again at once, as its report says
        )

    def _scope_holds_nothing(self, scope: str) -> bool:
        child = self.scope_child(scope)
        return child is None or self.waits_for_devices(child)

    def _gathers(self, entry: Entry, others_wait: bool) -> bool:
        """A test that needs its devices alone, while others hold them or other tests
        wait behind it: it waits, passed over, while those run (each drain of a device
        serves several such tests instead of one, and a device that empties is filled by
        tests that share it first). Its own child booted ahead, if any, waits with it."""
        if not self._gatherable(entry):
            return False
        own = self.child_for(entry.test)
        if own is not None and own.devices and not self.waits_for_devices(own):
            return False  # booted holding its devices: it goes now
        if others_wait:
            return True
        among = self.bound_to(entry.test)
        # Idle children booted for tests held back (``_held_back``) wait for this one to
        # end: they count as gone (it becomes the head, which has them dismissed).
        idle = {c.id for c in self.live_children() if self._idle_for_held(c, entry.test)}
        return self.choose(entry.test, among=among, without=idle) is None

    def _idle_for_held(self, child: Child, test: ev.Test) -> bool:
        """An idle child (booted ahead, or a scope's between tests) whose next test is
        held back."""
        waits_for = child.test or (child.members[0] if child.members else "")
        mine = self.tests.get(waits_for) if waits_for else None
        return mine is not None and self._held_back(mine) and self.idle_holder(child, test)

    def _overtakes(self, test: str) -> bool:
        """Whether a test that starts now passes one submitted before it that waits,
        passed over (gathered, or a head that backfilling went past): it runs out of
        pytest's order."""
        at = self.queue.index(test) if test in self.queue else len(self.queue)
        return any(self.tests[t].passed for t in self.queue[:at])
