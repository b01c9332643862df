"""The dispatcher: every scheduling decision of a run, as events in and actions out.

Runs in the parent; pure (no processes, pipes, clock, NVML or pytest objects), so the
simulator (``tests/sim``) and property tests drive it exactly as the driver does.
Policy, in full:

* **Turns in submission order.** Submitted tests wait in one queue; the first that
  cannot start (the *head*) stops the scan, so later tests never starve it. A test whose
  scope's child is still running the scope's previous test waits *behind its scope* and
  does not block the queue: other scopes' children run meanwhile.
* **Every child that can see a device holds a claim on it** from its start until it is
  gone (exited and released by NVML, or past ``settle``): children booted ahead and
  started early too. Claims go through ``_packing.Pool``: budgets within capacity and
  the per-device cap, a test alone on its devices nobody else holds.
* **No hold and wait.** An idle child (booted ahead, started early, a scope's child
  between tests) never keeps the head from its devices: when dismissing idle holders
  lets the head fit, they are dismissed. Booting ahead happens only while no test is
  blocked.
* **A scope's child runs its members in order.** A test that is not its child's next
  member gets a child of its own (the old one is dismissed once idle).
* **Nothing waits without a wake-up.** After each batch of events, if the head waits and
  no child is in a state that ends by itself (a live process or a deadline), no other
  worker holds a device, the head is reported as one that could not be run, with what
  it waited for, and the run goes on (``live.explain``).
* **Ends.** "done" replays the test; an exit before it is a crash; a timeout kills the
  child; a child that does not exit in ``exit_grace`` is killed, one that outlives its
  kill by ``kill_grace`` is given up, with a warning on its last test, and so is a
  non-zero exit after "done". On a stop nothing new starts, waiting tests are dropped,
  running tests are stopped and idle children dismissed (their teardown runs). An
  interrupt's ``Interrupt`` comes after every action of its batch, so a test that
  finished in the same turn is still replayed.
"""

from __future__ import annotations

from collections.abc import Iterable

from spawnrun import _packing
from spawnrun.dispatch import events as ev
from spawnrun.dispatch import live
from spawnrun.dispatch.events import Kind
from spawnrun.dispatch.events import Outcome
from spawnrun.dispatch.state import Entry
from spawnrun.dispatch.state import Phase
from spawnrun.dispatch.state import Run
from spawnrun.dispatch.units import IDLE
from spawnrun.dispatch.units import Child
from spawnrun.dispatch.units import State

Placed = str  # "started", "behind", "blocked", "ended"


