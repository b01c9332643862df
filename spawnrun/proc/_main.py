"""The parent's ``__main__`` module, as a spawned process sees it.

Runs in both. The parent describes its ``__main__`` (``describe``) each time it starts a
process; the process puts a module like it in ``sys.modules`` (``install``) before it
imports anything else of spawnrun, pytest or the suite. Forks (fast mode) inherit it.

multiprocessing's spawn would run the parent's main script again in the child (as
``__mp_main__``), which ``_runner.no_main_reimport`` prevents: a script that calls
``pytest.main()`` without a ``__main__`` guard would start a session in each child, and
the console script's re-import alone cost ~150 ms per child. Without this module the
child's ``__main__`` is then the bare module of its ``-c`` command line: no ``__file__``,
no ``__spec__``, no docstring. A test reads it: ``doctest.testmod()`` with no argument
tests ``__main__``; on Python 3.11 its ``inspect.getsourcefile(__main__)`` raises a
TypeError naming the module, whose repr then calls the deprecated
``BuiltinImporter.module_repr()``: a DeprecationWarning that plain pytest never gives.

What the child gets, without running any of the script: its name, docstring, file,
``__spec__``, ``__loader__``, ``__cached__``, ``__package__``, values of plain data
(numbers, strings, small containers of them), and, resolved on first access, what the
script bound to modules or to objects that a module names (``import re``, ``from _pytest.
config import _console_main``, ``from __future__ import annotations``): before the test
where their module is loaded by then (``settle``), else on first access. What only
running the script could make (its own functions and classes, other objects) is absent.
"""

from __future__ import annotations

import importlib
import pickle
import sys
import types
from typing import Any

#: Dunder names copied as they are (those that pickle: a spec and loader of importlib's).
_DUNDERS = ("__doc__", "__file__", "__cached__", "__package__", "__spec__", "__loader__")
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
#: Plain containers longer than this are left out: a script's data is not the child's
#: business, and each child start pays for what is described.
_MAX_ITEMS = 1000

#: In the child: names of ``__main__`` not resolved yet -> (module, qualified name).
_LATER: dict[str, tuple[str, str]] = {}


def _plain(value: Any) -> bool:
    """Numbers, strings, and containers of them (at most ``_MAX_ITEMS`` in all)."""
    todo, seen = [value], 0
    while todo:
        item = todo.pop()
        seen += 1
        if seen > _MAX_ITEMS:
            return False
        if isinstance(item, dict):
            todo += [*item.keys(), *item.values()]
        elif isinstance(item, (tuple, list, set, frozenset)):
            todo += item
        elif not isinstance(item, _SCALARS):
            return False
    return True


def _reference(value: Any) -> tuple[str, str] | None:
    """Where the child finds ``value`` by name (module, qualified name), if it can."""
    if isinstance(value, types.ModuleType):
        return value.__name__, ""
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        # A function or class of a module; not one of the script's own.
        if module != "__main__" and "<" not in qualname:
            return module, qualname
        return None
    # An instance that its class's module names (``__future__.annotations``).
    module = getattr(type(value), "__module__", None)
    source = sys.modules.get(module) if isinstance(module, str) else None
    if module != "__main__" and source is not None:
        for name, candidate in vars(source).items():
            if candidate is value:
                return module, name  # type: ignore[return-value]
    return None


def describe() -> bytes:
    """The parent's ``__main__``, as plain data for ``install`` ("" : none)."""
    main = sys.modules.get("__main__")
    if main is None:
        return b""
    eager: dict[str, Any] = {}
    later: dict[str, tuple[str, str]] = {}
    for name, value in list(vars(main).items()):
        if name in ("__name__", "__builtins__"):
            continue
        if name in _DUNDERS or _plain(value):
            try:
                eager[name] = pickle.dumps(value)
            except Exception:  # noqa: BLE001, S112 - a loader of its own: left out
                continue
            continue
        try:
            ref = _reference(value)
        except Exception:  # noqa: BLE001 - an object whose attributes raise: left out
            ref = None
        if ref is not None:
            later[name] = ref
    return pickle.dumps((eager, later))


class _Main(types.ModuleType):
    """``__main__`` in a spawned process: what the parent's script bound to another
    module's objects is looked up there on first access, as an import would have."""

    def __getattr__(self, name: str) -> Any:
        ref = _LATER.pop(name, None)
        if ref is None:
            raise AttributeError(f"module '__main__' has no attribute '{name}'")
        module, qualname = ref
        try:
            value: Any = importlib.import_module(module)
            for part in qualname.split(".") if qualname else ():
                value = getattr(value, part)
        except Exception as exc:  # noqa: BLE001 - the lookup failed: no such attribute
            raise AttributeError(f"module '__main__' has no attribute '{name}'") from exc
        setattr(self, name, value)
        return value

    def __dir__(self) -> list[str]:
        return sorted({*vars(self), *_LATER})


def settle() -> None:
    """Resolve now what needs no import (its module is loaded): before the test, so that
    ``vars(__main__)`` lists what the parent's does. The rest stays for first access."""
    main = sys.modules.get("__main__")
    if not isinstance(main, _Main):
        return
    for name, (module, _) in list(_LATER.items()):
        if module in sys.modules:
            getattr(main, name, None)


def install(description: bytes) -> None:
    """Make ``sys.modules["__main__"]`` the module that ``description`` describes."""
    if not description or isinstance(sys.modules.get("__main__"), _Main):
        return
    eager, later = pickle.loads(description)
    main = _Main("__main__")
    main.__builtins__ = sys.modules["builtins"]  # type: ignore[attr-defined]
    for name, data in eager.items():
        setattr(main, name, pickle.loads(data))
    _LATER.clear()
    _LATER.update(later)
    sys.modules["__main__"] = main
