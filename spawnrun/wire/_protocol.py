"""The wire between parent and child: one frozen dataclass per message.

Runs in both processes; imports nothing from the rest of spawnrun. Messages travel
pickled over a ``multiprocessing`` pipe. Reports travel as the JSON-safe dicts of
``pytest_report_to_serializable`` so structured tracebacks survive.

Life of a child: it boots (imports, configures pytest, collects its node id; a child
started before its test was known reads ``Assign`` first) and sends ``Booted``; it then
waits for ``Go``, runs setup/call/teardown and streams ``Report`` / ``WarningRecord``
messages, then ``Interrupted`` if the test stopped the session, and always ``Done`` once
the test's teardown is over; ``After`` may follow with errors of the child's session end.
EOF before ``Done`` means the child died.

The parent decodes what a child sends with ``decode``, which builds the classes of this
module and plain data only: a child's message never makes the parent import anything.
The child sends test-made values (user properties, a report's extra attributes) as plain
data or as text (``plain``).
"""

from __future__ import annotations

import builtins
import io
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace
from typing import Any

PROTOCOL_VERSION = 8


@dataclass(frozen=True)
class Binding:
    """One parameter of the parent's test: how its value reads, and the value itself."""

    #: The value spelled without memory addresses or set order (``spellings``).
    spelling: str
    #: The value pickled, so that a child whose same id binds another value (drawn at
    #: random when the module was imported, say) runs with the parent's; b"" when it
    #: cannot travel, ``unsent`` saying why.
    value: bytes = b""
    unsent: str = ""


@dataclass(frozen=True)
class ChildSpec:
    """Everything a child needs to rebuild the parent's configuration and find its test."""

    #: The test to find ("": started before it was known, it waits for an ``Assign``).
    nodeid: str
    #: Positional args to collect: the test's file first, the parent's args on fallback.
    args: list[str]
    #: ``-p`` plugin arguments, given before anything else is parsed.
    plugin_args: list[str]
    #: The parent's ``config.option`` values that survive pickling, with overrides.
    option_dict: dict[str, Any]
    invocation_dir: str
    #: Where the child sends its stdout/stderr; None streams them to the terminal.
    log_path: str | None
    #: Where faulthandler writes the stacks of a dying or timed-out child.
    stacks_path: str
    #: What the parent's test with this node id binds (``bindings``), by parameter: the
    #: child must run the same test, not merely the same id.
    params: dict[str, Binding] = field(default_factory=dict)
    #: pytest-xdist's ``config.workerinput`` of the worker that runs the test, so the
    #: child looks like that worker (``worker_id``, ``testrun_uid``, no cache writes).
    workerinput: dict[str, Any] | None = None
    #: Option values of types the suite defines, pickled: decoded after conftests load.
    late_options: dict[str, bytes] = field(default_factory=dict)
    #: Executions of the test before this child's (a crash rerun by pytest-rerunfailures).
    executions: int = 0
    #: The junit family of the junitxml file the parent writes ("": none), for the
    #: fixtures that feed it from the child.
    junit_family: str = ""
    #: The configuration of the parent's coverage, serialized ("": not measured): the
    #: child measures itself with it (``_coverage``).
    coverage: str = ""
    #: The tests of its scope after this one, in order (``--spawn-scope``): the child
    #: keeps their fixtures up between them and runs each when a ``Go`` names it.
    then: list[str] = field(default_factory=list)
    #: A template of its file (fast mode): it runs none of them itself but forks, per
    #: test, a fresh process from what it collected, where that is safe.
    fork_each: bool = False
    #: The parent's collection found CUDA available (``_availability``): the child
    #: answers ``torch.cuda.is_available()`` so while it collects, not the driver.
    cuda_available: bool = False
    #: What ``torch.__config__.show()`` said in the parent, where its collection had
    #: initialized the driver (``_availability``): the child answers it so while it
    #: collects, for devices it sees (None: torch's own).
    torch_config: str | None = None
    #: The run has no devices: a template's fork that said "done" holds none while it
    #: exits, and the next one is forked meanwhile (``_template``).
    deviceless: bool = False
    #: The parent's own arguments (fast mode, unless ``--spawn-template library``): a
    #: configured template (``_configured``) is configured with them once, as the
    #: parent was, and each of its forks collects ``args``. Empty: none may serve it.
    run_args: list[str] = field(default_factory=list)
    protocol: int = PROTOCOL_VERSION


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
class Assign:
    """The test of a child started before its test was known (``ChildSpec.nodeid`` "").

    It is sent before the child has finished collecting; the child reads it once it
    has, and then looks for its test as any child does. Its fields are the
    ``ChildSpec`` fields of the same names.
    """

    nodeid: str
    params: dict[str, Binding] = field(default_factory=dict)
    then: list[str] = field(default_factory=list)
    executions: int = 0
    fork_each: bool = False

    def onto(self, spec: ChildSpec) -> ChildSpec:
        """``spec`` as the child's spec for this test."""
        return replace(
            spec,
            nodeid=self.nodeid,
            params=self.params,
            then=self.then,
            executions=self.executions,
            fork_each=self.fork_each,
        )


