"""A child's life after its test: between a scope's tests, exiting, reaped, released.

Runs in the parent. Once a test is reported (``_jobs.Job``), its child is no longer the
test's: an ``Ending`` owns it, with the devices it still holds, until the process is
gone, what it left behind is ended and NVML no longer lists its processes on those
devices. A scope's child that may run the scope's next test waits here between tests,
and the next test's job takes it back (``take``). Like a job, an ending reacts to
events in small handlers that never block: the child's exit, a message after its
"done" (errors of its session end), and its next deadline.

States, in order (an ending may skip some)::

    HANDOVER  between tests: the child waits for its scope's next test (or a stop)
    EXITING   the test is over and reported; the process is ending
    REAPING   the process is gone; what it left behind is being ended
    SETTLING  waiting for NVML to stop listing its processes on its devices
    GONE      devices free again; the scheduler counts and forgets it
"""

from __future__ import annotations

import enum
import signal
import time

import pytest

from spawnrun.child import _leftovers
from spawnrun.devices import _devices
from spawnrun.launch import _runner
from spawnrun.launch import _stream
from spawnrun.wire import _replies
from spawnrun.wire import _reports

#: After "done", how long a child may take to exit before what it left behind is ended
#: (a library's own shutdown runs in its exit: vLLM stops its engine processes in about
#: 5 s, and ending them under it leaks their shared memory), and before the child itself
#: is killed.
EXIT_GRACE = 15.0
EXIT_KILL = 20.0
#: Processes left behind get this long between SIGTERM and SIGKILL.
REAP_GRACE = 2.0
#: How long processes on their way out get before they count as left behind.
REAP_PATIENCE = 0.3
#: How often a state that watches something without an event looks again.
POLL = 0.05


class Stage(enum.Enum):
    HANDOVER = "between tests"
    EXITING = "exiting"
    REAPING = "reaping"
    SETTLING = "settling"
    GONE = "gone"


