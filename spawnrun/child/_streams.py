"""Seeded streams across spawnrun's forks: a fork draws what a spawned child would draw.

Runs in templates (the zygote, configured templates, a file's template) and in the
processes they fork; imports only the standard library. CPython reseeds ``random``'s
global generator in every child of ``os.fork`` (``random`` registers that at import), so
a conftest that calls ``random.seed(...)`` in ``pytest_configure`` and test files that
draw ``parametrize`` values from it at import gave a fork other ids than the parent
collected: a spawned child configures and collects itself, and draws the seeded values.

Rule: where code seeded the stream in this process with a value (``random.seed(v)``
or ``random.setstate`` since ``arm``, and no ``random.seed()`` from entropy since), each
fork we make starts from the exact state the template had when it forked; where nobody
seeded it, or the last seed came from entropy, the fork keeps CPython's fresh seed, as
a fresh interpreter has its own (tests that pick ports or names with ``random`` do not
collide).

numpy's global generator and torch's default (CPU) one are not reseeded by ``os.fork``:
a fork inherits them. A fresh interpreter seeds numpy's from the system's entropy as
numpy is imported, and torch's too where its build does (torch 2.13's; older builds
start every process from one fixed seed), so every spawned child draws other values,
while every fork of one template drew the same ones (kornia's unseeded
``torch.rand`` inputs: one test failed forked and passed spawned). So the same rule
holds for them: a generator still on the seed its import gave it, where that seed came
from entropy, is reseeded from entropy in each fork; one that code seeded
(``numpy.random.seed``/``set_state``; torch's ``manual_seed``, ``set_rng_state``, the
generator's own methods: its initial seed is then another) is inherited as it is. The
seed an import gave is read as the import ends (a finder on ``sys.meta_path`` from
``arm`` on), so nothing can seed it unseen between. Forks the tests make themselves are
left alone: ``disarm`` runs before a test's code does.
"""

from __future__ import annotations

import importlib.abc
import os
import random
import sys
from typing import Any

#: Whether forks of this process restore the seeded state (a template, before its test).
_armed = False
#: Whether code seeded ``random`` in this process since it was armed (inherited by forks).
_seeded = False
#: ``random``'s state taken just before a fork of ours, for the child to restore.
_before_fork: Any = None
_wrapped = False

#: torch's seed for a process that nobody seeded, where its build starts from a fixed one.
TORCH_FIXED_SEED = 67280421310721
#: torch's default generator's initial seed as its import left it, where that came from
#: entropy (None: not imported here since ``arm``, or a fixed seed: nothing to redraw).
_torch_fresh: int | None = None
#: Whether code seeded numpy's global generator since its import (with a value).
_numpy_seeded = False
#: Whether numpy was imported since ``arm`` (its seed then came from entropy here).
_numpy_watched = False
#: Whether this process's forks redraw the entropy seeds (set in ``_take``).
_redraw = False


def arm() -> None:
    """From now on, until ``disarm``: notice seeding, and carry it across forks."""
    global _armed, _wrapped
    _armed = True
    if _wrapped:
        return
    _wrapped = True
    for name in ("seed", "setstate"):
        setattr(random, name, _noticing(getattr(random, name), name))
    sys.meta_path.insert(0, _AfterImport())
    os.register_at_fork(before=_take, after_in_child=_restore, after_in_parent=_forget)


def disarm() -> None:
    """The test's own code runs next: forks it makes reseed as they would anywhere."""
    global _armed
    _armed = False


def _noticing(function: Any, name: str) -> Any:
    def noticed(*args: Any, **kwargs: Any) -> Any:
        global _seeded
        if _armed:
            # ``seed()`` or ``seed(None)`` draws from the system's entropy (a conftest's
            # "re-randomize" idiom): nobody's choice, so each fork draws its own again.
            _seeded = name == "setstate" or _chosen_seed(args, kwargs)
        return function(*args, **kwargs)

    noticed.__wrapped__ = function  # type: ignore[attr-defined]
    noticed.__doc__ = function.__doc__
    noticed.__name__ = function.__name__
    return noticed


