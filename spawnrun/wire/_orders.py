"""What the parent tells a child: its spec, the test it runs, when to run it, when to end.

Runs in both processes; imports nothing from the rest of spawnrun. ``ChildSpec`` is
everything a child is started with; ``Assign`` names the test of a child started before
it was known, ``Go`` runs a test and ``Stop`` ends a scope's child. ``Binding`` is one
parameter's value as the parent's test binds it (``_identity`` makes them).
``PROTOCOL_VERSION`` is the wire's version, in every spec.
"""

from __future__ import annotations

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
