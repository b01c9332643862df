"""A test's identity across the process boundary: what its parameters bind.

Runs in both processes: the parent pickles what its test binds into the child's spec
(``bindings``), the child compares what the test it collected binds (``spellings``).
Imports only ``_orders`` of spawnrun (``Binding``).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from typing import Any

from spawnrun.wire import _orders

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


def bindings(item: Any) -> dict[str, _orders.Binding]:
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
        out[str(name)] = _orders.Binding(_stable(value), data, unsent)
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
