"""A spawned test's record in the parent: its states, its fields, the start of its child.

Runs in the parent. ``JobRecord`` is what a test's ``_jobs.Job`` knows (its child, its
devices, its plan, its replay, its deadline) and how its child is started (ahead of
its turn, or at it) with the environment it runs in; ``_jobends`` adds how the child
stops being the test's, ``_jobs`` the events that drive it.

States, in order (a job may skip some)::

    AHEAD     started before its turn, still booting (importing, collecting)
    WAITING   booted ahead, waiting for its turn
    BOOTING   its turn came before it finished booting: it goes when booted
    RUNNING   go sent: setup, call, teardown
    DUMPING   timed out: its stacks are being written, then it is killed
    DONE      its reports are complete (or it was dropped before it ran)
"""

from __future__ import annotations

import enum
import os
import re
import time
from collections.abc import Mapping
from itertools import count

import pytest

from spawnrun.devices import _allocator
from spawnrun.devices import _packing
from spawnrun.driver import _early
from spawnrun.driver import _ending
from spawnrun.driver import _replay
from spawnrun.driver import _treememory
from spawnrun.launch import _runner
from spawnrun.launch import _starting
from spawnrun.wire import _replies
from spawnrun.wire import _reports

_claims = count(1)


#: How long a child may take to boot once its turn has come (a hanging conftest).
BOOT_LIMIT = 600.0
#: How often a state that watches something without an event looks again.
POLL = _ending.POLL


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


class JobRecord:
    """A spawned test's record: its child, its devices, its state, its buffered reports.

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
        #: Whether the summary counted it as a test (once, whenever it ended).
        self.counted = False
        #: Why it runs again, once (its first run's evidence against a guess; "": not).
        self.again_why = ""
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
        return _treememory.over_guess(self.plan, self.guessed, self.tree_peak)

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

    def _to(self, state: State) -> None:
        self.state = state
        self._arm()

    @property
    def reported(self) -> bool:
        """Every report of the test is in (the child's, or the ones made for it)."""
        return self.state not in LISTENING

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
