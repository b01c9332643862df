"""How children end, and what each end means for its test: the dispatcher's event side.

Runs in the parent; pure. "done" replays the test; an exit before it is a crash (before
its boot: the child could not start, and a test booted ahead gets that at its turn); a
timeout kills the child; a child that does not exit in ``exit_grace`` is killed, and one
that outlives its kill by ``kill_grace`` is given up, with a warning on its last test, as
is a non-zero exit after "done". A stop drops what waits, stops what runs and dismisses
idle children, so that their teardown runs. A test that stops the session (``pytest.exit``)
lets the tests pytest reached before it end and report, as in-process; ``Interrupt``
follows them.
"""

from __future__ import annotations

from dataclasses import replace

from spawnrun.dispatch import events as ev
from spawnrun.dispatch import live
from spawnrun.dispatch.events import Kind
from spawnrun.dispatch.events import Outcome
from spawnrun.dispatch.queries import Queries
from spawnrun.dispatch.state import Entry
from spawnrun.dispatch.state import Phase
from spawnrun.dispatch.state import boot_key
from spawnrun.dispatch.units import IDLE
from spawnrun.dispatch.units import Child
from spawnrun.dispatch.units import State

#: States a denied child may be in already: the dispatcher dismissed or killed it in the
#: step that started it, before the driver's ledger said no.
_UNBORN = (State.EXITING, State.KILLED)


