"""What the dispatcher knows of a test, what it is told (events) and what it asks (actions).

Runs in the parent; plain frozen data, no I/O. The driver turns pipes, exits, NVML and
the xdist ledger into events; the dispatcher answers each with actions the driver
performs. Every event carries ``now`` (seconds on the driver's monotonic clock): the
dispatcher never reads a clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: A need that shares nothing (the same value as ``_packing.ALONE``).
ALONE = None
#: What a child's boot (imports, collection) did to the devices it could see
#: (``Booted.touched``; "": nothing): initialized the driver (``cuInit``, no memory on
#: a device), or made a context (device memory).
DRIVER = "driver"
CONTEXT = "context"


@dataclass(frozen=True)
class Test:
    """One spawned test as the dispatcher sees it: its plan, decided once at collection.

    ``scope``: tests of one scope share a child, in the order they were submitted ("": a
    child of its own); ``forked``: that child forks a fresh process for each of them (a
    file's template, fast mode), so one of them may run again in a child of its own.
    ``template``: its forks come from the template of that key (fast mode; "" none).
    ``key``: what a child started before the test was known must have been started with
    (arguments and environment) for the test to take it.
    """

    id: str
    count: int = 1
    need: int | None = ALONE
    every: bool = False
    scope: str = ""
    forked: bool = False
    template: str = ""
    timeout: float | None = None
    #: What earlier runs measured of its setup, call and teardown (seconds), for
    #: backfilling; None: unknown.
    duration: float | None = None
    #: Of the run's job slots, how many it takes while it runs: one, or as many as the
    #: cores an earlier run measured it keeping busy need (``_packing.cpu_slots``). One
    #: that needs more than there are runs with nothing else.
    slots: int = 1
    key: str = ""
    #: The file whose collection its child runs ("": the test's own id): what a boot of
    #: it touches (``Booted.touched``) says whether its children may boot unclaimed.
    file: str = ""


class Kind(enum.Enum):
    SPAWN = "spawned"
    SCOPE = "scope"
    EARLY = "started while collecting"
    TEMPLATE = "template"
    FORK = "fork"


class Outcome(enum.Enum):
    """How a test ended when its child could not report it (the driver words the report)."""

    CRASHED = "crashed"
    TIMEOUT = "timed out"
    START_FAILED = "could not start"
    STOPPED = "stopped"
    STUCK = "could not be run"
    UNFIT = "does not fit"


# Events ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    now: float


@dataclass(frozen=True)
class Submit(Event):
    """pytest reached the test: it may start (in submission order, within its scope)."""

    test: Test


@dataclass(frozen=True)
class Suite(Event):
    """Every spawned test of the run in the order pytest will reach them (collection's end).

    A scope's child is started for the scope's tests in this order; the tests after the
    last submitted one are booted ahead.
    """

    tests: tuple[Test, ...]


@dataclass(frozen=True)
class Expect(Event):
    """While collecting: a file's tests are likely spawned with ``key`` on ``count`` devices."""

    key: str
    count: int
    need: int | None = ALONE


@dataclass(frozen=True)
class Collected(Event):
    """Collection is over: children started for keys no test has are not needed."""

    keys: frozenset[str]


@dataclass(frozen=True)
class Booted(Event):
    """The child collected its test and waits for its go.

    ``touched``: what its boot did to the devices it saw ("", ``DRIVER``, ``CONTEXT``).
    """

    child: int
    touched: str = ""


@dataclass(frozen=True)
class StartFailed(Event):
    """The process could not be started or died before it booted (EMFILE, an import)."""

    child: int
    error: str


@dataclass(frozen=True)
class Refused(Event):
    """A template may not fork its tests (``why``): they get children of their own.

    Told of a scope's child: its scope is not shared after all (a file template that
    runs its own test); it runs the test it was started for, the scope's later tests
    get children of their own.
    """

    child: int
    why: str


@dataclass(frozen=True)
class Done(Event):
    """The child sent "done" for ``test``: its reports are complete.

    ``interrupt``: the test called ``pytest.exit`` or was interrupted; ``poisoned``: its
    failure says the process is broken, so a scope's child is replaced; ``more``: the
    child waits for its scope's next test (False: it exits by itself); ``again``: it
    failed where a guess of the run's may be to blame (a learned budget, its own or a
    neighbour's; a fork of a template): it runs again, once, in a child of its own
    (``Again``), and that run's reports count; ``alone``: with no budget (the guess was
    a budget), else with its own need (the guess was only the fork). ``failed``: one of
    its reports failed (a test that ran out of its order runs again after the tests
    before it; a failure may stop the session, so ``Settings.ordered`` replays nothing
    after it until the driver has told whether it did).
    """

    child: int
    test: str
    interrupt: bool = False
    poisoned: bool = False
    more: bool = True
    again: bool = False
    alone: bool = True
    failed: bool = False


@dataclass(frozen=True)
class Exited(Event):
    child: int
    code: int


@dataclass(frozen=True)
class Released(Event):
    """NVML lists none of the child's processes on its devices any more."""

    child: int


@dataclass(frozen=True)
class Peers(Event):
    """What other xdist workers hold now: (device, need) per claim."""

    claims: tuple[tuple[str, int | None], ...]


@dataclass(frozen=True)
class Denied(Event):
    """Another xdist worker claimed the devices of a child the dispatcher just started.

    The driver takes the ledger's claim as it performs ``Start``, before any process
    exists; when a peer got there first, nothing was started: the child is forgotten and
    its test waits again. A ``Peers`` with the ledger's claims comes in the same batch.
    """

    child: int


@dataclass(frozen=True)
class Next(Event):
    """The tests pytest will reach next, as far as it knows (an xdist worker's own
    order, which is not the collection's): booting ahead takes only these."""

    tests: tuple[str, ...]


@dataclass(frozen=True)
class Free(Event):
    """What NVML says is free on each device now (bytes; None: unknown), for admission."""

    free: tuple[tuple[str, int | None], ...]


@dataclass(frozen=True)
class Tick(Event):
    """Time passed (a deadline the dispatcher asked for, or the driver's poll)."""


@dataclass(frozen=True)
class Stop(Event):
    """The session stops (-x, --maxfail, an interrupt): nothing new starts.

    ``after``: the test whose report stopped it; the tests pytest reached before it run
    to their end, as in-process ("": none, an interrupt of the parent).
    """

    reason: str
    after: str = ""


@dataclass(frozen=True)
class Last(Event):
    """pytest submitted its last spawned test: no scope waits for more."""


# Actions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    pass


@dataclass(frozen=True)
class Start(Action):
    """Start a child on ``devices`` (fixed for its life), for ``test`` if known.

    A scope's child runs ``members`` in that order; an early child serves ``key``; a
    fork comes from the template child ``parent``. ``deferred``: it sees ``devices``
    (a guess) but claims none while it boots; its ``Go`` says its devices, claimed from
    then (others, if its boot left them untouched).
    """

    child: int
    kind: Kind
    devices: tuple[str, ...]
    test: str = ""
    scope: str = ""
    members: tuple[str, ...] = ()
    key: str = ""
    parent: int = 0
    deferred: bool = False


@dataclass(frozen=True)
class Go(Action):
    """The child runs ``test`` now (its timeout counts from here).

    ``devices``: the child's devices; for a deferred child, its first go assigns them
    (the driver sets its visibility variables before the test's setup, where they
    differ from what it saw).
    """

    child: int
    test: str
    devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Dismiss(Action):
    """The child gets no (more) tests: it tears down and exits."""

    child: int


@dataclass(frozen=True)
class Kill(Action):
    """End the child now (its stacks first, for a timeout)."""

    child: int
    reason: str


@dataclass(frozen=True)
class Replay(Action):
    """Replay the reports the child sent for the test: the test is over."""

    test: str


@dataclass(frozen=True)
class Report(Action):
    """The test is over without reports of its own: the driver makes one."""

    test: str
    outcome: Outcome
    detail: str = ""


@dataclass(frozen=True)
class Again(Action):
    """The test runs again in a child of its own (``alone``: alone on its devices, else
    with its own need): its reports so far are not replayed; those of its next child
    are (its ``Replay`` comes then). ``order``: it failed after it ran out of its
    collection order (backfilled, or past a gathered test): it runs again, alone, once
    every test before it has ended."""

    test: str
    alone: bool = True
    order: bool = False


@dataclass(frozen=True)
class Drop(Action):
    """The test will not run (the session stopped before it started): no report."""

    test: str


@dataclass(frozen=True)
class Warn(Action):
    test: str
    text: str


@dataclass(frozen=True)
class Interrupt(Action):
    """Stop the session as the test did (after the actions before it)."""

    test: str


@dataclass(frozen=True)
class Settings:
    """The dispatcher's limits, from the run's settings.

    ``jobs``: tests running at once; ``lookahead``: children booted ahead of their turn;
    ``early``: children started while collecting; ``capacity`` per device (None:
    unknown, so budgets run alone); ``exit_grace``: from "done" or a dismissal to a
    kill; ``kill_grace``: from a kill until the process is given up; ``settle``: how long
    a device waits for NVML to release an exited child's memory; ``poll``: how often a
    test waiting for another worker's devices looks again; ``patience``: waits longer
    than this get a warning once; ``defer``: children of files whose boot is known not
    to make a context boot unclaimed (``Start.deferred``); ``boots``: what earlier runs
    saw each file's boot touch (``Booted.touched``); ``backfill``: how many tests may
    wait in the queue past a head that waits for devices (0: pytest waits at the head, and
    nothing is backfilled); ``gather``: how many tests that need their devices alone may
    wait, passed over while their devices are busy, so that one drain serves them
    together (0: each drains its devices at its turn); ``ordered``: a failure may stop
    the session (``-x``, ``--maxfail``, ``--stepwise``), so nothing is replayed after a
    failure in the same batch (the driver tells ``Stop`` first, if it stopped the
    session), and nothing after a failure starts until it is told. Tests end to pytest
    in submission order whatever the settings: any test may stop the session
    (``pytest.exit``, KeyboardInterrupt), and nothing after it may have been reported.
    """

    devices: tuple[str, ...] = ("0",)
    capacity: tuple[tuple[str, int | None], ...] = ()
    per_gpu: int = 8
    reserve: int = 1 << 30
    jobs: int = 1
    lookahead: int = 0
    early: int = 0
    exit_grace: float = 20.0
    kill_grace: float = 5.0
    settle: float = 10.0
    poll: float = 0.05
    patience: float = 600.0
    defer: bool = False
    boots: tuple[tuple[str, str], ...] = ()
    backfill: int = 0
    gather: int = 0
    ordered: bool = False