class Dispatcher(Run):
    def handle(self, *events: ev.Event) -> list[ev.Action]:
        """Take a batch of events (those of one loop turn) and return what follows.

        Only what the events end or kill: the driver replays those reports (which may
        stop the session: ``Stop``) before it asks ``step`` what to start next.
        """
        self.out, interrupts = [], []
        for event in events:
            self.now = max(self.now, event.now)
            if isinstance(event, ev.Done) and event.interrupt:
                interrupts.append(ev.Interrupt(event.test))
            self._on(event)
        out, self.out = self.out, []
        return out + interrupts

    def step(self) -> list[ev.Action]:
        """The decisions: what starts, runs, is dismissed, or is reported stuck now."""
        self.out = []
        self._schedule()
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
        elif isinstance(event, ev.Stop):
            self._stop(event.reason)
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

    def _child_event(self, event: ev.Event) -> None:
        child = self.children.get(getattr(event, "child", -1))
        if child is None or child.state is State.GONE:
            return  # a late message of a child given up
        if isinstance(event, ev.Booted):
            if child.state is State.STARTING:
                child.move(State.READY, self.now)
                entry = self.tests.get(child.test) if child.test else None
                if entry is not None and entry.phase is Phase.STARTED:
                    self.go(child, entry)  # started at its turn: it runs at once
        elif isinstance(event, ev.StartFailed):
            self._lost_before_test(child, event.error)
            if child.state is not State.SETTLING:
                child.move(State.SETTLING, self.now)
            self.settled(child)
        elif isinstance(event, ev.Refused):
            self.refused[child.key] = event.why
            self.dismiss(child)
        elif isinstance(event, ev.Done):
            self._done(child, event)
        elif isinstance(event, ev.Exited):
            self._exited(child, event.code)
        elif isinstance(event, ev.Released) and child.state is State.SETTLING:
            self.settled(child)

    def _done(self, child: Child, event: ev.Done) -> None:
        if child.state is not State.RUNNING or child.test != event.test:
            return  # it was stopped or timed out meanwhile: that report stands
        entry = self.tests[event.test]
        self.end(entry, ev.Replay(event.test))
        child.last, child.test = event.test, ""
        child.tests_run += 1
        if child.members and child.members[0] == event.test:
            child.members.pop(0)
        more = bool(child.scope) and bool(child.members)
        if more and not event.poisoned and not self.stopping:
            child.move(State.BETWEEN, self.now)
            return
        child.move(State.EXITING, self.now, self.now + self.settings.exit_grace)
        if more:
            self.emit(ev.Dismiss(child.id))  # it would wait for the scope's next test

    def _exited(self, child: Child, code: int) -> None:
        state = child.state
        if state is State.RUNNING:
            entry = self.tests[child.test]
            detail = f"its child exited with status {code} before reporting"
            self.end(entry, ev.Report(child.test, Outcome.CRASHED, detail))
        elif state in (State.STARTING, State.READY):
            self._lost_before_test(child, f"its child exited with status {code} before it booted")
        elif state is State.EXITING and code != 0 and child.last:
            self.warn(child.last, f"its child exited with status {code} after the test")
        child.test = ""
        if child.devices:
            child.move(State.SETTLING, self.now, self.now + self.settings.settle)
        else:
            child.move(State.SETTLING, self.now)
            self.settled(child)

    def _lost_before_test(self, child: Child, why: str) -> None:
        """A child died before it ran its test: the test gets that as its report."""
        if child.kind is Kind.TEMPLATE:
            self.refused.setdefault(child.key, why)
        entry = self.tests.get(child.test) if child.test else None
        if entry is None:
            return
        if entry.phase is Phase.KNOWN:
            entry.failed_ahead = why  # booted ahead: reported at its turn
        elif entry.phase is Phase.STARTED:
            self.end(entry, ev.Report(entry.test.id, Outcome.START_FAILED, why))
        child.test = ""

    def _deadlines(self) -> None:
        s = self.settings
        for child in list(self.live_or_settling()):
            if child.deadline is None or child.deadline > self.now:
                continue
            if child.state is State.RUNNING:
                entry = self.tests[child.test]
                self.emit(ev.Kill(child.id, "timeout"))
                timeout = entry.test.timeout
                self.end(entry, ev.Report(entry.test.id, Outcome.TIMEOUT, f"after {timeout}s"))
                child.last, child.test = entry.test.id, ""
                child.move(State.KILLED, self.now, self.now + s.kill_grace)
            elif child.state is State.EXITING:
                self.emit(ev.Kill(child.id, f"did not exit within {s.exit_grace:g}s"))
                if child.last and child.kind is not Kind.TEMPLATE:
                    why = f"its child did not exit within {s.exit_grace:g}s of the test: killed"
                    self.warn(child.last, why + " (a thread or an atexit handler kept it)")
                child.move(State.KILLED, self.now, self.now + s.kill_grace)
            elif child.state is State.KILLED:
                self.lost += 1
                if child.last:
                    self.warn(child.last, "its child could not be killed; its devices were freed")
                child.move(State.GONE, self.now)
                self.give_back(child)
            elif child.state is State.SETTLING:
                self.settled(child)
        for tid in self.queue:
            entry = self.tests[tid]
            if not entry.warned and self.now - entry.submitted >= s.patience:
                entry.warned = True
                self.warn(tid, f"waited {s.patience:g}s to start: {live.explain(self, tid)}")

    def _stop(self, reason: str) -> None:
        if self.stopping:
            return
        self.stopping = reason
        for tid in self.queue:
            self.end(self.tests[tid], ev.Drop(tid))
        self.queue = []
        for child in self.live_children():
            entry = self.tests.get(child.test) if child.test else None
            if child.state is State.RUNNING and entry is not None:
                self.emit(ev.Kill(child.id, "the session stopped"))
                self.end(entry, ev.Report(child.test, Outcome.STOPPED, reason))
                child.last, child.test = child.test, ""
                child.move(State.KILLED, self.now, self.now + self.settings.kill_grace)
            elif child.state in (State.STARTING, State.READY, State.BETWEEN):
                if entry is not None and entry.phase is Phase.STARTED:
                    self.end(entry, ev.Drop(child.test))
                child.test = ""
                self.dismiss(child)

    def _dismiss_unneeded(self) -> None:
        """Idle children whose next test cannot come any more are dismissed."""
        for child in self.live_children():
            if child.state not in (*IDLE, State.STARTING) or child.kind is Kind.FORK:
                continue
            child.members = [m for m in child.members if self._may_come(m, child)]
            if child.kind is Kind.TEMPLATE:
                wanted = not self.last or any(
                    self.tests[t].test.template == child.key for t in self.queue
                )
            elif child.test:
                entry = self.tests[child.test]
                mine = entry.phase is Phase.STARTED and entry.child == child.id
                wanted = (
                    mine
                    or entry.phase is Phase.WAITING
                    or (entry.phase is Phase.KNOWN and not self.last)
                )
            elif child.state is State.BETWEEN:
                wanted = bool(child.members) and (not self.last or child.members[0] in self.queue)
            else:  # started early, not taken yet
                wanted = not self.last
            if not wanted:
                child.test = ""
                self.dismiss(child)

    def _may_come(self, test: str, child: Child) -> bool:
        entry = self.tests[test]
        if entry.phase in (Phase.KNOWN, Phase.WAITING):
            return True
        return entry.phase is Phase.STARTED and entry.child == child.id

    # Decisions -----------------------------------------------------------------------

    def _schedule(self) -> None:
        self._dismiss_unneeded()
        for _ in range(len(self.queue) + 1):
            blocked = self._scan()
            if blocked is None:
                self._boot_ahead()
                return
            if live.can_move(self, blocked):
                return
            entry = self.tests[blocked]
            self.queue.remove(blocked)
            self.stuck += 1
            self.end(entry, ev.Report(blocked, Outcome.STUCK, live.dump(self, blocked)))

    def _scan(self) -> str | None:
        """Start what may start now, in order; the id of the head if it is blocked."""
        if self.stopping:
            return None
        for tid in list(self.queue):
            placed = self._place(self.tests[tid])
            if placed in ("started", "ended"):
                if tid in self.queue:
                    self.queue.remove(tid)
            elif placed == "blocked":
                self._preempt(self.tests[tid].test)
                return tid
        return None

    def _place(self, entry: Entry) -> Placed:
        test = entry.test
        scope_child = self.scope_child(test.scope) if test.scope else None
        if scope_child is not None:
            if scope_child.members[:1] == [test.id] and scope_child.state is not State.RUNNING:
                return self._go(entry, scope_child)
            if scope_child.state not in IDLE:
                return "behind"  # its child boots for or runs the scope's previous test
            self.dismiss(scope_child)  # out of the scope's order: a child of its own
        own = self.child_for(test)
        if own is not None:
            return self._go(entry, own)
        if test.template and test.template not in self.refused:
            return self._fork(entry)
        if self.in_slot() >= self.settings.jobs:
            return "blocked"
        devices = self.choose(test)
        if devices is None:
            return "blocked"
        kind = Kind.SCOPE if test.scope else Kind.SPAWN
        child = self.start(kind, devices, test.need, test, members=self.members(test))
        entry.phase, entry.child = Phase.STARTED, child.id
        return "started"

    def _go(self, entry: Entry, child: Child) -> Placed:
        if entry.phase is not Phase.STARTED:
            if self.in_slot() >= self.settings.jobs:
                return "blocked"
            entry.phase, entry.child = Phase.STARTED, child.id
            child.test = entry.test.id
        if child.state in IDLE:
            self.go(child, entry)
            return "started"
        return "started" if child.state is State.STARTING else "blocked"

    def _fork(self, entry: Entry) -> Placed:
        test = entry.test
        template = self.templates.get(test.template)
        if template is None or not template.alive or template.state is State.EXITING:
            self.templates[test.template] = self.start(Kind.TEMPLATE, (), None, key=test.template)
            return "blocked"
        if template.state is not State.READY:
            return "blocked"
        if self.in_slot() >= self.settings.jobs:
            return "blocked"
        devices = self.choose(test)
        if devices is None:
            return "blocked"
        child = self.start(Kind.FORK, devices, test.need, test, parent=template.id)
        entry.phase, entry.child = Phase.STARTED, child.id
        return "started"

    def _preempt(self, head: ev.Test) -> None:
        """Dismiss the idle children whose claims keep the head from devices it could have."""
        idle = [c for c in self.live_children() if self.idle_holder(c, head)]
        if not idle:
            return
        devices = self.choose(head, without={c.id for c in idle})
        if devices is None:
            return
        for child in idle:
            if set(child.devices) & set(devices):
                child.test = ""
                self.dismiss(child)

    def _boot_ahead(self) -> None:
        if not self.settings.lookahead or self.stopping:
            return
        window = self.upcoming(self.settings.lookahead)
        ahead = sum(1 for c in self.live_children() if self.is_ahead(c))
        for test in window:
            if ahead >= self.settings.lookahead:
                return
            if test.template and test.template not in self.refused:
                if test.template not in self.templates:
                    self.templates[test.template] = self.start(
                        Kind.TEMPLATE, (), None, key=test.template
                    )
                continue
            if self.child_for(test) is not None or self.tests[test.id].failed_ahead:
                continue
            if test.scope and not self.first_of_scope(test):
                continue
            devices = self.choose(test)
            if devices is None:
                continue
            kind = Kind.SCOPE if test.scope else Kind.SPAWN
            self.start(kind, devices, test.need, test, members=self.members(test))
            ahead += 1


def replays(actions: Iterable[ev.Action]) -> list[str]:
    """The tests whose own reports the actions replay (a helper for drivers and tests)."""
    return [a.test for a in actions if isinstance(a, ev.Replay)]


__all__ = ["Dispatcher", "replays", "_packing"]