class Ending:
    """A reported test's child, on its way out (or waiting for its scope's next test).

    It keeps the devices the test held (``held``, claimed under ``token``) until they
    are released: the scheduler gives them back once ``released`` (NVML lists none of
    its processes) or at ``GONE``.
    """

    def __init__(
        self,
        item: pytest.Item,
        child: _runner.ChildProcess,
        stage: Stage,
        *,
        scope: str = "",
        devices: list[str],
        claimed: list[str],
        held: list[str],
        token: str,
        settle: float | None,
        pids: set[int],
        left_behind: list[int],
        forked_pid: int = 0,
        reaped: int = 0,
    ) -> None:
        self.item = item
        self.child: _runner.ChildProcess | None = child
        self.scope = scope
        self.devices = devices
        self.claimed = claimed
        self.held = held
        self.token = token
        self.settle = settle
        self.pids = pids
        self.left_behind = left_behind
        #: A template's fork (its test's process): not among what it left behind.
        self.forked_pid = forked_pid
        #: Processes left behind that were ended, from the test's death on (for the
        #: summary and a warning).
        self.reaped_count = reaped
        self.term_sent = 0.0
        #: Why the child had to be killed after its test ended ("" if it exited).
        self.stuck = ""
        #: Its exit status when it exited by itself with one, after the test's end.
        self.bad_exit = 0
        self.killed = False
        #: Its test ended by its "done" (not a crash or a timeout's kill): an exit status
        #: after it is the child's own.
        self.after_done = False
        #: Errors the child met after "done" (its session end).
        self.after_notes: list[str] = []
        #: NVML no longer lists its processes on its devices: they may be handed on now.
        self.released = False
        self.settled_after = 0.0
        self.since = 0.0
        self.deadline: float | None = None
        self.stage = stage
        self._arm()

    @property
    def listening(self) -> bool:
        """Whether its pipe is still read (errors of its session end come after "done")."""
        return self.stage is Stage.EXITING

    def _to(self, stage: Stage) -> None:
        self.stage = stage
        self._arm()

    def _arm(self) -> None:
        now = time.monotonic()
        self.since = now
        if self.stage is Stage.HANDOVER or self.stage is Stage.GONE:
            self.deadline = None
        elif self.stage is Stage.EXITING:
            # The exit itself is an event (the sentinel); the deadline is only for a
            # child that does not leave, and for watching its devices be released.
            self.deadline = now + (POLL if self._watching_release() else EXIT_GRACE)
        elif self.stage is Stage.REAPING:
            # Look at once: a child that left nothing behind is gone now, not a poll
            # later (its devices, and the session's end, waited for that poll).
            self.deadline = now
        else:
            self.deadline = now + POLL

    # A scope's child between tests -----------------------------------------------------

    @property
    def waiting(self) -> bool:
        """Whether its child waits between tests, alive, for the scope's next one."""
        child = self.child
        return self.stage is Stage.HANDOVER and child is not None and not child.gone

    def take(self) -> _runner.ChildProcess | None:
        """The scope's next test takes the waiting child (None: it is gone meanwhile)."""
        child = self.child
        if not self.waiting or child is None:
            return None
        self.child, self.held = None, []
        self.stage, self.deadline = Stage.GONE, None
        return child

    def dismiss(self) -> None:
        """No next test for the child waiting between tests: it tears down and ends."""
        if self.stage is Stage.HANDOVER and self.child is not None:
            self.child.stop()
            self._to(Stage.EXITING)

    def abort(self) -> None:
        """The session stops: the child ends now (its exit is seen as any other)."""
        if self.child is not None:
            self.killed = True
            self.child.kill()
            if self.stage is Stage.HANDOVER:
                self._to(Stage.EXITING)

    # Events ------------------------------------------------------------------------------

    def on_message(self, msg: _replies.Message | _stream.Died) -> None:
        if isinstance(msg, _replies.After):
            self.after_notes += msg.notes  # told as a warning once it is gone
        elif isinstance(msg, _replies.LeftRunning):
            self.pids.update(msg.pids)  # their memory is waited for like the child's
            warn_left_running(named(msg, self.item), msg)
        elif isinstance(msg, _replies.ForkEnded):
            # The template's word on this test's fork, read with its "done" (a loaded
            # parent reads both at once) or while it waits for the next test.
            warn_fork_ended(named(msg, self.item), msg)

    def on_exit(self) -> None:
        """The child's sentinel fired: the process is gone."""
        child = self.child
        assert child is not None
        if self.listening:
            for msg in child.messages():  # its last words may still be in the pipe
                self.on_message(msg)
        if not child.gone:
            code = child.exitcode
            mine = not (self.stuck or self.killed)
            if code and self.after_done and mine and self.stage is not Stage.REAPING:
                self.bad_exit = code  # an atexit handler's os._exit(3), say
            child.reaped()
            self._to(Stage.REAPING)

    def on_deadline(self, now: float) -> None:
        if self.deadline is None or now < self.deadline:
            return
        if self.stage is Stage.EXITING:
            self._poll_exit(now)
        elif self.stage is Stage.REAPING:
            self._poll_reap(now)
        elif self.stage is Stage.SETTLING:
            self._poll_settle(now)

    # Watches -----------------------------------------------------------------------------

    def _others(self) -> list[int]:
        """The processes of the child's group other than it and its test's fork."""
        assert self.child is not None
        return [p for p in self.child.others() if p != self.forked_pid]

    def _watching_release(self) -> bool:
        """Whether its devices may be handed on before its exit: NVML can tell."""
        return bool(self.claimed) and not self.released and _devices.nvml_available()

    def _check_release(self) -> None:
        """The child freed its contexts after its test: hand the devices on once NVML
        lists none of its processes on them (nor any process of its group)."""
        assert self.child is not None
        pids = self.pids | set(self.left_behind) | set(_runner.group_members(self.child.pid))
        if _devices.still_held(self.claimed, pids) is False:
            self.released = True

    def _poll_exit(self, now: float) -> None:
        """After "done": the child should be on its way out; help it if it is stuck."""
        assert self.child is not None
        waited = now - self.since
        if self._watching_release():
            self._check_release()
        if waited < EXIT_GRACE:
            self.deadline = self.since + EXIT_GRACE
            if self._watching_release():
                self.deadline = min(self.deadline, now + POLL)
            return
        if waited >= EXIT_KILL:
            if not self.stuck:
                self.stuck = _reports.STUCK_EXIT.format(s=EXIT_KILL)
            self.child.kill()
        elif waited >= EXIT_GRACE and not self.left_behind:
            # multiprocessing joins non-daemonic children at exit: a child may be
            # waiting for what its test left behind. End those first.
            self.left_behind = self._others()
            self.reaped_count += len(self.left_behind)
            _runner.signal_pids(self.left_behind, signal.SIGTERM)
        self.deadline = self.since + EXIT_KILL if waited < EXIT_KILL else now + 1.0

    def _poll_reap(self, now: float) -> None:
        """The child is gone; end what its test left in its group or session."""
        assert self.child is not None
        others = _runner.group_members(self.child.pid)
        if not others:
            self._to(Stage.SETTLING)
            self._poll_settle(now)
            return
        self.deadline = now + POLL
        if now - self.since < REAP_PATIENCE:
            return  # processes already on their way out may finish by themselves
        new = [p for p in others if p not in self.left_behind]
        if new:
            self.left_behind += new
            self.reaped_count += len(new)
            _runner.signal_pids(new, signal.SIGTERM)
            self.term_sent = now
        elif now - self.term_sent >= REAP_GRACE:
            _runner.signal_pids(others, signal.SIGKILL)

    def _poll_settle(self, now: float) -> None:
        held = None
        if self.devices and self.settle:
            held = _devices.still_held(self.devices, self.pids | set(self.left_behind))
        if held and now - self.since < (self.settle or 0.0):
            self.deadline = now + 2 * POLL
            return
        self.settled_after = now - self.since
        self.stage, self.deadline = Stage.GONE, None

    def warnings(self) -> list[str]:
        """What the test's report cannot say any more: a stuck exit, late errors, reaping."""
        texts = [self.stuck] if self.stuck else []
        if self.bad_exit:
            texts.append(_reports.BAD_EXIT.format(code=self.bad_exit))
        texts += [f"{_reports.CHILD_NOTES} (after the test):\n{n}" for n in self.after_notes]
        if self.reaped_count:
            texts.append(_reports.REAPED.format(n=self.reaped_count))
        return texts