@dataclass(frozen=True)
class Go:
    """Run the test now.

    A child's devices are in its environment from its start; what travels here is only
    how the parent's own environment changed since the child booted (an in-process test
    or fixture may have set a variable), applied before setup.
    """

    env_set: dict[str, str] = field(default_factory=dict)
    env_unset: list[str] = field(default_factory=list)
    #: The test to run ("": the child's first, ``ChildSpec.nodeid``); a later one of its
    #: scope after a ``Done`` with ``more``.
    nodeid: str = ""
    #: What the parent's test of that id binds (``ChildSpec.params``).
    params: dict[str, Binding] = field(default_factory=dict)


@dataclass(frozen=True)
class Stop:
    """No more tests for this child: tear its scope's fixtures down and end."""


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


# The zygote (``--spawn-method forkserver``) ---------------------------------------------


@dataclass(frozen=True)
class Rewrite:
    """How the parent's pytest rewrites asserts: the template imports plugins the same way.

    ``names``: the modules and packages marked for rewriting (plugins, ``-p`` modules,
    ``register_assert_rewrite``); the two ini values the rewriter reads.
    """

    names: list[str]
    python_files: list[str]
    pass_hook: bool


@dataclass(frozen=True)
class ZygoteSpec:
    """How to build the template: which library modules to import, nothing of the suite."""

    modules: list[str]
    invocation_dir: str
    log_path: str
    #: Import what pytest would rewrite rewritten, as the children's pytest would (None:
    #: the parent's pytest rewrites nothing, or cannot be read; such modules are left out).
    rewrite: Rewrite | None = None


@dataclass(frozen=True)
class Preload:
    """Import these modules too (what the parent's collection imported), in this order.

    A template that started early (``_headstart``) is told the parent's ``path``
    (``sys.path``) and ``rewrite`` as they are once the conftests are loaded; it answers
    ``stale`` if what it imported before would now be different.
    """

    modules: list[str]
    path: list[str] | None = None
    rewrite: Rewrite | None = None
    #: Only pytest's cache named these (learned preloads): the template says when it
    #: starts each package (``Importing``), and the parent gives up on one that takes
    #: too long.
    learned: bool = False
    #: Of ``modules``, those that tests imported in their bodies last time, where no
    #: conftest, plugin or test file's import line names them: what they read of the
    #: environment at import, a spawned child reads after its fixtures (``_environ.LATE``).
    late: frozenset[str] = frozenset()
    #: The parent's collection found CUDA available (``_availability.in_parent``), and
    #: torch's build configuration as it said it: the template answers with them while
    #: it imports (``_availability.WhileImporting``).
    cuda_available: bool = False
    torch_config: str | None = None


@dataclass(frozen=True)
class Importing:
    """The template starts importing top-level package ``top`` of a learned ``Preload``
    at ``at`` (``time.monotonic()``: one clock for every process of the machine); ""
    when it is done with them."""

    top: str
    at: float


@dataclass(frozen=True)
class ZygoteReady:
    """The template imported what it was asked to (answer to the spec and to ``Preload``)."""

    pid: int
    #: Non-empty when the template cannot fork safely any more; the run then spawns.
    problem: str = ""
    #: The top-level package whose import made it unsafe (a device runtime or a thread
    #: came up), when one did; "" otherwise.
    culprit: str = ""
    #: Modules that failed to import (name and error): children import them themselves.
    failed: list[str] = field(default_factory=list)
    #: The culprit and every top-level package its import brought in.
    suspects: list[str] = field(default_factory=list)
    #: Non-empty when a module the template imported early would now be another (found
    #: elsewhere first on the parent's ``sys.path``, or marked for rewriting since): the
    #: parent builds a template from scratch.
    stale: str = ""
    #: Set by the parent, never sent: it gave up on the template while it imported the
    #: learned preload ``culprit`` (``_forkserver.LEARNED_LIMIT``).
    slow: bool = False


