"""How a test's child stops being the test's: its "done", its death, its timeout.

Runs in the parent. ``JobEnds`` is the part of a test's ``_jobs.Job`` that ends its
test: the reports complete (handing the child to an ``_ending.Ending``, or to the
scope's next test), a death judged once its exit code is known, a timeout's stack dump
before the kill, and a crash rerun under pytest-rerunfailures in a fresh child.
"""

from __future__ import annotations

import signal
import time

import pytest

from spawnrun.driver import _ending
from spawnrun.driver import _jobrecord
from spawnrun.driver import _poison
from spawnrun.driver import _treememory
from spawnrun.driver._jobrecord import JobRecord
from spawnrun.driver._jobrecord import State
from spawnrun.launch import _runner
from spawnrun.wire import _reports
from spawnrun.wire._reports import CPU_LOAD_PROPERTY
from spawnrun.wire._reports import WALL_PROPERTY

#: How long faulthandler gets to write the stacks of a timed-out child.
DUMP_LIMIT = 2.0
#: After a child's pipe ended, how long it gets to be seen exiting (its exit code tells
#: how it died) before it counts as alive without its pipe and is killed.
PIPE_GRACE = 1.0


class JobEnds(JobRecord):
    """A test's record, with the transitions that end its test (``_jobs.Job``'s base)."""

    def _ended(self, handover: bool = False, done: bool = False) -> None:
        """The test is over and its reports complete; the process may still be exiting.

        ``handover``: the child waits for the scope's next test, unless this test's
        failure says the process is broken (``_poison``): then it ends, and says why.
        """
        if self.went:
            # From the go to "done", at least what pytest timed of the phases.
            timed = sum(r.duration for r in self.replay.reports)
            wall = max(time.monotonic() - self.went, timed)
            self.replay.properties.append((WALL_PROPERTY, round(wall, 4)))
        if self.boot_seconds is not None:
            self.replay.properties.append(("spawnrun_boot_s", round(self.boot_seconds, 3)))
        if self.cpu_load is not None:
            self.replay.properties.append((CPU_LOAD_PROPERTY, round(self.cpu_load, 2)))
        if self.peak_device_bytes is not None:
            mib = round(self.peak_device_bytes / 2**20, 1)
            self.replay.properties.append(("spawnrun_peak_gpu_mib", mib))
        child = self.child
        assert child is not None
        if handover and not self.template_pid:  # a fork leaves its template as it was
            self.replaced = _poison.verdict(self.replay.reports, self.poison)
            if not self.replaced and self.replace_above is not None:
                self.replaced = self._holds_too_much()
            if self.replaced:
                text = (
                    f"child replaced: {self.replaced}; the scope's next test runs in a fresh child"
                )
                self.replay.note_failure(_reports.REPLACED_TITLE, text)
        if child.gone or child.exitcode is not None:
            code = child.exitcode
            # Gone already (a loaded parent reads "done" late): what it said after "done"
            # (what it left running, its session's end) is still in the pipe.
            last = [] if child.gone else child.messages()
            child.reaped()
            self._leave(_ending.Stage.REAPING)
            if self.ending is not None:
                for msg in last:
                    self.ending.on_message(msg)
            if done and code and self.ending is not None:
                self.ending.bad_exit = code  # gone already, with a status, after "done"
        elif handover and not self.replaced:
            self._leave(_ending.Stage.HANDOVER)
        else:
            if handover:
                child.stop()
            self._leave(_ending.Stage.EXITING)
        if self.ending is not None:
            self.ending.after_done = done

    def _leave(self, stage: _ending.Stage) -> None:
        """The test is over: its child, with the devices it holds, is the ending's now."""
        child = self.child
        assert child is not None
        self.ending = _ending.Ending(
            self.item,
            child,
            stage,
            scope=self.plan.scope,
            devices=self.devices,
            claimed=self.claimed,
            held=self.held,
            token=self.token,
            settle=self.settle,
            pids=set(self.pids),
            left_behind=list(self.left_behind),
            forked_pid=self.forked_pid,
            reaped=self.reaped_count,
        )
        self.reaped_count = 0  # the ending counts them from now on
        self.child, self.held = None, []
        self.state, self.deadline = State.DONE, None

    def _holds_too_much(self) -> str:
        """Why the child holds too much device memory to go on ("" if it does not)."""
        assert self.child is not None and self.replace_above is not None
        return _treememory.holds_too_much(
            self.claimed, self.pids, self.child.pid, self.held_after, self.replace_above
        )

    def _others(self) -> list[int]:
        """The processes of the child's group other than it and its test's fork."""
        assert self.child is not None
        return [p for p in self.child.others() if p != self.forked_pid]

    def _pipe_ended(self, problem: str) -> None:
        """The child's pipe ended (or cannot be read on) before the test's end."""
        if self.pipe_ended is None:
            self.pipe_ended = time.monotonic()
        self.pipe_problem = self.pipe_problem or problem
        if self.child is not None:
            self.child.close_pipe()
        self._judge_death(time.monotonic())

    def _judge_death(self, now: float) -> None:
        """Report the death once its exit code is known, or end a child that lives on.

        Its pipe ends as the process exits, a little before the exit itself can be seen:
        the code comes within ``PIPE_GRACE``, a deadline in the loop. A child still
        running then (it closed its pipe) or whose messages cannot be read is killed.
        """
        child = self.child
        assert child is not None and self.pipe_ended is not None
        code = child.exitcode
        if code is not None and not self.pipe_problem:
            self._died(code)
            return
        if not self.pipe_problem and now - self.pipe_ended < PIPE_GRACE:
            self.deadline = now + _jobrecord.POLL
            return
        cause = ""
        if self.pipe_problem:
            cause = f"{_reports.UNREADABLE} ({self.pipe_problem}); it was killed"
        elif child.running():
            cause = _reports.PIPE_CLOSED
        if cause:
            child.kill()
        self._died(code, cause)

    def _died(self, code: int | None, cause: str = "") -> None:
        child = self.child
        assert child is not None
        if self.state is State.DUMPING:
            # Asked for its stacks, it died of the asking (faulthandler was not armed yet,
            # early in its boot): it timed out, and is judged so.
            self._poll_dump(time.monotonic(), force=True)
            return
        phase = self.replay.pending_phase() if self.state is State.RUNNING else "setup"
        self.left_behind = self._others()
        _runner.signal_pids(self.left_behind, signal.SIGKILL)
        self.reaped_count += len(self.left_behind)
        text = _reports.death_text(self.item.nodeid, phase, code, cause)
        self.crashes += 1
        self.replay.died(phase, text, _reports.evidence(child.spec, len(self.left_behind)))
        if not self._rerun():
            self._ended()

    def _start_dump(self) -> None:
        """Timed out: ask faulthandler in the child for every thread's stack."""
        assert self.child is not None
        if self.state is State.RUNNING:
            self.phase_at_timeout, self.limit = self.replay.pending_phase(), self.timeout
        elif self.timeout is not None and self.timeout >= _jobrecord.BOOT_LIMIT:
            self.phase_at_timeout, self.limit = "setup (while the child booted)", self.timeout
        else:
            self.phase_at_timeout = "setup (while the child booted: spawnrun's boot limit)"
            self.limit = _jobrecord.BOOT_LIMIT
        self.stacks_size = _reports.size_of(self.child.spec.stacks_path)
        self.below = self.child.dump_stacks(skip=self.forked_pid)
        self.below_sizes = []
        self._to(State.DUMPING)

    def _poll_dump(self, now: float, force: bool = False) -> None:
        assert self.child is not None
        size = _reports.size_of(self.child.spec.stacks_path)
        # Each asked process's stacks file is written once, unchanged since the last look.
        below = [_reports.size_of(path) for _, _, _, path in self.below if path]
        written = size > self.stacks_size and size == self.last_size
        written = written and all(below) and below == self.below_sizes
        self.last_size, self.below_sizes = size, below
        if not force and not written and now - self.since < DUMP_LIMIT:
            self.deadline = now + 2 * _jobrecord.POLL
            return
        self.left_behind = self._others()
        self.reaped_count += len(self.left_behind)
        self.child.kill()
        phase = self.phase_at_timeout
        text = f"{_reports.TIMEOUT} (>{self.limit or 0.0:g} s) during {phase}\nnode id: "
        text += self.item.nodeid
        evidence = _reports.evidence(self.child.spec, len(self.left_behind), self.below)
        self.timeouts += 1
        self.replay.died(phase.split(" ")[0], text, evidence)
        if not self._rerun():
            self._ended()

    def _rerun(self) -> bool:
        """A crash or timeout under pytest-rerunfailures: run the test again, if it may.

        As its own crash handling under xdist does, the death is a failure of the phase
        it happened in, rerun while the test's reruns last; a fresh child continues the
        count where this one stopped.
        """
        if not self.turned or self.interrupted is not None:
            return False
        reruns = _rerun_limit(self.item)
        executions = self.executions + max(1, self.replay.executions)
        if reruns is None or executions > reruns or not self.replay.rerun(executions - 1):
            return False
        self.replay.ensure_teardown()
        self.replay.executions = 0
        self.executions = executions
        if self.child is not None:
            self.retired.append(self.child)  # dead or killed: reaped with the others
            self.child = None
        self.reset_candidates()
        self.start()
        return True


def _rerun_limit(item: pytest.Item) -> int | None:
    """The reruns pytest-rerunfailures grants the test (None: not installed, or none)."""
    plugin = item.config.pluginmanager.get_plugin("rerunfailures")
    get = getattr(plugin, "get_reruns_count", None)
    if get is None:
        return None
    excluded = getattr(plugin, "_is_rerun_path_excluded", None)
    try:
        if excluded is not None and excluded(item):
            return None
        count = get(item)
        return None if count is None else int(count)
    except Exception:  # noqa: BLE001 - a foreign plugin's trouble must not end the run
        return None
