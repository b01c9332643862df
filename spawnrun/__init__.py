"""spawnrun: run GPU tests each in a fresh ``multiprocessing`` spawn child.

Runs in both processes. Keep this module tiny: the child imports it first.

PYTEST_DONT_REWRITE: a spawn child imports this package before pytest configures, so
pytest would warn that it cannot rewrite it (an error under ``filterwarnings = error``);
the plugin has no asserts that need rewriting.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "CHILD_ENV",
    "CallCrashed",
    "CallError",
    "CallFailed",
    "CallTimeout",
    "ChildTraceback",
    "call",
    "in_child",
    "is_child",
    "__version__",
]
#: Loaded on first use, so importing the package stays cheap: the functions from
#: ``spawnrun.calls._call``, the exceptions from ``spawnrun.calls._outcome``.
_CALL_FUNCTIONS = frozenset({"call", "in_child"})
_CALL_NAMES = _CALL_FUNCTIONS | {
    "CallCrashed",
    "CallError",
    "CallFailed",
    "CallTimeout",
    "ChildTraceback",
}

#: Set to ``"1"`` in the environment of every spawned test process.
CHILD_ENV = "SPAWNRUN_CHILD"


def is_child() -> bool:
    """Return True inside a test process started by spawnrun (and its descendants)."""
    return os.environ.get(CHILD_ENV) == "1"


def __getattr__(name: str) -> Any:
    # Lazy: importlib.metadata costs a few milliseconds we do not want per child.
    if name == "__version__":
        from importlib.metadata import version

        return version("spawnrun")
    if name in _CALL_NAMES:
        from spawnrun.calls import _call
        from spawnrun.calls import _outcome

        return getattr(_call if name in _CALL_FUNCTIONS else _outcome, name)
    raise AttributeError(name)
