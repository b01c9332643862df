"""Starting tests: a test at its turn, tests backfilled past a waiting head, idle holders
preempted, children booted ahead.

Runs in the parent; pure. ``Starts`` places a test where it may run (its scope's child, a
child booted ahead or started early, a fork of its template, a child of its own, or one
that boots unclaimed while its devices are taken) and says why it waits if it cannot
(``Placed``); while the head waits for devices it backfills later tests that end before
the head could start, dismisses the idle children whose claims keep the head from its
devices, and boots children for the next tests. ``core.Dispatcher`` calls these from its
scan of the queue (the policy is told there). Imports only its siblings.
"""

from __future__ import annotations

from spawnrun.dispatch import events as ev
from spawnrun.dispatch.ends import Ends
from spawnrun.dispatch.events import Kind
from spawnrun.dispatch.events import Outcome
from spawnrun.dispatch.state import Entry
from spawnrun.dispatch.state import Phase
from spawnrun.dispatch.units import IDLE
from spawnrun.dispatch.units import Child
from spawnrun.dispatch.units import State

Placed = str  # "started", "behind", "blocked", "booting", "ended"


class Starts(Ends):
    def _held_back(self, entry: Entry) -> bool:
        """A test that waits for the tests before it (``Settings.ordered``: one of them
        failed and waits to be told; or it runs again in its order): it starts nothing
        by itself, so no gathered test before it waits for it."""
        return entry.in_order or (self.settings.ordered and self._failure_held_before(entry))

    def _failure_held_before(self, entry: Entry) -> bool:
        """Whether a test submitted before this one failed and waits to be told."""
        if not self.held:
            return False
        tid = entry.test.id  # (one pytest has not reached yet comes after them all)
        at = self.submitted.index(tid) if tid in self.submitted else len(self.submitted)
        return any(self._fails(t, a) and self.submitted.index(t) < at for t, a in self.held.items())

    def _ended_before(self, entry: Entry) -> bool:
        """Whether every test submitted before this one has ended."""
        at = self.submitted.index(entry.test.id)
        return all(self.tests[t].phase is Phase.ENDED for t in self.submitted[:at])

    def _place(self, entry: Entry) -> Placed:
        test = entry.test
        if self.settings.ordered and self._failure_held_before(entry):
            # A failure before it waits for its turn to be told, and may stop the
            # session there: in-process, pytest would not reach this test.
            return "behind"
        if entry.in_order and not self._ended_before(entry):
            # It ran out of order and failed: it runs again in its place, once the
            # tests before it have ended. It holds up nobody meanwhile (gathered tests
            # before it may wait for the tests after it).
            return "behind"
        if entry.failed_ahead:  # its child, booted while it waited for a slot, died
            self.end(entry, ev.Report(test.id, Outcome.START_FAILED, entry.failed_ahead))
            return "ended"
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
        if not self.slot_for(test):
            return "blocked"
        kind = Kind.SCOPE if test.scope else Kind.SPAWN
        devices = self.choose(test)
        if devices is None:
            if not self.deferrable(test):
                return "blocked"
            # Its devices are taken: it boots meanwhile, claiming them once it is booted.
            members = self.members(test)
            self.start(kind, self.guess(test), test.need, test, members=members, deferred=True)
            return "booting"
        child = self.start(kind, devices, test.need, test, members=self.members(test))
        entry.phase, entry.child = Phase.STARTED, child.id
        return "started"

    def _go(self, entry: Entry, child: Child) -> Placed:
        if self.waits_for_devices(child):
            # Booted unclaimed: its slot and devices are taken together, once it is
            # booted (the devices it saw, if its boot initialized the driver), or at its
            # turn while it still boots if the devices it sees are free (its boot may
            # yet touch them): from then on its boot runs under the boot limit, as any
            # child's that was started at its turn, so a boot that hangs is reported.
            if not self.slot_for(entry.test):
                return "booting" if child.state is State.STARTING else "blocked"
            starting = child.state is State.STARTING
            among = child.seen if child.bound or starting else None
            devices = self.choose(entry.test, among=among)
            if devices is None:
                return "booting" if starting else "blocked"
            self.assign(child, devices)
        if entry.phase is not Phase.STARTED:
            if not self.slot_for(entry.test):
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
        if not self.slot_for(test):
            return "blocked"
        devices = self.choose(test)
        if devices is None:
            return "blocked"
        child = self.start(Kind.FORK, devices, test.need, test, parent=template.id)
        entry.phase, entry.child = Phase.STARTED, child.id
        return "started"

    def _backfill(self, head: Entry) -> None:
        """While the head waits for devices that running tests hold, start later tests
        that fit now and, by what earlier runs measured, end before the head could start
        (EASY backfilling: the head is never delayed, as far as the records hold). pytest
        goes on past such a head, so that later tests reach the queue; where nothing is
        recorded, nothing is backfilled and pytest waits at the head as before."""
        if not self.settings.backfill or self.stopping or not self.slot_for(head.test):
            return  # (a head that waits for job slots would wait longer for those taken)
        shadow = self.shadow(head.test)
        if shadow is None or shadow <= self.now:
            return
        if len(self.queue) <= self.settings.backfill:
            head.passed = True
        for tid in self.queue[self.queue.index(head.test.id) + 1 :]:
            if self.in_slot() >= self.settings.jobs:
                return
            entry = self.tests[tid]
            ends = self.would_end(entry.test)
            if ends is None or ends > shadow or not self.fits_now(entry.test):
                continue
            if not self.slot_for(entry.test):
                continue
            placed = self._place(entry)
            entry.overtook = entry.overtook or placed == "started"
            if placed in ("started", "ended") and tid in self.queue:
                self.queue.remove(tid)
            # A test backfilled is passed too: what comes after it may reach the queue.
            entry.passed = entry.passed or len(self.queue) <= self.settings.backfill

    def _preempt(self, head: ev.Test) -> None:
        """Dismiss the idle children whose claims keep the head from devices it could have.

        Only when devices are what it waits for: a head that waits for a slot, or whose
        devices are free, would gain nothing, and booted children would be lost."""
        among = self.bound_to(head)
        if not self.slot_for(head) or self.choose(head, among=among) is not None:
            return
        idle = [c for c in self.live_children() if self.idle_holder(c, head)]
        if not idle:
            return
        devices = self.choose(head, without={c.id for c in idle}, among=among)
        if devices is None:
            return
        for child in idle:
            if set(child.devices) & set(devices):
                child.test = ""
                self.dismiss(child)

    def _boot_ahead(self, waiting: bool = False) -> None:
        """Boot children for the next tests (``waiting``: first for those pytest waits on
        for a slot), up to ``lookahead`` at once, each on devices its claim fits now."""
        if not self.settings.lookahead or self.stopping:
            return
        window = self.upcoming(self.settings.lookahead)
        if waiting:
            queued = [self.tests[t].test for t in self.queue]
            heads = {t.scope: self.scope_head(t.scope) for t in queued if t.scope}
            window = [t for t in queued if not t.scope or heads[t.scope] == t.id] + window
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
            if test.id in self.queue and self._held_back(self.tests[test.id]):
                continue  # it waits for the tests before it: its child would only hold
            if test.scope and not self.first_of_scope(test):
                continue
            kind = Kind.SCOPE if test.scope else Kind.SPAWN
            members = self.members(test)
            if self.deferrable(test):  # claims nothing until its go
                self.start(kind, self.guess(test), test.need, test, members, deferred=True)
            elif (devices := self.choose(test)) is not None:
                self.start(kind, devices, test.need, test, members=members)
            else:
                continue
            ahead += 1