class Ends(Queries):
    def _child_event(self, event: ev.Event) -> None:
        child = self.children.get(getattr(event, "child", -1))
        if child is None or child.state is State.GONE:
            return  # a late message of a child given up
        if isinstance(event, ev.Booted):
            if child.state is State.STARTING:
                self._booted(child, event.touched)
        elif isinstance(event, ev.StartFailed):
            self._lost_before_test(child, event.error)
            if child.state is not State.SETTLING:
                child.move(State.SETTLING, self.now)
            self.settled(child)
        elif isinstance(event, ev.Denied) and child.state in (State.STARTING, *_UNBORN):
            self._denied(child)
        elif isinstance(event, ev.Refused) and child.kind is Kind.TEMPLATE:
            self.refused[child.key] = event.why
            self.dismiss(child)
        elif isinstance(event, ev.Refused):
            self.unshare(child, event.why)
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
        entry.failed = event.failed
        # A failure of a test that ran out of pytest's order (backfilled, or past a
        # gathered test) counts once it fails again after the tests before it.
        order = event.failed and entry.overtook and (not child.scope or entry.test.forked)
        again = (event.again or order) and not entry.again and not self.stopping
        if again and order:
            entry.in_order, entry.overtook = True, False
        alone = event.alone  # a rerun in its order keeps its own need
        if again and not child.scope:
            self._again(child, entry, alone)
            return
        if again and entry.test.forked:
            self._again_apart(entry, alone)  # the scope's child goes on
        else:
            self.end(entry, ev.Replay(event.test))
        if event.interrupt:
            self._interrupted(event.test)
        child.last, child.test = event.test, ""
        if child.members and child.members[0] == event.test:
            child.members.pop(0)
        more = bool(child.scope) and bool(child.members) and event.more
        goes_on = not self.stopping or bool(
            self.interrupting and set(child.members[:1]) & set(self.queue)
        )
        if more and not event.poisoned and goes_on:
            child.move(State.BETWEEN, self.now)
            return
        child.move(State.EXITING, self.now, self.now + self.settings.exit_grace)
        if more:
            self.emit(ev.Dismiss(child.id))  # it would wait for the scope's next test

    def _again(self, child: Child, entry: Entry, alone: bool = True) -> None:
        """Its test runs again in a child of its own (``alone``: with no budget); this
        one exits."""
        self._again_apart(entry, alone)
        child.last, child.test = entry.test.id, ""
        child.move(State.EXITING, self.now, self.now + self.settings.exit_grace)

    def _again_apart(self, entry: Entry, alone: bool = True) -> None:
        """The test runs again in a child of its own (``alone``: with no budget; else
        with its own need): not forked from its template, nor in its scope's child (a
        template's, which goes on with its next test)."""
        entry.again = True
        need = ev.ALONE if alone else entry.test.need
        entry.test = replace(entry.test, need=need, scope="", forked=False, template="")
        entry.phase, entry.child = Phase.WAITING, 0
        self.queue.append(entry.test.id)
        self.queue.sort(key=self.submitted.index)
        self.emit(ev.Again(entry.test.id, alone, order=entry.in_order))

    def _exited(self, child: Child, code: int) -> None:
        state = child.state
        if state is State.RUNNING:
            entry = self.tests[child.test]
            if entry.test.forked and not entry.again and not self.stopping:
                # It died in a fork of a template (a signal, a hang): the fork may be to
                # blame (state that is not fork-safe), so a spawned child decides.
                self._again_apart(entry, alone=False)
            else:
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

    def _booted(self, child: Child, touched: str) -> None:
        self._learn_boot(child, touched)
        if self.waits_for_devices(child):
            child.bound = touched == ev.DRIVER
            if touched == ev.CONTEXT:
                self._made_context(child)
                return
        child.move(State.READY, self.now)
        entry = self.tests.get(child.test) if child.test else None
        if entry is not None and entry.phase is Phase.STARTED:
            self.go(child, entry)  # started at its turn: it runs at once

    def _learn_boot(self, child: Child, touched: str) -> None:
        """What a boot of its test's file touched: later children of the file boot
        unclaimed unless it makes a context. And how long it took, for backfilling."""
        if child.test not in self.tests:
            return
        test = self.tests[child.test].test
        if child.kind in (Kind.SPAWN, Kind.SCOPE, Kind.EARLY):
            self.boots[test.file or test.id] = touched
        key = boot_key(test, child.kind is Kind.FORK)
        took = self.now - child.since
        self.boot_seconds[key] = max(took, self.boot_seconds.get(key, 0.0))

    def _made_context(self, child: Child) -> None:
        """An unclaimed boot made a context after all (its file changed since the run
        that said it did not): it is dismissed at once, as are its file's other
        unclaimed children; the file's tests get children that hold their devices."""
        child.move(State.READY, self.now)
        for other in self.live_children():
            mine = self.tests.get(other.test) if other.test else None
            if other.state in (State.STARTING, State.READY) and self.waits_for_devices(other):
                if other is child or (mine is not None and not self.deferrable(mine.test)):
                    other.test = ""
                    self.dismiss(other)

    def _denied(self, child: Child) -> None:
        """No process was started (a peer holds its devices): its test waits again, in
        its place in the queue; a test booted ahead is booted again later."""
        entry = self.tests.get(child.test) if child.test else None
        if entry is not None and entry.phase is Phase.STARTED and entry.child == child.id:
            entry.phase, entry.child = Phase.WAITING, 0
            self.queue.append(entry.test.id)
            self.queue.sort(key=self.submitted.index)
        child.test = ""
        child.move(State.GONE, self.now)
        self.give_back(child)

    def _lost_before_test(self, child: Child, why: str) -> None:
        """A child died before it ran its test: the test gets that as its report."""
        if child.kind is Kind.TEMPLATE:
            self.refused.setdefault(child.key, why)
        entry = self.tests.get(child.test) if child.test else None
        if entry is None:
            return
        if entry.phase in (Phase.KNOWN, Phase.WAITING):
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

    def _interrupted(self, test: str) -> None:
        """``test`` stopped the session (``pytest.exit``, KeyboardInterrupt): as a stop
        after it, whose running tests get no report; ``Interrupt`` comes once the tests
        reached before it have ended."""
        if not self.stopping:
            self.interrupting = test
            self._stop(f"{test} stopped the session", after=test, report=False)

    def earlier_running(self) -> bool:
        """Whether a test pytest reached before the one that stopped the session runs."""
        if not self.stopped_after:
            return False
        at = self.submitted.index(self.stopped_after)
        earlier = set(self.submitted[:at])
        waiting = (Phase.STARTED, Phase.WAITING)
        return any(e.phase in waiting for t, e in self.tests.items() if t in earlier)

    def _stop(self, reason: str, after: str = "", report: bool = True) -> None:
        """Nothing new starts. As in-process, the tests pytest reached before ``after``
        (the test whose report stopped the session) run to their end and report; every
        other waiting test is dropped, running ones are killed (reported as stopped, or
        with no report after an interrupt), idle children dismissed so their teardown
        runs. ``after`` "": nothing goes on (an interrupt of the parent)."""
        if self.stopping and not self._narrows(after):
            return
        self.stopping = self.stopping or reason
        self.stopped_after = after if after in self.submitted else ""
        if self.interrupting and self.interrupting in self._after(self.stopped_after):
            self.interrupting = ""  # pytest would not have reached the interrupting test
        later = self._after(self.stopped_after)
        for tid in [t for t in self.queue if t in later]:
            self.queue.remove(tid)
            self.end(self.tests[tid], ev.Drop(tid))
        if self.settings.ordered or self.stopped_after:
            # As in-process: pytest never reached them, so they report nothing (what
            # ended already, waiting for its turn to be told, is dropped too). After an
            # interrupt of the parent (Ctrl-C, no test stopped it), what ended is told.
            report = False
            for tid in [t for t in self.held if t in later]:
                self.held[tid] = ev.Drop(tid)
        for child in self.live_children():
            entry = self.tests.get(child.test) if child.test else None
            if entry is not None and entry.phase is Phase.ENDED:
                continue  # the test that stopped the session
            if entry is not None and entry.test.id not in later and entry.phase is Phase.STARTED:
                continue  # reached before it: it runs to its end
            if child.state is State.RUNNING and entry is not None:
                self.emit(ev.Kill(child.id, "the session stopped"))
                outcome = ev.Report(child.test, Outcome.STOPPED, reason)
                self.end(entry, outcome if report else ev.Drop(child.test))
                child.last, child.test = child.test, ""
                child.move(State.KILLED, self.now, self.now + self.settings.kill_grace)
            elif child.state in (State.STARTING, State.READY):
                if entry is not None and entry.phase is Phase.STARTED:
                    self.end(entry, ev.Drop(child.test))
                child.test = ""
                self.dismiss(child)
            elif child.state is State.BETWEEN and not set(child.members[:1]) & set(self.queue):
                self.dismiss(child)

    def _after(self, test: str) -> set[str]:
        """The tests pytest reached after ``test`` (all of them: ``test`` "")."""
        at = self.submitted.index(test) + 1 if test else 0
        return set(self.submitted[at:])

    def _narrows(self, after: str) -> bool:
        """``Settings.ordered``: a stop told after a test's interrupt stopped the session
        (``pytest.exit``), for a failure of a test before it: in-process, that failure
        stopped the session first, so the stop holds from there (the interrupting test
        was never reached). Its ``Interrupt`` is not told yet: it waits for the tests
        before it to be told."""
        if not self.settings.ordered or not self.stopped_after or after not in self.submitted:
            return False
        if self.interrupt_told:
            return False
        return self.submitted.index(after) < self.submitted.index(self.stopped_after)

    def _dismiss_unneeded(self) -> None:
        """Idle children whose next test cannot come any more are dismissed (once
        pytest submitted its last test, or the session stops: nothing new comes)."""
        closed = self.last or bool(self.stopping)
        for child in self.live_children():
            if child.state not in (*IDLE, State.STARTING) or child.kind is Kind.FORK:
                continue
            child.members = [m for m in child.members if self._may_come(m, child)]
            if child.kind is Kind.TEMPLATE:
                wanted = not closed or any(
                    self.tests[t].test.template == child.key for t in self.queue
                )
            elif child.test:
                entry = self.tests[child.test]
                mine = entry.phase is Phase.STARTED and entry.child == child.id
                wanted = (
                    mine
                    or entry.phase is Phase.WAITING
                    or (entry.phase is Phase.KNOWN and not closed)
                )
            elif child.state is State.BETWEEN:
                wanted = bool(child.members) and (not closed or child.members[0] in self.queue)
            else:  # started early, not taken yet
                wanted = not closed
            if not wanted:
                child.test = ""
                self.dismiss(child)

    def _may_come(self, test: str, child: Child) -> bool:
        entry = self.tests[test]
        if entry.phase in (Phase.KNOWN, Phase.WAITING):
            return True
        return entry.phase is Phase.STARTED and entry.child == child.id
