"""The wire between parent and child: one frozen dataclass per message.

Runs in both processes; imports nothing from the rest of spawnrun. Messages travel
pickled over a ``multiprocessing`` pipe. Reports travel as the JSON-safe dicts of
``pytest_report_to_serializable`` so structured tracebacks survive.

Life of a child: it boots (imports, configures pytest, collects its node id) and
sends ``Booted``; it then waits for ``Go``, runs setup/call/teardown and streams
``Report`` / ``WarningRecord`` messages, then ``Interrupted`` if the test stopped the
session, and always ``Done`` last. EOF before ``Done`` means the child died.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class ChildSpec:
    """Everything a child needs to rebuild the parent's configuration and find its test."""

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
    protocol: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Booted:
    pid: int
    found: bool
    #: Why the node id was not found: collection errors, or the ids that were.
    problem: str = ""
    #: Non-empty when a device runtime (CUDA) got initialized while the child booted:
    #: then the devices it would get with ``Go`` can no longer apply.
    device_runtime: str = ""


@dataclass(frozen=True)
class Go:
    #: Environment to set before the test runs (CUDA_VISIBLE_DEVICES of a child that
    #: was booted ahead, before its devices were known).
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Report:
    data: dict[str, Any]


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


@dataclass(frozen=True)
class Done:
    notes: list[str] = field(default_factory=list)


Message = Booted | Report | WarningRecord | Interrupted | Done


# The zygote (``--spawn-method forkserver``) ---------------------------------------------


@dataclass(frozen=True)
class ZygoteSpec:
    """How to build the template: the parent's configuration, what to import first."""

    preload: list[str]
    option_dict: dict[str, Any]
    plugin_args: list[str]
    args: list[str]
    invocation_dir: str
    log_path: str


@dataclass(frozen=True)
class ZygoteReady:
    pid: int
    #: Non-empty when the template could not be built; the run then spawns.
    problem: str = ""


@dataclass(frozen=True)
class ForkRequest:
    """Fork a child for this test; its end of the pipe follows as a passed handle."""

    spec: ChildSpec
    env: dict[str, str]


@dataclass(frozen=True)
class Forked:
    pid: int


@dataclass(frozen=True)
class Refused:
    """The template will not fork (a device runtime is initialized in it): why."""

    reason: str


@dataclass(frozen=True)
class Exited:
    """A forked child ended; ``code`` as multiprocessing reports it (-N: signal N)."""

    pid: int
    code: int
