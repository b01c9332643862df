"""The zygote's messages (``--spawn-method forkserver``): parent, zygote, configured templates.

Runs in the parent, the zygote and its configured templates; imports only ``_orders`` of
spawnrun (a fork request carries a ``ChildSpec``). The parent sends the template its
spec (``ZygoteSpec``) and preloads, then a ``ForkRequest`` per test; the template answers
with ``ZygoteReady``, ``Forked``, ``Refused`` or ``Declined``, and tells ``Exited`` of the
children it forked.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

from spawnrun.wire import _orders


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

    spec: _orders.ChildSpec
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
