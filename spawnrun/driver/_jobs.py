"""One spawned test's life in the parent, as an explicit state machine.

Runs in the parent. A ``Job`` is a test's record (``_jobrecord.JobRecord``: the child
running it and, on a fallback collection or a crash rerun, its successor, its reports,
its deadline). It reacts to three kinds of event, each in a small handler that never
blocks: a message from the child, the child's exit, and the job's next deadline. The
scheduler (``_scheduler``) waits on every job's pipe, exit and deadline at once and
calls these handlers; it decides *when* a job may start, the job decides *what* its
child's messages mean. Its states are ``_jobrecord.State``; how its test ends (done,
died, timed out, rerun) is ``_jobends``; the device memory its process tree holds is
``_treememory``'s to measure.

At DONE the child is no longer the test's: an ``_ending.Ending`` takes it, with the
devices it holds, through its exit, the reaping of what it left and the wait for its
device memory (or keeps it for the scope's next test, which takes it back). The reports
are replayed then, not when the process has exited: all of that is off the test's
critical path.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from spawnrun.child._budget import SECTION
from spawnrun.devices import _inventory
from spawnrun.devices import _packing
from spawnrun.driver import _ending
from spawnrun.driver import _replay
from spawnrun.driver import _treememory
from spawnrun.driver._jobends import JobEnds
from spawnrun.driver._jobrecord import LISTENING
from spawnrun.driver._jobrecord import State
from spawnrun.launch import _stream
from spawnrun.learn import _learned
from spawnrun.learn import _unforked
from spawnrun.wire import _identity
from spawnrun.wire import _replies
from spawnrun.wire import _reports
from spawnrun.wire._reports import BUDGET_PROPERTY
from spawnrun.wire._reports import LEARNED_PEAK


class Job(JobEnds):
    """A spawned test in flight: its child, its devices, its state, its buffered reports.

    ``devices`` are fixed when its child starts, in the child's environment from the
    first instruction on; a job booted ahead runs on the devices it was planned on or
    is started afresh on others (``replan``), never told new devices later.
    """

    def go(self) -> None:
        """Devices and a slot are ours: run now if booted, else as soon as booted."""
        self.granted = True
        if self.devices:
            self.replay.properties.append(("spawnrun_devices", ",".join(self.devices)))
            if visible := _inventory.visible(self.devices):  # e.g. the UUIDs they got
                self.replay.properties.append((_inventory.VISIBLE_PROPERTY, visible))
        if self.plan.need is not _packing.ALONE and self.claimed:
            mib = round(self.plan.need / 2**20, 1)
            self.replay.properties.append((BUDGET_PROPERTY, mib))
        if self.state is State.WAITING:
            self._send_go()
        elif self.state is State.AHEAD:
            self.state = State.BOOTING
            self._arm()

    def adopt(self, donor: Job) -> bool:
        """Take over the child of the scope's previous test, its devices and claims.

        False: its child is not waiting between tests (gone meanwhile, or replaced).
        """
        ending = donor.ending
        if ending is None:
            return False
        held = ending.held
        child = ending.take()
        if child is None:
            return False
        self.child = child
        self.previous = donor.item
        self.pids = set(ending.pids)
        self.template_pid = donor.template_pid
        self.devices, self.claimed, self.held = ending.devices, ending.claimed, held
        self.token = ending.token
        # The child's environment now: as at its start, with every go's changes since.
        self.environ = {**donor.environ, **donor.env_set}
        for name in donor.env_unset:
            self.environ.pop(name, None)
        self._env_changes()
        if self.template_pid:
            # A template's tests may differ in budget: each fork runs with its own (the
            # template takes it before forking, the fork applies it at CUDA's init).
            self._child_env_changes(donor.env())
        self.candidates = []
        self.started = time.monotonic()
        self.state = State.WAITING
        return True

    def _send_go(self) -> None:
        assert self.child is not None
        if self.previous is not None:  # adopted: the child is told which test
            nodeid, params = self.item.nodeid, _identity.bindings(self.item)
            self.child.go(self.env_set, self.env_unset, nodeid, params)
        else:
            self.child.go(self.env_set, self.env_unset)
        self.went = time.monotonic()
        self.state = State.RUNNING
        self._arm()

    # Events ------------------------------------------------------------------------

    def on_message(self, msg: _replies.Message | _stream.Died) -> None:
        if isinstance(msg, _replies.After):  # its session's end, after "done"
            if self.ending is not None:
                self.ending.on_message(msg)
            return
        if isinstance(msg, _replies.XmlAttribute):
            self.replay.xml_attributes.append((msg.name, msg.value))
            return
        if isinstance(msg, _replies.SuiteProperty):
            _replay.suite_property(self.item.config, msg.name, msg.value)
            return
        if isinstance(msg, _replies.ForkEnded):  # the template's previous fork, after its test
            self._fork_ended(msg)
            return
        if isinstance(msg, _replies.LeftRunning):  # a test's process as it left (a fork's)
            self.pids.update(msg.pids)
            _ending.warn_left_running(_ending.named(msg, self.item), msg)
            return
        if isinstance(msg, _replies.ForkedTest):  # its template forked the process to run it
            self.forked_pid = msg.pid
            self.pids.add(msg.pid)  # its device memory is waited for like the child's
            return
        if self.state not in LISTENING:
            return  # e.g. a report after a timeout's kill: the test is already judged
        replay = self.replay
        if isinstance(msg, _replies.Booted) and msg.found:
            if msg.not_a_template:
                self.refusals[self.plan.scope] = msg.not_a_template
                self.template_pid = 0  # it runs its test itself
            self.boot_seconds = time.monotonic() - self.started - msg.waited
            self.boot_touched = msg.touched
            if self.state is State.BOOTING:
                self._send_go()
            elif self.state is State.AHEAD:
                self.state = State.WAITING
        elif isinstance(msg, _replies.Booted):
            self.problems.append(msg.problem)
            if self.candidates and not msg.failed:
                self.retire_child()
                self.start()
            elif self.zygote_forked and not self.plan.unforked:
                # Not found, or its boot failed, in a fork: a spawned child decides.
                why = _unforked.NOT_FOUND_IN_FORK
                _unforked.note(self.item.config, self.item.nodeid, why, "error")
                self.plan = dataclasses.replace(self.plan, unforked=why)
                self.reset_candidates()
                self.retire_child()
                self.start()
            elif msg.failed:  # not about the id: another collection would fail alike
                replay.fail("setup", _reports.BOOT_FAILED + "\n\n" + msg.problem)
                replay.ensure_teardown()
                self._ended()
            else:  # the child ends by itself
                replay.add(_reports.make(self.item, "setup", "passed"))
                replay.fail("call", _reports.NOT_FOUND + "\n\n" + "\n\n".join(self.problems))
                replay.ensure_teardown()
                self._ended()
        elif isinstance(msg, _replies.Phase):
            replay.enter(msg.when)
        elif isinstance(msg, _replies.Report):
            config = self.item.config
            try:
                report = config.hook.pytest_report_from_serializable(config=config, data=msg.data)
                if not isinstance(report, pytest.TestReport):
                    raise TypeError(f"it is a {type(report).__qualname__}, not a test report")
                _replay.restore(report, msg.data, msg.rendered)
            except Exception as exc:  # noqa: BLE001 - the child's words must not end the run
                self._pipe_ended(f"a report could not be rebuilt: {exc!r}")
                return
            if msg.pending:
                replay.add_pending(report)
            else:
                replay.add(report, msg.terminal)
        elif isinstance(msg, _replies.WarningRecord):
            replay.warnings.append(_replay.warning_message(msg))
        elif isinstance(msg, _replies.Interrupted):
            self.interrupted = msg
        elif isinstance(msg, _replies.Done):
            _learned.saw_imports(self.item.config, msg.imported)
            replay.terminal = msg.terminal
            self.peak_device_bytes = msg.peak_device_bytes
            self.cpu_load = msg.cpu_load
            self.doubt = msg.doubt
            self.held_after = msg.held_bytes
            self._learn(msg.peak_per_device, msg.jax_peak)
            if self.interrupted is None:
                replay.complete(msg.notes)
                self._judge_tree()
            self._ended(handover=msg.more and self.interrupted is None, done=True)
        else:  # the pipe ended before "done": the child died, or cannot be heard
            self._pipe_ended(msg.cause)

    def _fork_ended(self, msg: _replies.ForkEnded) -> None:
        """Warn on the test whose fork ended badly after its "done": the one it names,
        else this one's, or the previous test's of its template (its word comes before
        this test's fork)."""
        previous = self.previous
        item = previous if previous is not None and msg.pid != self.forked_pid else self.item
        _ending.warn_fork_ended(_ending.named(msg, item), msg)

    def _learn(self, torch_peak: int | None, jax_peak: int | None = None) -> None:
        """The peak that ``--spawn-pack auto`` budgets this test by next time
        (``_treememory.learned_peak``), its tree sampled once more first."""
        if not self.claimed:
            return
        assert self.child is not None
        if jax_peak is None:
            self.sample_tree()
        found = _treememory.learned_peak(
            self.claimed, self.pids, self.child.pid, self.tree_peak, torch_peak, jax_peak
        )
        if found is None:
            return
        self.used_device, peak = found
        self.replay.properties.append((LEARNED_PEAK, round(peak / 2**20, 1)))

    def _judge_tree(self) -> None:
        """A declared budget holds over the test's whole process tree
        (``_treememory.tree_overrun``): a process it started that took more fails it."""
        text = _treememory.tree_overrun(self.plan, self.tree_peak)
        if text:
            self.replay.fail_passed(SECTION, text)

    def sample_tree(self) -> None:
        """What the test's process tree holds on its devices now: its running peak.
        The tree is the test's process (a template's fork, else the child) and every
        process below it, also one that left its session."""
        child = self.child
        if not self.claimed or child is None or child.gone:
            return
        held = _treememory.tree_held(self.claimed, self.forked_pid or child.pid)
        if held is not None:
            self.tree_peak = max(self.tree_peak or 0, held)

    def on_exit(self) -> None:
        """The child's sentinel fired: the process is gone (its code may follow)."""
        child = self.child
        assert child is not None
        for msg in child.messages():  # a dead child may still have words in the pipe
            if self.child is child:
                self.on_message(msg)
            elif self.ending is not None and self.ending.child is child:
                self.ending.on_message(msg)  # its test is over: its last words
            else:
                break  # replaced (a fallback): its successor is watched from now on
        if self.state in LISTENING and self.child is child:
            self._pipe_ended("")  # gone without its "done" (a process it left holds the pipe)
        ending = self.ending
        if ending is not None and ending.child is child:
            if not child.gone:
                ending.on_exit()
        elif self.child is child and not child.gone:
            child.reaped()

    def on_deadline(self, now: float) -> None:
        if self.deadline is None or now < self.deadline:
            return
        state = self.state
        if self.pipe_ended is not None and state in LISTENING:
            self._judge_death(now)
        elif state is State.BOOTING or state is State.RUNNING:
            self._start_dump()
        elif state is State.DUMPING:
            self._poll_dump(now)

    def abort(self, reason: str, report: bool = True) -> None:
        """End the child now (-x, an interrupt elsewhere); a test with its turn says so.

        ``report=False``: the session was interrupted, and as in-process a test that
        did not finish has no report.
        """
        if self.state not in LISTENING:
            if self.ending is not None:
                self.ending.abort()
            return
        if self.child is None:  # its turn came, but it never started
            self.turned = False
            self.state, self.deadline = State.DONE, None
            return
        self.child.kill()
        if report and self.turned and self.interrupted is None:
            skipped = (str(self.item.path), (self.item.location[1] or 0) + 1, reason)
            phase = self.replay.pending_phase()
            self.replay.add(_reports.make(self.item, phase, "skipped", skipped))
            self.replay.ensure_teardown()
        self._leave(_ending.Stage.EXITING)
