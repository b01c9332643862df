"""One spawned test's life in the parent, as an explicit state machine.

Runs in the parent. A ``Job`` is a test's record: the child running it (and, on a
fallback collection or a crash rerun, its successor), its reports, its deadline. It
reacts to three kinds of event, each in a small handler that never blocks: a message
from the child, the child's exit, and the job's next deadline. The scheduler
(``_scheduler``) waits on every job's pipe, exit and deadline at once and calls these
handlers; it decides *when* a job may start, the job decides *what* its child's
messages mean.

States, in order (a job may skip some)::

    AHEAD     started before its turn, still booting (importing, collecting)
    WAITING   booted ahead, waiting for its turn
    BOOTING   its turn came before it finished booting: it goes when booted
    RUNNING   go sent: setup, call, teardown
    DUMPING   timed out: its stacks are being written, then it is killed
    DONE      its reports are complete (or it was dropped before it ran)

At DONE the child is no longer the test's: an ``_ending.Ending`` takes it, with the
devices it holds, through its exit, the reaping of what it left and the wait for its
device memory (or keeps it for the scope's next test, which takes it back). The reports
are replayed then, not when the process has exited: all of that is off the test's
critical path.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import signal
import time
from collections.abc import Mapping
from itertools import count

import pytest

from spawnrun.child._budget import SECTION
from spawnrun.devices import _allocator
from spawnrun.devices import _devices
from spawnrun.devices import _inventory
from spawnrun.devices import _packing
from spawnrun.driver import _early
from spawnrun.driver import _ending
from spawnrun.driver import _poison
from spawnrun.driver import _replay
from spawnrun.launch import _runner
from spawnrun.launch import _starting
from spawnrun.learn import _learned
from spawnrun.learn import _unforked
from spawnrun.wire import _identity
from spawnrun.wire import _replies
from spawnrun.wire import _reports
from spawnrun.wire._reports import BUDGET_PROPERTY
from spawnrun.wire._reports import CPU_LOAD_PROPERTY
from spawnrun.wire._reports import LEARNED_PEAK
from spawnrun.wire._reports import WALL_PROPERTY

_claims = count(1)


#: How long a child may take to boot once its turn has come (a hanging conftest).
BOOT_LIMIT = 600.0
#: How long faulthandler gets to write the stacks of a timed-out child.
DUMP_LIMIT = 2.0
#: How often a state that watches something without an event looks again.
POLL = _ending.POLL
#: After a child's pipe ended, how long it gets to be seen exiting (its exit code tells
#: how it died) before it counts as alive without its pipe and is killed.
PIPE_GRACE = 1.0
#: How often a running test's process tree is sampled for the device memory it holds
#: (one NVML query per claimed device, and a walk of /proc): an engine process that
#: holds memory for a second or more is seen.
SAMPLE_EVERY = 0.25


class State(enum.Enum):
    AHEAD = "booting ahead"
    WAITING = "booted ahead"
    BOOTING = "booting"
    RUNNING = "running"
    DUMPING = "dumping stacks"
    DONE = "done"


#: States in which the child may still send messages about the test.
LISTENING = {State.AHEAD, State.WAITING, State.BOOTING, State.RUNNING, State.DUMPING}
#: States that hold one of the run's slots (children running a test at once).
IN_SLOT = {State.BOOTING, State.RUNNING, State.DUMPING}


class Job:
    """A spawned test in flight: its child, its devices, its state, its buffered reports.

    ``devices`` are fixed when its child starts, in the child's environment from the
    first instruction on; a job booted ahead runs on the devices it was planned on or
    is started afresh on others (``replan``), never told new devices later.
    """

    def __init__(
        self,
        item: pytest.Item,
        plan: _packing.Plan,
        devices: list[str],
        settle: float | None,
        capacity: Mapping[str, int | None] | None = None,
        then: list[str] | None = None,
        poison: list[re.Pattern[str]] | None = None,
        replace_above: int | None = None,
        refusals: dict[str, str] | None = None,
        early: _early.Early | None = None,
    ) -> None:
        self.item = item
        #: Children started while the parent collected, for this job to take (``start``).
        self.early = early
        #: Templates that may not fork (their scope -> why), shared by the run's jobs.
        self.refusals = refusals if refusals is not None else {}
        #: Its child is a template, which runs its test in a fork: the template's pid,
        #: and the fork's once its "done" names it.
        self.template_pid = 0
        self.forked_pid = 0
        #: The tests of its scope after this one (its child may run them after it).
        self.then = list(then or [])
        self.poison = poison or []
        #: A scope's child holding more device memory than this after a test is replaced.
        self.replace_above = replace_above
        #: What torch still had allocated in the child after the test (scopes).
        self.held_after: int | None = None
        #: Why its child was not handed to the scope's next test ("": it was, or none).
        self.replaced = ""
        #: The scope's test before it, whose child it took over (None: it booted one).
        self.previous: pytest.Item | None = None
        self.plan = plan
        self.timeout = plan.timeout
        self.devices = devices
        self.settle = settle
        self.capacity = capacity or {}
        #: This job's claims in the allocator are made under this token.
        self.token = _allocator.token_for(next(_claims))
        #: The devices it claimed (its own, or all of them for a --spawn-gpu test).
        self.claimed: list[str] = []
        #: The most its test's process tree held on those devices at once, as sampled
        #: while it ran (an engine process the test started, gone by its end, counts).
        self.tree_peak: int | None = None
        #: Whether its test used one of those devices (memory, as torch or NVML saw
        #: it); None where neither could look.
        self.used_device: bool | None = None
        #: Whether another test held one of its devices while it ran.
        self.shared = False
        #: It ran beside a test on a learned budget (a guess: ``_units.Units._again``).
        self.beside_guess = False
        #: Why its fork's outcome may not be a spawned child's (``Done.doubt``).
        self.doubt = ""
        #: Its child (the last started) was forked from the zygote.
        self.zygote_forked = False
        self.replay = _replay.Replay(item)
        self.candidates = _starting.candidate_args(item, self.then)
        self.problems: list[str] = []
        #: Why its child could not be started ("": it could).
        self.start_error = ""
        self.child: _runner.ChildProcess | None = None
        #: The devices it holds in the allocator (its planned ones, from its go on).
        self.held: list[str] = []
        self.boot_counted = False
        #: Children this job no longer needs (a fallback replaced one): to be reaped.
        self.retired: list[_runner.ChildProcess] = []
        self.state = State.AHEAD
        #: Whether pytest has reached this test (its turn); set once, by ``turn``.
        self.turned = False
        #: Whether its slot and devices are its own (``go``): only then may it run.
        self.granted = False
        self.replayed = False
        self.parent_error: pytest.TestReport | None = None
        self.interrupted: _replies.Interrupted | None = None
        self.deadline: float | None = None
        #: When the child's pipe ended before its test's end, and why it cannot be read
        #: on ("": it was closed).
        self.pipe_ended: float | None = None
        self.pipe_problem = ""
        #: When the current state's watch started (the stack dump).
        self.since = 0.0
        self.started = time.monotonic()
        self.went = 0.0
        self.boot_seconds: float | None = None
        self.pids: set[int] = set()
        self.left_behind: list[int] = []
        #: Processes left behind by a child that died or timed out, ended with it.
        self.reaped_count = 0
        #: Its child once its test is over: exiting, or waiting for the scope's next test.
        self.ending: _ending.Ending | None = None
        self.phase_at_timeout = ""
        #: The limit that ran out (the test's timeout, or the boot limit).
        self.limit: float | None = None
        self.stacks_size = 0
        self.last_size = -1
        #: At a timeout, the processes below the child (pid, parent, command, stacks file).
        self.below: list[tuple[int, int, str, str]] = []
        self.below_sizes: list[int] = []
        #: The parent's environment when this job's child started, and the changes to
        #: send with its go.
        self.environ = dict(os.environ)
        self.env_set: dict[str, str] = {}
        self.env_unset: list[str] = []
        #: Executions of the test by earlier children (crash reruns).
        self.executions = 0
        #: Booted unclaimed (the dispatcher's ``Start.deferred``): ``devices`` is what it
        #: sees, ``claimed`` stays empty until its go; what its boot touched.
        self.deferred = False
        self.boot_touched = ""
        #: For the run summary: children started, crashes, timeouts, peak device memory.
        self.children_started = 0
        self.crashes = 0
        self.timeouts = 0
        self.peak_device_bytes: int | None = None
        #: The cores its test kept busy (``Done.cpu_load``), learned for job slots.
        self.cpu_load: float | None = None

    # Starting --------------------------------------------------------------------

    @property
    def forked(self) -> bool:
        """Its test ran in a fork of a template (fast mode): a guess, like a budget."""
        return bool(self.template_pid) or self.zygote_forked

    @property
    def guessed(self) -> bool:
        """It runs on a budget the run learned (a guess, not the user's promise)."""
        return self.plan.learned and self.plan.need is not _packing.ALONE and bool(self.claimed)

    @property
    def tree_over_guess(self) -> bool:
        """Its process tree held more than its learned budget (an engine process grew
        since the peak was learned, beyond torch's cap in the child): the guess was
        wrong, whatever the outcome."""
        need = self.plan.need
        if not self.guessed or need is None or self.tree_peak is None:
            return False
        return self.tree_peak - _packing.RESERVE > need

    def env(self) -> dict[str, str]:
        return _starting.child_env(self.item.config, self.plan, self.devices, self.capacity)

    def start(self) -> None:
        """Start the child (ahead of the turn, or at it) with its final environment.

        A child that cannot be started (no process or descriptor left, say) fails its
        test with the cause at its turn; one that was to boot ahead is tried again then.
        """
        self.environ = dict(os.environ)
        started = time.monotonic()
        try:
            template = self.plan.forked
            args = self.candidates[0]
            env, then = self.env(), self.then
            early = None
            if self.early is not None:
                early, dismissed = self.early.take(args, env)
                self.retired.extend(dismissed)
            if early is not None:
                child = _starting.assign(early.child, self.item, self.executions, then, template)
                self.environ, started = early.environ, early.started
                if self.turned:  # measured from the parent's environment at its start
                    self._env_changes()
            else:
                fresh = bool(self.plan.unforked)
                child = _starting.start(
                    self.item, args, env, self.executions, then, template, fresh
                )
        except Exception as exc:  # noqa: BLE001 - the test's failure, never the run's end
            self.child = None
            self.start_error = f"{type(exc).__name__}: {exc}"
            if self.turned:
                text = f"{_reports.NOT_STARTED}: {type(exc).__name__}: {exc}\nnode id: "
                self.replay.fail("setup", text + self.item.nodeid)
                self.replay.ensure_teardown()
                self.state, self.deadline = State.DONE, None
            return
        self.candidates.pop(0)
        if template and not child.spec.fork_each:
            self.refusals.setdefault(self.plan.scope, "")  # told by the forkserver's warning
        self.template_pid = child.pid if child.spec.fork_each else 0
        self.zygote_forked = bool(getattr(child, "forked", False))
        self.child = child
        self.children_started += 1
        self.pids.add(self.child.pid)
        self.started = started
        self.pipe_ended = None
        self.pipe_problem = ""
        # A child started again before the test was given its slot and devices (a
        # fallback while it waits for them) waits for them too: no go before ``go``.
        self.state = State.BOOTING if self.turned and self.granted else State.AHEAD
        self._arm()

    def turn(self, parent_error: pytest.TestReport | None) -> None:
        """pytest reached this test. Remember what changed in the parent's environment."""
        self.turned = True
        self.parent_error = parent_error
        self._env_changes()

    def _env_changes(self) -> None:
        """What changed in the parent's environment since the child's start (or last go)."""
        protected = set(self.env())
        now = os.environ
        self.env_set = {
            k: v for k, v in now.items() if self.environ.get(k) != v and k not in protected
        }
        self.env_unset = [k for k in self.environ if k not in now and k not in protected]

    def assign(self, devices: list[str]) -> None:
        """An unclaimed child's devices at its go: claimed from now on; its visibility
        variables are changed before its test where they differ from what it saw."""
        before = self.env()
        if self.plan.every:
            self.claimed = list(devices)
        else:
            self.devices = self.claimed = list(devices)
        self._child_env_changes(before)
        self.deferred = False

    def _child_env_changes(self, before: dict[str, str]) -> None:
        """Send with the go what differs between the child's own variables and ours."""
        after = self.env()
        self.env_set.update({k: v for k, v in after.items() if before.get(k) != v})
        self.env_unset += [k for k in before if k not in after and k not in self.env_unset]

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

    def _arm(self) -> None:
        """The deadline of the current state."""
        now = time.monotonic()
        if self.state is State.BOOTING:
            self.deadline = now + max(BOOT_LIMIT, self.timeout or 0.0)
        elif self.state is State.RUNNING:
            self.deadline = now + self.timeout if self.timeout is not None else None
        elif self.state is State.DUMPING:
            self.since = now
            self.deadline = now + POLL
        else:
            self.deadline = None

    # Events ------------------------------------------------------------------------

    @property
    def reported(self) -> bool:
        """Every report of the test is in (the child's, or the ones made for it)."""
        return self.state not in LISTENING

    def on_message(self, msg: _replies.Message | _runner.Died) -> None:
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
        """The peak that ``--spawn-pack auto`` budgets this test by next time.

        torch's reserved peak on its fullest device, or what NVML lists for its
        processes now (its context included, so less the reserve) where that is more
        (memory held by other libraries). A test that used no device, as one of them saw
        it, learns 0; where neither could look (no torch view, no NVML: a JAX test on a
        host without NVML), nothing is learned: an unmeasured peak is never 0, and a test
        with no record does not share. Where JAX started a GPU backend in the test's
        process, its own peak counts instead of NVML's figure, which is the pool JAX
        preallocated (75% of the device by default, whatever the test used).
        """
        if not self.claimed:
            return
        assert self.child is not None
        if jax_peak is not None:
            self.used_device = True
            peak = max(torch_peak or 0, jax_peak)
            self.replay.properties.append((LEARNED_PEAK, round(peak / 2**20, 1)))
            return
        self.sample_tree()
        pids = self.pids | set(_runner.group_members(self.child.pid))
        held = _devices.process_memory(self.claimed, pids)
        if self.tree_peak is not None:
            held = max(held or 0, self.tree_peak)
        if torch_peak is None and held is None:
            return
        self.used_device = bool(torch_peak) or bool(held)
        peak = torch_peak or 0
        if held is not None:
            peak = max(peak, held - _packing.RESERVE)
        self.replay.properties.append((LEARNED_PEAK, round(peak / 2**20, 1)))

    def _judge_tree(self) -> None:
        """A declared budget holds over the test's whole process tree: a process the
        test started (an engine, a server), which no cap reaches, that took more fails
        the test, as torch's cap does in its own process; its neighbours never pay for
        it. (A learned budget so exceeded runs the test again alone: ``tree_over_guess``.)"""
        need = self.plan.need
        if self.plan.learned or need is _packing.ALONE or self.tree_peak is None:
            return
        held = self.tree_peak - _packing.RESERVE
        if held <= need:
            return
        show = _packing.show
        text = (
            f"{SECTION}: the test's process tree held {show(self.tree_peak)} on "
            f"one of its GPUs at once (NVML, sampled every {SAMPLE_EVERY:g} s; "
            f"{show(held)} less the {show(_packing.RESERVE)} reserve for its context), more "
            f"than its budget of {show(need)} ({self.plan.budget_source}): a process it "
            "started went over it, where no cap reaches"
        )
        self.replay.fail_passed(SECTION, text)

    def sample_tree(self) -> None:
        """What the test's process tree holds on its devices now (NVML's per-process
        usage): its running peak. The tree is the test's process (a template's fork,
        else the child) and every process below it, also one that left its session."""
        child = self.child
        if not self.claimed or child is None or child.gone:
            return
        root = self.forked_pid or child.pid
        pids = {root} | {pid for pid, _ in _runner.process_tree(root)}
        held = _devices.process_memory(self.claimed, pids)
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

    # Transitions -------------------------------------------------------------------

    def _to(self, state: State) -> None:
        self.state = state
        self._arm()

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
            child.reaped()
            self._leave(_ending.Stage.REAPING)
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
        held, how = self.held_after or 0, "torch has allocated"
        pids = self.pids | set(_runner.group_members(self.child.pid))
        listed = _devices.process_memory(self.claimed, pids) if self.claimed else None
        if listed is not None and listed > held:
            held, how = listed, "NVML lists for its processes"
        if held <= self.replace_above:
            return ""
        limit = _packing.show(self.replace_above)
        return f"after it {how} {_packing.show(held)}, more than spawn_scope_memory {limit}"

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
            self.deadline = now + POLL
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
        elif self.timeout is not None and self.timeout >= BOOT_LIMIT:
            self.phase_at_timeout, self.limit = "setup (while the child booted)", self.timeout
        else:
            self.phase_at_timeout = "setup (while the child booted: spawnrun's boot limit)"
            self.limit = BOOT_LIMIT
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
            self.deadline = now + 2 * POLL
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

    def retire_child(self) -> None:
        """Kill the current child (a fallback or a replan replaces it); reaped elsewhere."""
        if self.child is not None:
            self.child.kill()
            self.retired.append(self.child)
            self.child = None

    def take_retired(self) -> list[_runner.ChildProcess]:
        retired, self.retired = self.retired, []
        return retired

    def reset_candidates(self) -> None:
        self.candidates = _starting.candidate_args(self.item, self.then)


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