#: The session's items by node id, and the list they were taken from (it is looked up
#: once per forked test: a walk of every item each time made a run's cost grow with the
#: square of its size).
_BY_ID = pytest.StashKey[tuple[list[pytest.Item], int, dict[str, pytest.Item]]]()


def named(msg: _replies.ForkEnded | _replies.LeftRunning, item: pytest.Item) -> pytest.Item:
    """The test ``msg`` names (``item`` where it names none, or none of the session's)."""
    if not msg.nodeid or msg.nodeid == item.nodeid:
        return item
    session = item.session
    items = getattr(session, "items", [])
    kept = session.stash.get(_BY_ID, None)
    if kept is None or kept[0] is not items or kept[1] != len(items):
        by_id: dict[str, pytest.Item] = {}
        for each in items:
            by_id.setdefault(each.nodeid, each)  # the first of a repeated id, as before
        kept = session.stash[_BY_ID] = (items, len(items), by_id)
    return kept[2].get(msg.nodeid, item)


def warn_fork_ended(item: pytest.Item, msg: _replies.ForkEnded) -> None:
    """Warn on ``item`` that its fork ended badly after its "done" (a template's word)."""
    if msg.killed:
        text = _reports.STUCK_EXIT.format(s=_replies.FORK_EXIT_LIMIT)
    elif msg.code:
        text = _reports.BAD_EXIT.format(code=msg.code)
    else:
        return
    warning = _reports.warning(text, str(item.path), (item.location[1] or 0) + 1)
    _reports.record_warning(item.config, warning, item.nodeid)


#: How many processes tests' processes ended as they left (``_leftovers``), for the
#: summary's count of what was reaped: told to whichever job or ending listened then.
LEFT_RUNNING_KEY = pytest.StashKey[int]()


def warn_left_running(item: pytest.Item, msg: _replies.LeftRunning) -> None:
    """Warn on ``item`` that its process found processes still running as it left."""
    config = item.config
    config.stash[LEFT_RUNNING_KEY] = config.stash.get(LEFT_RUNNING_KEY, 0) + len(msg.pids)
    names = ", ".join(msg.processes)
    if len(msg.pids) > len(msg.processes):
        names += f" and {len(msg.pids) - len(msg.processes)} more"
    text = _reports.LEFT_RUNNING.format(n=len(msg.pids), grace=_leftovers.GRACE, names=names)
    warning = _reports.warning(text, str(item.path), (item.location[1] or 0) + 1)
    _reports.record_warning(item.config, warning, item.nodeid)