def _chosen_seed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``seed`` call names a value (not None: entropy)."""
    value = args[0] if args else kwargs.get("a")
    return value is not None


def _take() -> None:
    global _before_fork, _redraw
    _before_fork = random.getstate() if _armed and _seeded else None
    _redraw = _armed


def _restore() -> None:
    # Registered after ``random``'s own reseed (imported first), so it runs after it.
    global _before_fork, _redraw
    if _before_fork is not None:
        random.setstate(_before_fork)
        _before_fork = None
    if _redraw:
        _redraw = False
        _redraw_entropy_seeds()


def _forget() -> None:
    global _before_fork, _redraw
    _before_fork = None
    _redraw = False


def _redraw_entropy_seeds() -> None:
    """In a fork of ours: numpy's and torch's generators that their import seeded from
    entropy, and nobody since, get a seed of their own, as a fresh interpreter's do."""
    global _torch_fresh
    torch = sys.modules.get("torch")
    if _torch_fresh is not None and torch is not None:
        generator = getattr(torch, "default_generator", None)
        if generator is not None and generator.initial_seed() == _torch_fresh:
            # The CPU generator only: CUDA's are made on first use in the fork, as in
            # a spawned child (a template never initializes CUDA).
            _torch_fresh = generator.seed()
    mtrand = sys.modules.get("numpy.random.mtrand")
    if _numpy_watched and not _numpy_seeded and mtrand is not None:
        mtrand._rand.seed()  # from entropy, as numpy's import does


def _torch_imported(torch: Any) -> None:
    global _torch_fresh
    generator = getattr(torch, "default_generator", None)
    if generator is None:
        return
    seed = generator.initial_seed()
    _torch_fresh = None if seed == TORCH_FIXED_SEED else seed
    if _torch_fresh is None:
        return
    original = torch.seed

    def seed_from_entropy() -> int:
        # A new entropy seed is still no one's choice: forks draw their own.
        global _torch_fresh
        value = original()
        if _torch_fresh is not None:
            _torch_fresh = torch.default_generator.initial_seed()
        return int(value)

    seed_from_entropy.__wrapped__ = original  # type: ignore[attr-defined]
    seed_from_entropy.__doc__ = original.__doc__
    torch.seed = seed_from_entropy
    random_module = sys.modules.get("torch.random")
    if random_module is not None and getattr(random_module, "seed", None) is original:
        setattr(random_module, "seed", seed_from_entropy)  # noqa: B010 - a module's name


def _numpy_imported(random_package: Any) -> None:
    global _numpy_watched
    _numpy_watched = True
    mtrand = sys.modules.get("numpy.random.mtrand")
    for module in (random_package, mtrand):
        if module is None:
            continue
        for name in ("seed", "set_state"):
            function = getattr(module, name, None)
            if function is not None and not hasattr(function, "__wrapped__"):
                setattr(module, name, _noticing_numpy(function, name))


def _noticing_numpy(function: Any, name: str) -> Any:
    def noticed(*args: Any, **kwargs: Any) -> Any:
        global _numpy_seeded
        # ``seed()`` without a value draws from entropy: still nobody's choice.
        chosen = (
            name == "set_state"
            or bool(args and args[0] is not None)
            or any(value is not None for value in kwargs.values())
        )
        if chosen:
            _numpy_seeded = True
        return function(*args, **kwargs)

    noticed.__wrapped__ = function  # type: ignore[attr-defined]
    noticed.__doc__ = function.__doc__
    noticed.__name__ = name
    return noticed


#: What to do once a module's import ended: name -> callback(module).
_AFTER: dict[str, Any] = {"torch": _torch_imported, "numpy.random": _numpy_imported}


def also_after(name: str, callback: Any) -> Any:
    """Run ``callback(module)`` too once ``name``'s import ends (after this module's own
    work), until the returned function is called. Only where armed (a template)."""
    before = _AFTER.get(name)

    def both(module: Any) -> None:
        if before is not None:
            before(module)
        callback(module)

    _AFTER[name] = both

    def undo() -> None:
        if _AFTER.get(name) is both:
            if before is None:
                del _AFTER[name]
            else:
                _AFTER[name] = before

    return undo


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``_AFTER``'s callback as soon as its module's import ends: finds the module
    as the finders after it would, then wraps that loader's ``exec_module`` for this one
    import (the loader and spec stay the module's own)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        after = _AFTER.get(fullname)
        if after is None or fullname in sys.modules:
            return None
        index = next((i for i, f in enumerate(sys.meta_path) if f is self), -1)
        spec = None
        for finder in sys.meta_path[index + 1 :]:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader: Any = getattr(spec, "loader", None)
        execute = getattr(loader, "exec_module", None)
        if execute is None:
            return spec
        try:

            def exec_module(module: Any) -> None:
                try:
                    execute(module)
                finally:
                    del loader.exec_module  # the loader's own again
                try:
                    after(module)
                except Exception:  # noqa: BLE001 - a seed left alone, never an import error
                    pass

            loader.exec_module = exec_module
        except (AttributeError, TypeError):
            return spec  # a loader that takes no attribute: left as it is
        return spec
