"""How the zygote's template imports libraries, and which of its imports the parent's
later ``sys.path`` or rewriting makes stale.

Runs in the zygote's template only (``_zygote``), never in the parent. While the
template imports: pytest's rewriting hook as the parent's pytest has it set up
(``rewriting``), the garbage collector paused (``collector_paused``) and an OpenMP
runtime loaded with its idle threads waiting passively (``openmp_waits_passively``).
Imports pytest (the template has imported it already) and nothing of spawnrun but the
protocol and ``_environ``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from _pytest.assertion.rewrite import AssertionRewritingHook

from spawnrun.child import _environ
from spawnrun.wire import _forking


@contextlib.contextmanager
def rewriting(hook: Any) -> Iterator[None]:
    """While importing: what pytest rewrites is rewritten, as the parent's pytest does.

    A plugin's package (hypothesis, xdist, jaxtyping...) is rewritten on import by a
    child's pytest, which warns about one imported before it, unless its loader is a
    rewriting hook (``mark_rewrite``'s check). Imported through such a hook here,
    marked and configured as in the parent, it is the same code the child would have
    made, and the child's pytest takes it as rewritten: a fork no longer imports and
    rewrites every plugin package again (seconds on an image without bytecode).
    """
    if hook is None:
        yield
        return
    sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(hook)  # the suite's modules are the child's pytest's


def rewrite_hook(rewrite: _forking.Rewrite) -> Any:
    """pytest's own import hook, with a stand-in for the two ini values it reads.

    pytest's internals: its rewriting hook has no public constructor, and its state
    key is where the hook looks for its trace.
    """
    from _pytest.assertion.rewrite import AssertionRewritingHook
    from _pytest.assertion.rewrite import assertstate_key

    class Config:
        def __init__(self) -> None:
            self.stash = pytest.Stash()
            state: Any = types.SimpleNamespace(trace=_no_trace)  # all the hook reads of it
            self.stash[assertstate_key] = state
            self.ini = {
                "python_files": list(rewrite.python_files),
                "enable_assertion_pass_hook": rewrite.pass_hook,
            }

        def getini(self, name: str) -> Any:
            return self.ini[name]

        def issue_config_time_warning(self, warning: Warning, stacklevel: int) -> None:
            pass  # a module imported before it was marked: the child's pytest warns

    hook = AssertionRewritingHook(Config())  # type: ignore[arg-type]
    hook.mark_rewrite(*rewrite.names)
    return hook


def _no_trace(*args: object) -> None:
    pass


#: What GNU OpenMP (libgomp) reads at its load for how its threads wait between
#: parallel regions; the user's own setting of either is left alone.
OPENMP_WAIT = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """While the template imports: no garbage collection. Each full collection walks every
    object imported so far, and an import of torch grows them from about 20 thousand to
    165 thousand: its collections took about 85 ms of the 0.77 s import, on a core the
    parent's own collection wants at that moment; one collection after it takes 40-60 ms.
    The forks collect as usual.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def openmp_waits_passively() -> Iterator[None]:
    """While the template imports: an OpenMP runtime loaded now (torch's libgomp) has its
    idle threads sleep instead of spinning, in the template and in every process forked
    from it; the environment is as it was afterwards, so tests never see the variable.

    libgomp reads the policy once, when it is loaded. Its threads spin for up to 300,000
    iterations between parallel regions when no policy is set: tests that each run
    torch's 16 threads side by side on 16 cores (timm's model tests building their
    models) spent their time spinning, a second run taking 48.7 s against plain
    pytest's 46.1 s; passive, 20.5 s against 34.4 s (plain itself 35.4 s passive). It
    changes no result, only how idle threads wait.
    """
    if any(name in os.environ for name in OPENMP_WAIT):
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _environ.OWN.add("OMP_WAIT_POLICY")  # ours, gone before any test: not the user's
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


def imported_plain(names: set[str]) -> str:
    """A module of ``names`` (or below one) imported from source without rewriting ("")."""
    for name, module in list(sys.modules.items()):
        if not any(name == n or name.startswith(n + ".") for n in names):
            continue
        spec = getattr(module, "__spec__", None)
        origin = getattr(spec, "origin", None) or ""
        rewritten = isinstance(getattr(module, "__loader__", None), AssertionRewritingHook)
        if origin.endswith(".py") and not rewritten:
            return name
    return ""


def found_elsewhere(path: list[str]) -> str:
    """A top-level module imported from a file that ``path`` finds another file for ("")."""
    from importlib.machinery import PathFinder

    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        origin = getattr(spec, "origin", None)
        if "." in name or not origin or not os.path.isabs(origin):
            continue
        try:
            found = PathFinder.find_spec(name, path)
        except (ImportError, ValueError, OSError):
            continue
        if found is not None and found.origin and found.origin != origin:
            return name
    return ""
