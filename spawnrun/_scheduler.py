"""Run spawned tests on their devices, several at a time, from one event loop.

Runs in the parent. Policy, in full:

* **Devices are fixed when a child starts.** A child booted ahead of its turn is planned
  onto the devices with the fewest tests running or planned (ties: the lower index) and
  starts with that ``CUDA_VISIBLE_DEVICES``; a child started at its turn takes the first
  free devices. No child is ever told its devices later.
* **Turns come in collection order.** A spawned test's turn comes when pytest reaches
  it; it then waits for a slot (``--spawn-jobs``) and its devices, while the children
  already running go on. Later tests wait behind it, so a large request is never starved
  by small ones (devices may idle meanwhile: group multi-GPU tests).
* **A planned device that stays busy is given up.** When a booted-ahead test's devices
  are still busy at its turn, it waits for them; but once other devices have been idle
  about as long as a fresh boot takes (the median boot seen so far), its child is
  replaced by one started on those ("replanned", counted in the summary), so a long
  test on one device never idles the others for long.
* **Exit is off the critical path.** A test's reports are replayed as soon as its child
  says "done"; its exit, the reaping of what it left behind and the wait for NVML to
  release its device memory are deadlines in the loop, and only the next test on the
  same devices waits for them.
* In-process tests run in the main process between turns; children carry on meanwhile.
  At the last test every child's reports are waited for, so the exit status counts them.
  On ``-x``/``--maxfail`` nothing more starts; running children are killed and their
  tests reported as skipped with the reason.
* Under pytest-xdist each worker runs one child at a time and the workers share the
  devices through a file ledger (``_devices.Ledger``).

The loop (``loop_once``) waits on every child's pipe and exit, the zygote's pipe and the
nearest deadline at once, then calls one small handler per event (``_jobs.Job``); no
handler waits for a process, so a child stuck in its exit never delays another child's
timeout.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.connection import wait
from typing import Any

import pytest

from spawnrun import _devices
from spawnrun import _early
from spawnrun import _forkserver
from spawnrun import _packing
from spawnrun import _replay
from spawnrun import _reports
from spawnrun import _runner
from spawnrun import _status
from spawnrun._ending import EXIT_KILL
from spawnrun._ending import Ending
from spawnrun._ending import Stage
from spawnrun._jobs import IN_SLOT
from spawnrun._jobs import LISTENING
from spawnrun._jobs import Job
from spawnrun._jobs import State
from spawnrun._reports import NOT_A_TEMPLATE
from spawnrun._reports import REPLACED_TITLE

STOPPED = (
    "spawnrun: stopped while running, because the session stopped (-x, --maxfail or an interrupt)"
)
LEAKED = "a scheduling bug: please report it"
#: The next spawned tests, with what each needs.
Upcoming = Sequence[tuple[pytest.Item, _packing.Plan]]
#: How often a test waiting for devices held by another xdist worker looks again.
_LEDGER_POLL = 0.05
#: Assumed boot time before any child has booted (seconds).
_DEFAULT_BOOT = 2.0


class Scheduler:
    def __init__(
        self,
        allocator: _devices.Allocator,
        limit: int,
        settle: float | None,
        lookahead: int = 0,
        zygote: _forkserver.ZygoteHolder | None = None,
    ) -> None:
        self.allocator = allocator
        self.limit = limit
        self.settle = settle
        self.lookahead = lookahead
        self.zygote = zygote
        #: Every job not yet done, in the order they were created.
        self.jobs: list[Job] = []
        #: The children of tests that are done, until they are gone (each with its
        #: test's job, counted then).
        self.endings: dict[Ending, Job] = {}
        #: Jobs booted ahead of their turn, by node id.
        self.ahead: dict[str, Job] = {}
        #: Children no job needs any more (killed), until they are gone.
        self.graveyard: list[_runner.ChildProcess] = []
        #: (node id, seconds) of waits for device memory longer than a second.
        self.long_settles: list[tuple[str, float]] = []
        self.boot_times: list[float] = []
        self.replans = 0
        #: Claims found with no holder and given back (a bug, told in the summary).
        self.leaks = 0
        #: For the run summary (jobs that finished): tests, children, ends, memory.
        self.isolated = 0
        self.children = 0
        self.crashes = 0
        self.timeouts = 0
        self.reaped = 0
        self.peaks: list[tuple[int, str, list[str]]] = []
        #: Tests on devices: how many shared one, had a budget but ran alone, or ran
        #: alone (node ids by reason).
        self.shared = 0
        self.budget_alone = 0
        self.alone: dict[str, list[str]] = {}
        #: Since when each device has been seen free (for the replan rule).
        self.free_since: dict[str, float] = {}
        #: What the terminal shows of the running tests (set by the plugin).
        self.status: _status.Status | None = None
        #: The tests that were running when the run was interrupted.
        self.interrupted: list[_status.Running] = []
        #: The spawned tests of each scope that shares a child, in order (set at
        #: collection), and the job that has (or last had) the scope's child.
        self.members: dict[str, list[str]] = {}
        self.scope_job: dict[str, Job] = {}
        #: Failures after which a scope's child is replaced (``_poison``).
        self.poison: list[re.Pattern[str]] = []
        #: A scope's child holding more device memory than this after a test is replaced.
        self.replace_above: int | None = None
        #: Scope children replaced after a test said the process is broken.
        self.replaced = 0
        #: Templates that may not fork their file's tests (scope -> why), and the
        #: pids of those that did, and how many tests ran in their forks.
        self.refusals: dict[str, str] = {}
        self.templates: set[int] = set()
        self.forks = 0
        #: Tests of a scope whose child still runs the scope's previous test, in order:
        #: pytest goes on meanwhile, so other scopes' tests may run side by side.
        self.queued: list[Job] = []
        #: Children started while the parent collected, for the first tests of their
        #: files (off unless the plugin sets its limit).
        self.early = _early.Early(0)

    # Turns ---------------------------------------------------------------------------

    def submit(
        self,
        item: pytest.Item,
        nextitem: pytest.Item | None,
        plan: _packing.Plan,
        upcoming: Upcoming = (),
    ) -> None:
        """pytest reached ``item``: start it as soon as a slot and its devices allow.

        ``upcoming`` (the next spawned tests) boot ahead meanwhile, also while this one
        waits for its devices.
        """
        parent_error = _replay.parent_teardown(item, nextitem)
        self._dismiss_idle(keep=plan.scope)
        job = self.ahead.pop(item.nodeid, None)
        if job is None:
            job = self._job(item, plan, [])
            self.jobs.append(job)
        job.timeout = plan.timeout
        job.turn(parent_error)
        if self.limit == 1:
            job.replay.start()  # one at a time: its line shows while it runs, as in-process
        if job.reported:
            # Its child died while booting ahead: that is the test's report.
            if job not in self.jobs and job.ending not in self.endings:
                # It finished before its turn, and was counted without it: count it now.
                self._count_test(job)
            job.replayed = True
            self._replay(job)
            return
        if self._queue(job):
            self.prefetch(upcoming)
            return
        with self._waiting():
            self._wait_for_turn(job, item, upcoming)

    def _queue(self, job: Job) -> bool:
        """Queue a scope's next test while its child runs the one before (True: queued).

        Its turn comes when the child is handed over (``_pump``), in the scope's order;
        pytest goes on to the next tests meanwhile, so that another scope's child can run
        beside it where slots and devices allow. One test at a time, nothing waits.
        """
        scope = job.plan.scope
        if self.limit == 1 or not scope:
            return False
        if not any(q.plan.scope == scope for q in self.queued):
            donor = self.scope_job.get(scope)
            if donor is None or donor is job or donor not in self.jobs:
                return False
            if not (donor.turned and donor.state in LISTENING):
                return False
        self.queued.append(job)
        return True

    def _pump(self) -> None:
        """Start the queued tests whose scope's child is free now, each scope in order."""
        blocked = set()
        for job in list(self.queued):
            scope = job.plan.scope
            if scope in blocked:
                continue
            session = job.item.session
            if session.shouldfail or session.shouldstop:
                self.queued.remove(job)
                self._drop(job)
            elif self._try_go(job):
                self.queued.remove(job)
            else:
                blocked.add(scope)

    def _wait_for_turn(self, job: Job, item: pytest.Item, upcoming: Upcoming) -> None:
        while True:
            session = item.session
            if session.shouldfail or session.shouldstop:
                self._drop(job)  # as pytest: nothing new starts once the session stops
                return
            self._pump()  # the queued tests came first
            # A scope's child idle between tests must not hold devices this test waits
            # for while pytest cannot reach that scope's next test (hold and wait).
            self._dismiss_idle(keep=job.plan.scope)
            went = self._try_go(job)
            # Plan the next tests once this one holds its devices, and keep them
            # booting while it waits.
            self.prefetch(upcoming)
            if went:
                return
            if self._nothing_can_move():
                if self._reclaim_leaks():
                    continue
                self._stuck(job)
                return
            timeout = None
            if job.devices and self.free_since:
                # Wake when a free device will have idled long enough for a replan.
                oldest = min(self.free_since.values())
                timeout = max(0.01, oldest + self._expected_boot() - time.monotonic())
            if not self._in_slots():
                # Nothing of ours runs: the devices are held by another xdist worker.
                timeout = min(_LEDGER_POLL, timeout or _LEDGER_POLL)
            self.loop_once(_sooner(timeout, self._redraw()))

    def _holders(self) -> list[Job | Ending]:
        """Everything of ours that may hold devices: tests in flight, children ending."""
        return [*self.jobs, *self.endings]

    def _nothing_can_move(self) -> bool:
        """No process of ours, deadline or other worker's claim can free what a test waits for."""
        holders = self._holders()
        if any(h.deadline is not None for h in holders):
            return False  # a deadline moves it on (a reap, a settle, a timeout)
        # A live child moves on by itself unless it is idle: booted ahead and waiting
        # for its turn, or between a scope's tests.
        idle = {State.WAITING, Stage.HANDOVER}
        if any(h.child is not None and not h.child.gone and _stage(h) not in idle for h in holders):
            return False
        if self.graveyard or self.queued:
            return False
        tokens = self.allocator.tokens()
        if tokens is None:
            return False  # the ledger is out of reach: look again soon
        return all(_devices.owned_here(t) for t in tokens)  # no other worker's claim

    def _reclaim_leaks(self) -> bool:
        """Give back claims of ours that no test or child holds (True: there were some).

        Only asked when nothing of ours runs: such a claim can never be given back
        otherwise, and every later test on its devices would wait for it.
        """
        holders = self._holders()
        held = {h.token for h in holders if h.held}
        leaked = {t for t in self.allocator.tokens() or () if _devices.owned_here(t)} - held
        for token in leaked:
            self.allocator.give_back(list(self.allocator.ids), token)
        self.leaks += len(leaked)
        return bool(leaked)

    def _stuck(self, job: Job) -> None:
        """Nothing will ever let ``job`` start: it fails, saying so, and the run goes on."""
        holders = self._holders()
        held = {d: type(h).__name__ for h in holders for d in h.held}
        text = (
            f"{_reports.STUCK}: it waited for {job.plan.count} device(s) and nothing that "
            f"runs could free them (held: {held or 'nothing'})\nnode id: {job.item.nodeid}"
        )
        job.replay.fail("setup", text)
        job.replay.ensure_teardown()
        job.state, job.deadline = State.DONE, None
        self._after_events()

    def _job(self, item: pytest.Item, plan: _packing.Plan, devices: list[str]) -> Job:
        if plan.scope in self.refusals:
            plan = replace(plan, scope="")  # its template may not fork: a child of its own
        members = self.members.get(plan.scope, []) if plan.scope else []
        then = members[members.index(item.nodeid) + 1 :] if item.nodeid in members else []
        return Job(
            item,
            plan,
            devices,
            self.settle,
            self.allocator.capacity,
            then,
            self.poison,
            self.replace_above,
            self.refusals,
            self.early,
        )

    def _dismiss_idle(self, keep: str = "") -> None:
        """Children waiting between tests of a scope other than ``keep`` get no more."""
        queued = {q.plan.scope for q in self.queued}
        for ending in self.endings:
            if ending.stage is Stage.HANDOVER and ending.scope not in (keep, *queued):
                ending.dismiss()

    def _adopt(self, job: Job) -> bool | None:
        """A scope's next test: its child is ours once the previous test is done.

        True: adopted; False: wait (the previous test still runs); None: no child to
        adopt (the first of its scope, or the last one ended), start one.
        """
        donor = self.scope_job.get(job.plan.scope)
        if donor is None or donor is job:
            return None
        if donor in self.jobs and donor.state in LISTENING and donor.turned:
            return False
        ending = donor.ending
        if ending is None or ending not in self.endings or not ending.waiting:
            return None
        if job.child is not None:  # booted ahead after all: not needed
            job.retire_child()
            self.graveyard.extend(job.take_retired())
        return job.adopt(donor) or None

    def _try_go(self, job: Job) -> bool:
        if self._in_slots() >= self.limit:
            return False
        plan = job.plan
        need = plan.need
        adopted = self._adopt(job) if plan.scope else None
        if adopted is False:
            return False
        if plan.scope:
            self.scope_job[plan.scope] = job
        if adopted:
            pass  # the child, its devices and its claims came from the previous test
        elif plan.every:
            # --spawn-gpu alone: it sees every device, so it claims every one.
            ids = list(self.allocator.ids)
            if ids and not self.allocator.take_exact(ids, need, job.token):
                return False
            job.claimed = ids
            if job.child is None:
                job.start()
        elif job.child is None:
            devices = self._take(job) if plan.count else []
            if devices is None:
                return False
            job.devices = job.claimed = devices
            job.start()
        elif job.devices:
            if self.allocator.take_exact(job.devices, need, job.token):
                job.claimed = job.devices
            else:
                idle = self._idle_devices(self._expected_boot())
                taken = None
                if len(idle) >= plan.count:
                    taken = self.allocator.take(plan.count, need, job.token, idle)
                if taken is None:
                    return False
                self._replan(job, taken)
        job.held = list(job.claimed)
        self._note_sharing(job)
        if self.limit == 1:
            job.replay.start_live()  # -s: the node id line before what the test prints
        job.go()
        return True

    def _take(self, job: Job) -> list[str] | None:
        """Devices for a job that has no child yet: the early child's, if free, first."""
        count, need = job.plan.count, job.plan.need
        early = self.early.devices_for(job.candidates[0], count) if job.candidates else None
        if early is not None:
            taken = self.allocator.take(count, need, job.token, early)
            if taken is not None:
                return taken
        return self.allocator.take(count, need, job.token)

    def collected(self, paths: set[str]) -> None:
        """The parent's collection is over: early children of other files are dismissed."""
        self.graveyard.extend(self.early.keep_only(paths))

    def _note_sharing(self, job: Job) -> None:
        """Tests that hold a device together both ran shared (for the summary)."""
        mine = set(job.held)
        for other in self.jobs:
            if other is not job and mine & set(other.held):
                other.shared = job.shared = True
        for ending, owner in self.endings.items():
            if mine & set(ending.held):  # a test's child on its way out still holds it
                owner.shared = job.shared = True

    def _replan(self, job: Job, devices: list[str]) -> None:
        """Replace a booted-ahead child planned on busy devices by one on free devices."""
        self.replans += 1
        job.retire_child()
        self.graveyard.extend(job.take_retired())
        job.devices = job.claimed = devices
        job.reset_candidates()
        job.start()

    def _idle_devices(self, at_least: float) -> list[str]:
        """Devices free for at least ``at_least`` seconds (as far as this process saw)."""
        now = time.monotonic()
        free = self.allocator.free()
        for device in list(self.free_since):
            if device not in free:
                del self.free_since[device]
        for device in free:
            self.free_since.setdefault(device, now)
        return [d for d in free if now - self.free_since[d] >= at_least]

    def _expected_boot(self) -> float:
        return statistics.median(self.boot_times) if self.boot_times else _DEFAULT_BOOT

    def _in_slots(self) -> int:
        """Children of tests whose turn came that are booting or running them."""
        return sum(1 for j in self.jobs if j.turned and j.state in IN_SLOT)

    def prefetch(self, upcoming: Upcoming) -> None:
        """Boot children for the next spawned tests, each on the devices planned for it."""
        for item, plan in upcoming[: self.lookahead]:
            if len(self.ahead) >= self.lookahead:
                return
            if item.nodeid in self.ahead or any(j.item is item for j in self.jobs):
                continue
            first = self.members.get(plan.scope, [item.nodeid])[0]
            if plan.scope and plan.scope not in self.refusals and first != item.nodeid:
                continue  # a scope's later test runs in the child of the scope's first
            job = self._job(item, plan, [])
            if plan.count and not plan.every:
                early = self.early.devices_for(job.candidates[0], plan.count)
                job.devices = early or self._plan(plan.count)
            job.start()
            self.ahead[item.nodeid] = job
            self.jobs.append(job)

    def _plan(self, count: int) -> list[str]:
        load: dict[str, int] = {}
        holders = self._holders()
        for holder in holders:
            for device in holder.devices:
                load[device] = load.get(device, 0) + 1
        ours = {d for h in holders for d in h.held}
        for device in set(self.allocator.ids) - set(self.allocator.free()) - ours:
            # Held by another xdist worker, whose next test may well be planned on it too.
            load[device] = load.get(device, 0) + 2
        return _devices.least_loaded(self.allocator.ids, load, count)

    # The loop ------------------------------------------------------------------------

    def loop_once(self, timeout: float | None) -> None:
        """Wait for the next event (a message, an exit, a deadline) and handle it."""
        if self.status is not None:
            self.status.clear()  # replays may write
        events: dict[Any, tuple[str, Any]] = {}
        for job in self.jobs:
            child = job.child
            if child is None or child.gone:
                continue
            if child.conn is not None and job.state in LISTENING:
                events[child.conn] = ("message", job)
            events[child.sentinel] = ("exit", job)
        for ending in self.endings:
            child = ending.child
            if child is None or child.gone:
                continue
            if child.conn is not None and ending.listening:
                events[child.conn] = ("last words", ending)
            events[child.sentinel] = ("gone", ending)
        self.graveyard = [dead for dead in self.graveyard if not dead.gone]
        for dead in self.graveyard:
            events[dead.sentinel] = ("grave", dead)
        for sentinel in self._watched():
            events[sentinel] = ("watched", None)  # its exit is seen by the next turn's look
        zygote = self.zygote.zygote if self.zygote is not None else None
        if zygote is not None and zygote.listening:
            events[zygote.conn] = ("zygote", zygote)
        deadlines = [j.deadline for j in self.jobs if j.deadline is not None]
        deadlines += [e.deadline for e in self.endings if e.deadline is not None]
        deadlines += self._deadlines()
        if deadlines:
            until = max(0.0, min(deadlines) - time.monotonic())
            timeout = until if timeout is None else min(timeout, until)
        ready = wait(list(events), timeout) if events else _sleep(timeout)
        for key in ready:
            kind, target = events[key]
            if kind == "zygote":
                target.drain()
        for key in ready:
            kind, target = events[key]
            if kind == "message" and target.child is not None and target.child.conn is key:
                child = target.child
                for msg in child.messages():
                    if target.child is child:
                        target.on_message(msg)
                    elif target.ending is not None and target.ending.child is child:
                        target.ending.on_message(msg)  # after "done": its session's end
                    else:
                        break  # replaced (a fallback): the rest is the old child's
            elif kind == "exit" and target.child is not None and target.child.sentinel is key:
                target.on_exit()
            elif kind == "last words" and target.child is not None and target.child.conn is key:
                for msg in target.child.messages():
                    target.on_message(msg)
            elif kind == "gone" and target.child is not None and target.child.sentinel is key:
                target.on_exit()
            elif kind == "grave":  # its pidfd: it has exited, reaping it does not wait
                target.reaped()
                self.graveyard.remove(target)
        now = time.monotonic()
        for job in list(self.jobs):
            job.on_deadline(now)
        for ending in list(self.endings):
            ending.on_deadline(now)
        self._after_events()
        if self.status is not None:
            self.status.update(self.running())

    def _watched(self) -> list[Any]:
        """More exits to wake for (the driver's children started while collecting)."""
        return []

    def _deadlines(self) -> list[float]:
        """More deadlines to wake for (the driver's dispatcher's)."""
        return []

    def _after_events(self) -> None:
        """Collect what the handlers produced: boot times, reports to replay, ends."""
        due = []
        for job in list(self.jobs):
            self.graveyard.extend(job.take_retired())
            if job.boot_seconds is not None and not job.boot_counted:
                job.boot_counted = True
                self.boot_times.append(job.boot_seconds)
            if job.turned and job.reported and not job.replayed:
                job.replayed = True
                due.append(job)
            if job.state is State.DONE:
                self._done(job)
        for ending, owner in list(self.endings.items()):
            if ending.released and ending.held:
                self._give_back(ending)  # NVML lists none of its processes any more
            if ending.stage is Stage.GONE:
                self._gone(ending, owner)
        # A test that stops the session comes last: those that ended in the same turn
        # are reported, as in-process they would have been before it.
        due.sort(key=lambda j: j.interrupted is not None)
        for job in due:
            self._replay(job)
        if self.queued:
            self._pump()

    def _done(self, job: Job) -> None:
        """A test is over: its child's ending goes on; the test is counted at its end.

        A job done before its turn stays in ``ahead``: its turn replays it.
        """
        self.jobs.remove(job)
        if job.ending is not None:
            self.endings[job.ending] = job
        else:
            self._give_back(job)  # it never had a child (it could not start): no holder
            self._count(job)

    def _gone(self, ending: Ending, job: Job) -> None:
        """A test's child is gone and its devices released: what it did is counted."""
        del self.endings[ending]
        self._give_back(ending)
        self.reaped += ending.reaped_count
        self._count(job)
        if ending.settled_after > 1.0:
            self.long_settles.append((job.item.nodeid, ending.settled_after))
        for text in ending.warnings() if job.turned else []:
            warning = _reports.warning(text, str(job.item.path), (job.item.location[1] or 0) + 1)
            _reports.record_warning(job.item.config, warning, job.item.nodeid)

    def _give_back(self, holder: Job | Ending) -> None:
        held, holder.held = holder.held, []
        if held:
            self.allocator.give_back(held, holder.token)

    def _replay(self, job: Job) -> None:
        """Replay what the child reported; re-raise its pytest.exit / KeyboardInterrupt."""
        if job.interrupted is not None:
            # As in-process: the tests pytest ran before this one end first, with their
            # reports; then this one's reports so far, and the session stops: nothing
            # else runs or reports, every other child (running, booted ahead) ends now.
            self._finish_earlier(job)
            job.replay.emit(None, interrupted=True)
            for other in list(self.jobs):
                if other is not job:
                    other.replayed = True
                    other.abort(STOPPED, report=False)
            self.ahead = {}
            _replay.raise_interrupt(job.interrupted)
        job.replay.emit(job.parent_error)

    def _finish_earlier(self, job: Job) -> None:
        """Let the tests before ``job`` in pytest's order that still run end and report.

        In-process they would have ended before ``job`` started, so their outcome does
        not depend on which child's last message the parent happened to read first.
        """
        order = {item.nodeid: i for i, item in enumerate(job.item.session.items)}
        mine = order.get(job.item.nodeid, len(order))

        def earlier() -> list[Job]:
            return [
                o
                for o in self.jobs
                if o is not job
                and o.turned
                and not o.replayed
                and o.state in LISTENING
                and order.get(o.item.nodeid, len(order)) < mine
            ]

        while earlier():
            self.loop_once(self._redraw() or 0.1)

    # Ends ----------------------------------------------------------------------------

    def last(self) -> None:
        """The session's last test was submitted: no scope's child waits for more."""
        self._dismiss_idle()
        self.drain()

    def drain(self) -> None:
        """Wait until every test whose turn came has been replayed."""
        with self._waiting():
            while any(j.turned and not j.replayed for j in self.jobs):
                self.loop_once(self._redraw())

    def running(self) -> list[_status.Running]:
        """The tests running in children now (their turn came): id, devices, time, phase."""
        now = time.monotonic()
        out = []
        for job in self.jobs:
            if job.turned and job.state in IN_SLOT:
                phase = job.replay.phase or "setup"
                if job.state is not State.RUNNING:
                    phase = job.state.value
                out.append(
                    (job.item.nodeid, list(job.devices), now - (job.went or job.started), phase)
                )
        return out

    def _waiting(self) -> contextlib.AbstractContextManager[None]:
        return self.status.wait() if self.status is not None else contextlib.nullcontext()

    def _redraw(self) -> float | None:
        return self.status.interval() if self.status is not None else None

    def _drop(self, job: Job) -> None:
        """A job that will not run after all: end its child, report nothing."""
        job.turned = False
        job.abort(STOPPED)

    def abort(self) -> None:
        """The session stops: end every child, report each running test as stopped."""
        queued, self.queued = self.queued, []
        for job in queued:
            self._drop(job)  # never started: no report, as in-process
        for job in list(self.jobs):
            if not job.turned:
                self.ahead.pop(job.item.nodeid, None)
            job.abort(STOPPED)
        for ending in self.endings:
            ending.abort()
        self._after_events()

    def finish(self, limit: float = EXIT_KILL + 5.0) -> None:
        """Session end: wait (bounded) for every child to be gone and reaped.

        A child still booted ahead or running now has no turn or report to come (the run
        loop ended early: an error, an interrupt): it is ended, not waited for.
        """
        self.queued = []
        self._dismiss_idle()
        self.graveyard.extend(self.early.close())
        for job in list(self.jobs):
            if job.state in LISTENING:
                job.replayed = True
                job.abort(STOPPED, report=False)
        self.ahead = {}
        end = time.monotonic() + limit
        while (self.jobs or self.endings or self.graveyard) and time.monotonic() < end:
            self.loop_once(min(1.0, max(0.0, end - time.monotonic())))
        self.kill_all()

    def kill_all(self) -> None:
        """Last resort (an exception is unwinding): end every child, report nothing."""
        self.graveyard.extend(self.early.close())
        for job in self.jobs:
            if job.child is not None:
                job.child.kill()
                self.graveyard.append(job.child)
            self.graveyard.extend(job.take_retired())
            self._give_back(job)
            self._count(job)  # the run summary still tells what ran
        for ending, owner in self.endings.items():
            if ending.child is not None:
                ending.child.kill()
                self.graveyard.append(ending.child)
            self._give_back(ending)
            self.reaped += ending.reaped_count
            self._count(owner)
        self.jobs, self.endings, self.ahead, self.queued = [], {}, {}, []
        end = time.monotonic() + 2.0  # for all of them together: SIGKILL is quick
        for child in self.graveyard:
            child.kill()
            child.wait_exitcode(max(0.0, end - time.monotonic()))
            child.reaped()
        self.graveyard = []

    # Summary -------------------------------------------------------------------------

    def _count(self, job: Job) -> None:
        self.children += job.children_started
        if job.template_pid and job.went:
            self.forks += 1
            self.templates.add(job.template_pid)
        if job.turned:
            self._count_test(job)
        # Else booted ahead: for a test that did not run (-x, an interrupt), or one whose
        # turn is still to come (its child died meanwhile): counted at its turn.

    def _count_test(self, job: Job) -> None:
        self.isolated += 1
        self.replaced += bool(job.replaced)
        self.crashes += job.crashes
        self.timeouts += job.timeouts
        self.reaped += job.reaped_count
        if job.claimed:
            if job.shared:
                self.shared += 1
            elif job.plan.need is not _packing.ALONE:
                self.budget_alone += 1
            else:
                self.alone.setdefault(job.plan.alone_because, []).append(job.item.nodeid)
        if job.peak_device_bytes is not None:
            self.peaks.append((job.peak_device_bytes, job.item.nodeid, job.devices))

    def _packing_lines(self, list_alone: bool, shown: int = 10) -> list[str]:
        """Which tests shared a device and which ran alone, and why."""
        if not (self.shared or self.budget_alone) and not list_alone:
            return []
        alone = sum(len(ids) for ids in self.alone.values())
        parts = [f"{self.shared} shared a GPU within their budgets"]
        if self.budget_alone:
            parts.append(f"{self.budget_alone} with a budget found no neighbour")
        reasons = ", ".join(f"{why}: {len(ids)}" for why, ids in sorted(self.alone.items()))
        if alone:
            parts.append(f"{alone} ran alone ({reasons})")
        lines = ["packing: " + "; ".join(parts)]
        if list_alone:
            for why, ids in sorted(self.alone.items()):
                more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
                lines.append(f"  alone, {why}: {', '.join(ids[:shown])}{more}")
        return lines

    def summary(self, peaks_shown: int = 10, list_alone: bool = False) -> list[str]:
        """The run summary's lines ([] when nothing was spawned)."""
        if not self.isolated:
            return []
        first = f"{_plural(self.isolated, 'test')} isolated in "
        # A template runs no test: its forks are the children that did.
        first += _plural(self.children - len(self.templates) + self.forks, "child", "children")
        if self.forks:
            first += (
                f" ({self.forks} forked from {_plural(len(self.templates), 'template')} "
                "that collected their file)"
            )
        if self.boot_times:
            times = sorted(self.boot_times)
            first += f"; boot median {statistics.median(times):.2f}s, slowest {times[-1]:.2f}s"
        if self.replans:
            first += f"; {self.replans} replanned onto other devices"
        lines = [first]
        if self.early.started:
            started = _plural(self.early.started, "child", "children")
            lines.append(f"{started} started while collecting ({self.early.taken} used)")
        ends = []
        if self.replaced:
            were = "child was" if self.replaced == 1 else "children were"
            ends.append(f"{self.replaced} scope {were} replaced after a test ({REPLACED_TITLE})")
        if self.crashes:
            ends.append(f"{self.crashes} crashed")
        if self.timeouts:
            ends.append(f"{self.timeouts} timed out")
        if self.reaped:
            were = "was" if self.reaped == 1 else "were"
            ends.append(f"{_plural(self.reaped, 'process', 'processes')} left behind {were} reaped")
        if self.leaks:
            ends.append(f"{_plural(self.leaks, 'device claim')} with no holder freed ({LEAKED})")
        if ends:
            lines.append(", ".join(ends))
        for scope, why in sorted(self.refusals.items()):
            if not why:
                continue  # the forkserver went off: its warning says why
            where = _template_files(self.members.get(scope, []))
            lines.append(f"{where}: {NOT_A_TEMPLATE}: {why}")
        lines += self._packing_lines(list_alone)
        if self.peaks:
            lines.append("peak GPU memory per test (torch's caching allocator, reserved):")
            ranked = sorted(self.peaks, key=lambda p: (-p[0], p[1]))
            for size, nodeid, devices in ranked[:peaks_shown]:
                where = f"  [gpu {','.join(devices)}]" if devices else ""
                lines.append(f"  {size / 2**20:.1f} MiB  {nodeid}{where}")
            if len(ranked) > peaks_shown:
                lines.append(f"  ... and {len(ranked) - peaks_shown} more (junitxml has all)")
        return lines


def _template_files(nodeids: list[str]) -> str:
    """The files a template collected, for the summary ("test_a.py and 2 more files")."""
    files = list(dict.fromkeys(n.split("::")[0] for n in nodeids)) or ["?"]
    more = len(files) - 1
    return files[0] + (f" and {_plural(more, 'more file')}" if more else "")


def _plural(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _stage(holder: Job | Ending) -> State | Stage:
    return holder.state if isinstance(holder, Job) else holder.stage


def _sooner(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _sleep(timeout: float | None) -> list[Any]:
    time.sleep(_LEDGER_POLL if timeout is None else timeout)
    return []
