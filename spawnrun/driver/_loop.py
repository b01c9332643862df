"""The parent's event loop over real children: pipes, exits, pidfds and deadlines.

Runs in the parent. ``Loop.loop_once`` waits on every child's pipe and exit, the zygote's
pipe and the nearest deadline at once, then calls one small handler per event (the
units: ``_jobs.Job`` for a test, ``_ending.Ending`` for a child after its test); no
handler waits for a process, so a child stuck in its exit never delays another child's
timeout. It decides nothing: ``_drive.Driver`` turns what the units did into the
dispatcher's events and performs its actions.
"""

from __future__ import annotations

import contextlib
import re
import time
from multiprocessing.connection import wait
from typing import Any

from spawnrun.devices import _allocator
from spawnrun.devices import _devices
from spawnrun.driver import _early
from spawnrun.driver import _status
from spawnrun.driver._ending import Ending
from spawnrun.driver._jobrecord import IN_SLOT
from spawnrun.driver._jobrecord import LISTENING
from spawnrun.driver._jobrecord import State
from spawnrun.driver._jobs import Job
from spawnrun.driver._summary import Summary
from spawnrun.driver._treememory import SAMPLE_EVERY
from spawnrun.launch import _forkserver
from spawnrun.launch import _runner
from spawnrun.wire import _reports

#: How long the loop sleeps when it watches nothing and has no deadline.
_IDLE = 0.05


class Loop(Summary):
    def __init__(
        self,
        allocator: _allocator.Allocator,
        limit: int,
        settle: float | None,
        lookahead: int = 0,
        zygote: _forkserver.ZygoteHolder | None = None,
    ) -> None:
        super().__init__()
        self.allocator = allocator
        self.limit = limit
        self.settle = settle
        self.lookahead = lookahead
        self.zygote = zygote
        #: The jobs of tests being booted or run, in the order they were started.
        self.jobs: list[Job] = []
        #: The children of tests that are done, until they are gone (each with its
        #: test's job, counted then).
        self.endings: dict[Ending, Job] = {}
        #: Children no job needs any more (killed, dismissed), until they are gone.
        self.graveyard: list[_runner.ChildProcess] = []
        #: (node id, seconds) of waits for device memory longer than a second.
        self.long_settles: list[tuple[str, float]] = []
        #: What the terminal shows of the running tests (set by the plugin).
        self.status: _status.Status | None = None
        #: The tests that were running when the run was interrupted.
        self.interrupted: list[_status.Running] = []
        #: Failures after which a scope's child is replaced (``_poison``).
        self.poison: list[re.Pattern[str]] = []
        #: A scope's child holding more device memory than this after a test is replaced.
        self.replace_above: int | None = None
        #: Budgets are learned (``--spawn-pack auto``): a failure beside a test on a
        #: learned budget may be the guess's, and runs again alone (``Done.again``).
        self.guessing = False
        #: Templates that may not fork their file's tests (scope -> why).
        self.refusals: dict[str, str] = {}
        #: Children started while the parent collected, for the first tests of their
        #: files (off unless the plugin sets its limit).
        self.early = _early.Early(0)
        #: When the running tests' process trees are next sampled for device memory
        #: (``Job.sample_tree``; 0: none is due).
        self.next_sample = 0.0

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
        sampled = [j for j in self.jobs if j.state is State.RUNNING and j.claimed]
        if sampled and _devices.nvml_available():
            if not self.next_sample:
                self.next_sample = time.monotonic() + SAMPLE_EVERY
            deadlines.append(self.next_sample)
        else:
            self.next_sample = 0.0
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
        if self.next_sample and now >= self.next_sample:
            self.next_sample = now + SAMPLE_EVERY
            for job in self.jobs:
                if job.state is State.RUNNING:
                    job.sample_tree()
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
        """More deadlines to wake for (the dispatcher's)."""
        return []

    def _after_events(self) -> None:
        """What the handlers did, told to whoever decides (the driver)."""

    def _note_sharing(self, job: Job) -> None:
        """Tests that run on a device together both ran shared (for the summary).

        Only tests that run: a neighbour still booting holds nothing yet, and one whose
        test is over (its child exiting) no longer runs a test beside this one.
        """
        mine = set(job.held)
        for other in self.jobs:
            if other is not job and other.state is not State.DONE and mine & set(other.held):
                other.shared = job.shared = True
                other.beside_guess |= job.guessed
                job.beside_guess |= other.guessed

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
        self.jobs, self.endings = [], {}
        end = time.monotonic() + 2.0  # for all of them together: SIGKILL is quick
        for child in self.graveyard:
            child.kill()
            child.wait_exitcode(max(0.0, end - time.monotonic()))
            child.reaped()
        self.graveyard = []


def _sleep(timeout: float | None) -> list[Any]:
    time.sleep(_IDLE if timeout is None else timeout)
    return []
