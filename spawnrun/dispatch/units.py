"""A child's life as the dispatcher keeps it: one small state machine per process.

Runs in the parent; pure. States, in order (a child may skip some)::

    STARTING  the process is starting (imports, collection of its file or scope)
    READY     booted, waiting for a test (booted ahead, started early, a template)
    RUNNING   running ``test`` (its timeout counts from the go)
    BETWEEN   a scope's child after a test, waiting for the scope's next one
    EXITING   dismissed or done: it tears down and exits (``exit_grace``, then killed)
    KILLED    killed: waiting for its exit (``kill_grace``, then given up)
    SETTLING  exited: its devices wait for NVML to release its memory (``settle``)
    GONE      forgotten; its claim is given back

A transition that the table does not allow raises ``Illegal``: an ordering race shows as
an error in the simulator instead of a silent wrong state. Every state but READY and
BETWEEN ends by an event that a live process or a deadline produces; READY and BETWEEN
children are idle holders, which the dispatcher dismisses before they can block a test.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from dataclasses import field

from spawnrun.dispatch.events import Kind


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RUNNING = "running"
    BETWEEN = "between tests"
    EXITING = "exiting"
    KILLED = "killed"
    SETTLING = "settling"
    GONE = "gone"


S = State
ALLOWED: dict[State, frozenset[State]] = {
    S.STARTING: frozenset({S.READY, S.EXITING, S.KILLED, S.SETTLING, S.GONE}),
    S.READY: frozenset({S.RUNNING, S.EXITING, S.KILLED, S.SETTLING}),
    S.RUNNING: frozenset({S.BETWEEN, S.EXITING, S.KILLED, S.SETTLING}),
    S.BETWEEN: frozenset({S.RUNNING, S.EXITING, S.KILLED, S.SETTLING}),
    # EXITING -> GONE: dismissed before its process existed (the ledger denied it).
    S.EXITING: frozenset({S.KILLED, S.SETTLING, S.GONE}),
    S.KILLED: frozenset({S.SETTLING, S.GONE}),
    S.SETTLING: frozenset({S.GONE}),
    S.GONE: frozenset(),
}
#: States that end by themselves: a live process or a deadline will produce an event.
MOVING = frozenset({S.STARTING, S.RUNNING, S.EXITING, S.KILLED, S.SETTLING})
#: Idle holders: a process that waits for the dispatcher.
IDLE = frozenset({S.READY, S.BETWEEN})


class Illegal(RuntimeError):
    """A transition the state table does not allow (a bug in the dispatcher or driver)."""


@dataclass
class Child:
    """One process: what it was started for, what it holds, where it is in its life."""

    id: int
    kind: Kind
    devices: tuple[str, ...]
    #: Its claim on each device (a budget, or None: alone); no devices, no claim.
    need: int | None
    scope: str = ""
    key: str = ""
    #: A scope's tests still to run in it, in order (the first is the next).
    members: list[str] = field(default_factory=list)
    #: The test it was started for or runs now ("": none yet); ``last``: its last one.
    test: str = ""
    last: str = ""
    parent: int = 0
    #: Booted unclaimed, seeing ``seen``: ``devices`` stays empty until its go, which
    #: must give it ``seen`` if its boot initialized the driver (``bound``).
    deferred: bool = False
    seen: tuple[str, ...] = ()
    bound: bool = False
    state: State = State.STARTING
    since: float = 0.0
    #: When its current state ends by itself (None: an event will end it).
    deadline: float | None = None

    def move(self, to: State, now: float, deadline: float | None = None) -> None:
        if to not in ALLOWED[self.state]:
            raise Illegal(f"child {self.id} ({self.kind.value}): {self.state.value} -> {to.value}")
        self.state, self.since, self.deadline = to, now, deadline

    @property
    def alive(self) -> bool:
        """A process that may still touch its devices (not yet exited)."""
        return self.state not in (S.SETTLING, S.GONE)

    @property
    def holds(self) -> bool:
        """Its devices are still claimed (until it is gone)."""
        return bool(self.devices) and self.state is not S.GONE

    def describe(self) -> str:
        where = f" on gpu {','.join(self.devices)}" if self.devices else ""
        what = f" for {self.test}" if self.test else f" for {self.scope}" if self.scope else ""
        return f"child {self.id} ({self.kind.value}{what}){where}: {self.state.value}"
