"""Which modules a process imported are third-party libraries (both sides).

Runs in the parent (the fast mode's automatic preload: what collection imported) and in
a child (what its test imported that its boot had not: learned preloads, ``_learned``).
Never a module below the rootdir (the suite, its conftests, an editable install of the
project under test), never the standard library (already cheap), never spawnrun, pytest
or ``__main__``.
"""

from __future__ import annotations

import sys
from collections.abc import Set
from pathlib import Path
from typing import Any


def library_modules(rootdir: Path) -> list[str]:
    """Third-party modules this process imported, in import order: the automatic preload."""
    return imported_since(frozenset(), rootdir)


_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))


def is_library(module: Any, rootdir: Path) -> bool:
    name = getattr(module, "__name__", "") or ""
    top = name.partition(".")[0]
    if not name or top in _STDLIB or top in ("spawnrun", "__main__", "conftest"):
        return False
    if name.startswith("_pytest") or top == "pytest":
        return False  # pytest itself comes first, whole
    filename = getattr(module, "__file__", None)
    if not filename:
        return False
    try:
        path = Path(filename).resolve()
    except (OSError, ValueError):
        return False
    return not path.is_relative_to(rootdir) and not path.name.startswith("conftest")


def imported_since(before: Set[str], rootdir: Path) -> list[str]:
    """Libraries this process imported that were not in ``before``, in import order."""
    return [
        name
        for name, module in list(sys.modules.items())
        if name not in before and is_library(module, rootdir)
    ]
