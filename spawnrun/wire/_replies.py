"""What a child tells the parent as its test goes: booted, phases, reports, done.

Runs in both processes; imports nothing from the rest of spawnrun. Every message a
child (or a template's fork, or the template about its forks) sends its parent is one of
``Message``; the parent decodes them with ``_protocol.decode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any


@dataclass(frozen=True)
class Booted:
    pid: int
    found: bool
    #: Why the node id was not found: collection errors, or the ids that were.
    problem: str = ""
    #: The child's pytest failed before it looked for the test (a conftest's hook
    #: raised, say): another collection would fail alike, so none is tried.
    failed: bool = False
    #: Asked to be a template (``fork_each``) but forking it is unsafe: why. It then
    #: runs its one test itself and ends.
    not_a_template: str = ""
    #: Seconds it waited, collected, to be told its test (``Assign``): not boot time.
    waited: float = 0.0
    #: What its boot did to the devices it saw (``_probe.boot_touch``).
    touched: str = ""


@dataclass(frozen=True)
class Phase:
    """The child enters a phase of its test (setup, call, teardown).

    Reports can arrive late (pytest-rerunfailures logs an attempt's reports after its
    teardown): the phase a child died in is the one it entered last, not the one after
    its last report.
    """

    when: str


@dataclass(frozen=True)
class Report:
    data: dict[str, Any]
    #: Made but not yet logged when the next phase began (a plugin logs the reports of
    #: an execution at its end): stands for its phase if the child dies first.
    pending: bool = False
    #: What reached the child's terminal since its previous report (or the go): the
    #: parent prints it just before this report, as pytest would have.
    terminal: str = ""
    #: The failure was a rendering, not a traceback (a doctest's): pytest sends it as
    #: text, which the parent turns back into a rendering (no one-line message).
    rendered: bool = False


@dataclass(frozen=True)
class WarningRecord:
    message: str
    category_module: str
    category_name: str
    filename: str
    lineno: int
    nodeid: str
    when: str


@dataclass(frozen=True)
class Interrupted:
    """The test called ``pytest.exit()`` or raised KeyboardInterrupt."""

    keyboard: bool
    message: str
    returncode: int | None = None
    #: Where a KeyboardInterrupt was raised (what pytest prints under its banner).
    path: str = ""
    lineno: int = 0


@dataclass(frozen=True)
class Done:
    notes: list[str] = field(default_factory=list)
    #: What reached the child's terminal after its last report (see ``Report``): its
    #: pytest's lines (``--setup-show``, live logs) and output that bypassed capture.
    terminal: str = ""
    #: Peak device memory of the test's process in bytes (torch's caching allocator,
    #: reserved, on all its devices), when torch had initialized CUDA in it; else None.
    peak_device_bytes: int | None = None
    #: The most torch reserved on any one of its devices (what a budget caps).
    peak_per_device: int | None = None
    #: The child waits for another test of its scope (a ``Go`` naming it, or ``Stop``).
    more: bool = False
    #: With ``more``: what torch still has allocated on its devices after the test.
    held_bytes: int | None = None
    #: JAX's own peak on its fullest device (``_probe.jax_peak``), where JAX started a
    #: GPU backend in it: NVML's figure for it counts the pool JAX preallocated.
    jax_peak: int | None = None
    #: Third-party modules the test imported that its boot had not (in import order):
    #: what a later run's template preloads (``_learned.preloads``).
    imported: list[str] = field(default_factory=list)
    #: The cores its setup, call and teardown kept busy on average (its process's CPU
    #: time, its threads' and waited-for children's, over its wall time); None where it
    #: ran too briefly to tell.
    cpu_load: float | None = None
    #: Why the test's outcome in this fork may not be a spawned child's ("": none
    #: known): it wrote a variable the template's imports had read (``_environ``).
    doubt: str = ""


@dataclass(frozen=True)
class SuiteProperty:
    """``record_testsuite_property(name, value)`` called in the child: for junitxml."""

    name: str
    value: str


@dataclass(frozen=True)
class XmlAttribute:
    """``record_xml_attribute(name, value)`` called in the child: for junitxml."""

    name: str
    value: str


@dataclass(frozen=True)
class After:
    """Errors the child met after its "done" (session finish, unconfigure)."""

    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ForkedTest:
    """A template forked this process to run the test (its first message)."""

    pid: int


#: After its "done", how long a template's fork may take to exit before the template
#: kills it (a child of its own gets as long: ``_ending.EXIT_KILL``).
FORK_EXIT_LIMIT = 20.0


@dataclass(frozen=True)
class ForkEnded:
    """A template's fork that said "done" is gone (told before the template forks again).

    ``code``: its exit status; ``killed``: it did not exit within ``FORK_EXIT_LIMIT``
    (a non-daemon thread, an ``atexit`` handler) and the template killed it.
    """

    pid: int
    code: int
    killed: bool = False
    #: Its test ("": the one the parent hears now, or the one before it).
    nodeid: str = ""


@dataclass(frozen=True)
class LeftRunning:
    """Processes the test's process still had below it as it left, which it then ended
    (``_leftovers``): some of them named, and all their pids."""

    nodeid: str
    processes: list[str]
    pids: list[int]


Message = (
    Booted
    | ForkedTest
    | ForkEnded
    | LeftRunning
    | Phase
    | Report
    | WarningRecord
    | Interrupted
    | Done
    | After
    | SuiteProperty
    | XmlAttribute
)