@dataclass(frozen=True)
class ForkRequest:
    """Fork a child for this test with this environment; its pipe end follows as a handle.

    ``env`` is the parent's whole environment as it is now, with the child's devices and
    marks; ``unset`` the variables the parent removed since the template started.
    """

    spec: ChildSpec
    env: dict[str, str]
    unset: list[str] = field(default_factory=list)
    #: Whether the child's output streams live (``-s``): the parent's stdout and stderr
    #: follow as two more passed handles either way.
    live: bool = False


@dataclass(frozen=True)
class Prime:
    """Configure a template for tests like ``request``'s before the first of them comes.

    Sent while the parent still collects: a fork request like the first spawned test's
    (its devices guessed), no pipe ends follow and nothing is forked for it. No answer.
    """

    request: ForkRequest
    #: The first test of its kind waits for it (few cores), rather than configuring
    #: pytest itself beside it.
    wait: bool = False


@dataclass(frozen=True)
class Forked:
    pid: int


@dataclass(frozen=True)
class Refused:
    """The template will not fork (a device runtime or another thread runs in it): why."""

    reason: str


@dataclass(frozen=True)
class Declined:
    """The template will not fork *this* test: what its imports read of the environment
    differs from the test's (``_environ``); it is spawned. ``package``: who read it."""

    reason: str
    package: str = ""


@dataclass(frozen=True)
class Configured:
    """A configured template configured pytest and started its session (to the zygote).

    ``refusal``: why it may not fork (a conftest started a thread or a device runtime);
    the zygote then forks those tests itself, as before.
    """

    pid: int
    refusal: str = ""


@dataclass(frozen=True)
class Retire:
    """To a configured template: fork no more; leave once your children have ended."""


@dataclass(frozen=True)
class Exited:
    """A forked child ended; ``code`` as multiprocessing reports it (-N: signal N)."""

    pid: int
    code: int


# Decoding and plain data ------------------------------------------------------------

#: What a message may be built of besides the classes of this module: the builtins that
#: pickle by name (sets, tuples, dicts and the rest have opcodes of their own).
_WIRE_BUILTINS = frozenset({"complex", "bytearray", "frozenset", "set"})


class _WireUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and isinstance(globals().get(name), type):
            cls = globals()[name]
            if getattr(cls, "__dataclass_fields__", None) is not None:
                return cls
        if module == "builtins" and name in _WIRE_BUILTINS:
            return getattr(builtins, name)
        raise pickle.UnpicklingError(
            f"it holds a {module}.{name}, which is not part of spawnrun's protocol "
            "(the parent imports nothing a child names)"
        )


def decode(data: bytes) -> Any:
    """A message from its pickle, made of this module's classes and plain data only."""
    msg = _WireUnpickler(io.BytesIO(data)).load()
    if getattr(type(msg), "__dataclass_fields__", None) is None or type(msg).__module__ != __name__:
        raise pickle.UnpicklingError(f"it is a {type(msg).__qualname__}, not a message")
    return msg


_PLAIN_LEAVES = (str, int, float, bool, type(None), bytes)
#: Deeper than this, a value travels as its repr (a structure that contains itself).
_PLAIN_DEPTH = 64


