"""Seeded streams across spawnrun's forks: a fork draws what a spawned child would draw.

Runs in templates (the zygote, configured templates, a file's template) and in the
processes they fork; imports only the standard library. CPython reseeds ``random``'s
global generator in every child of ``os.fork`` (``random`` registers that at import), so
a conftest that calls ``random.seed(...)`` in ``pytest_configure`` and test files that
draw ``parametrize`` values from it at import gave a fork other ids than the parent
collected: a spawned child configures and collects itself, and draws the seeded values.

Rule: where code seeded the stream in this process (``random.seed`` or
``random.setstate`` since ``arm``), each fork we make starts from the exact state the
template had when it forked; where nobody seeded it, the fork keeps CPython's fresh
seed, as a fresh interpreter has its own (tests that pick ports or names with
``random`` do not collide). numpy's and torch's generators are not reseeded by a fork:
a fork inherits them as they are, seeded or not. Forks the tests make themselves are
left alone: ``disarm`` runs before a test's code does.
"""

from __future__ import annotations

import os
import random
from typing import Any

#: Whether forks of this process restore the seeded state (a template, before its test).
_armed = False
#: Whether code seeded ``random`` in this process since it was armed (inherited by forks).
_seeded = False
#: ``random``'s state taken just before a fork of ours, for the child to restore.
_before_fork: Any = None
_wrapped = False


def arm() -> None:
    """From now on, until ``disarm``: notice seeding, and carry it across forks."""
    global _armed, _wrapped
    _armed = True
    if _wrapped:
        return
    _wrapped = True
    for name in ("seed", "setstate"):
        setattr(random, name, _noticing(getattr(random, name)))
    os.register_at_fork(before=_take, after_in_child=_restore, after_in_parent=_forget)


def disarm() -> None:
    """The test's own code runs next: forks it makes reseed as they would anywhere."""
    global _armed
    _armed = False


def _noticing(function: Any) -> Any:
    def noticed(*args: Any, **kwargs: Any) -> Any:
        global _seeded
        if _armed:
            _seeded = True
        return function(*args, **kwargs)

    noticed.__wrapped__ = function  # type: ignore[attr-defined]
    noticed.__doc__ = function.__doc__
    noticed.__name__ = function.__name__
    return noticed


def _take() -> None:
    global _before_fork
    _before_fork = random.getstate() if _armed and _seeded else None


def _restore() -> None:
    # Registered after ``random``'s own reseed (imported first), so it runs after it.
    global _before_fork
    if _before_fork is not None:
        random.setstate(_before_fork)
        _before_fork = None


def _forget() -> None:
    global _before_fork
    _before_fork = None