def plain(value: Any, text: Any = repr, depth: int = 0) -> Any:
    """``value`` as data any Python reads without imports: containers of plain leaves.

    A leaf of another type (a tensor, an instance of a class of the test's) becomes
    ``text(value)``; ``str`` subclasses become plain strings, tuple and list subclasses
    (named tuples) plain tuples and lists, mapping keys strings.
    """
    kind = type(value)
    if kind in _PLAIN_LEAVES:
        return value
    if depth < _PLAIN_DEPTH:
        if isinstance(value, dict):
            return {
                k if type(k) is str else _text(k, repr): plain(v, text, depth + 1)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [plain(v, text, depth + 1) for v in value]
        if isinstance(value, tuple):
            return tuple(plain(v, text, depth + 1) for v in value)
        if isinstance(value, str):
            return str.__str__(value)
    return _text(value, text)


def _text(value: Any, text: Any) -> str:
    for how in (text, repr):
        try:
            made = how(value)
        except Exception:  # noqa: BLE001 - a broken __str__ / __repr__ of the test's
            continue
        if type(made) is str:
            return made
        if isinstance(made, str):
            return str.__str__(made)
    return f"<unrepresentable {type(value).__qualname__}>"


# The size of what a child sends ------------------------------------------------------------

#: A child's message whose pickle is larger is cut before it is sent (``frame``): the
#: parent holds each child's message whole until it has arrived.
MESSAGE_LIMIT = 16 * 2**20
#: In a message being cut, a text keeps its last this many characters, and a list, tuple
#: or mapping its first this many entries.
CUT_TEXT = 64 * 1024
CUT_ITEMS = 1000


def frame(msg: Any) -> bytes:
    """``msg``'s pickle, from its plain data cut where the whole is over MESSAGE_LIMIT.

    A report whose traceback explains a 30 MB string, or a test that records a huge
    property, still reaches the parent, with the marker ``[spawnrun: ... cut`` where
    something was cut. Values over the limit without one long text or sequence (which
    nothing a test makes is) travel as they are, and the parent refuses them.
    """
    data = pickle.dumps(msg)
    if len(data) <= MESSAGE_LIMIT:
        return data
    fields = {f: _cut(getattr(msg, f), len(data)) for f in msg.__dataclass_fields__}
    return pickle.dumps(replace(msg, **fields))


def _cut(value: Any, size: int) -> Any:
    kind = type(value)
    if kind is str and len(value) > CUT_TEXT:
        cut = len(value) - CUT_TEXT
        return (
            f"[spawnrun: {cut} characters cut from a message of {size} bytes, over the "
            f"{MESSAGE_LIMIT} sent; the last {CUT_TEXT} follow]\n" + value[cut:]
        )
    if kind is dict:
        items = list(value.items())
        out = {k: _cut(v, size) for k, v in items[:CUT_ITEMS]}
        if len(items) > CUT_ITEMS:
            out["spawnrun"] = f"[spawnrun: {len(items) - CUT_ITEMS} entries cut]"
        return out
    if kind in (list, tuple):
        out_items = [_cut(v, size) for v in value[:CUT_ITEMS]]
        if len(value) > CUT_ITEMS:
            out_items.append(f"[spawnrun: {len(value) - CUT_ITEMS} entries cut]")
        return out_items if kind is list else tuple(out_items)
    return value


# Identity of a test across the process boundary ------------------------------------------

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


#: A parameter value whose pickle is larger stays in the parent (``Binding.unsent``).
VALUE_LIMIT = 4 * 2**20


def spellings(item: Any) -> dict[str, str]:
    """What a collected test binds, by parameter, comparable between two interpreters.

    A node id names a test, but ids built from unordered data (a set, whose order
    follows the hash seed), from values drawn at random when a module is imported, or
    from collection-time state (a counter in ``pytest_generate_tests``) can bind other
    values in a child that collected anew. The parameters' values, spelled in a way
    that does not depend on memory addresses or set order, tell them apart.
    """
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return {}
    return {str(k): _stable(v) for k, v in callspec.params.items()}


def bindings(item: Any) -> dict[str, Binding]:
    """The parent's side of ``spellings``, each value pickled where it can travel."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return {}
    out = {}
    for name, value in callspec.params.items():
        data, unsent = b"", ""
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - whatever a value's reducer raises
            unsent = f"it does not pickle ({type(exc).__name__}: {exc})"
        if len(data) > VALUE_LIMIT:
            data, unsent = b"", f"its pickle has {len(data)} bytes, over {VALUE_LIMIT} sent"
        out[str(name)] = Binding(_stable(value), data, unsent)
    return out


def describe(spelled: Mapping[str, str]) -> str:
    return "; ".join(f"{k}={v}" for k, v in sorted(spelled.items()))


def _stable(value: Any) -> str:
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_stable(v) for v in value)) + "}"
    if isinstance(value, dict):
        items = sorted(f"{_stable(k)}: {_stable(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_stable(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - an unrepresentable value compares by type
        text = f"<{type(value).__qualname__}>"
    return _ADDRESS.sub("", text)
