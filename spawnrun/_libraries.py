"""Which modules a process imported are third-party libraries (both sides).

Runs in the parent (the fast mode's automatic preload: what collection imported) and in
a child (what its test imported that its boot had not: learned preloads, ``_learned``).
Never a module below the rootdir (the suite, its conftests), except, for the automatic
preload, the project's own packages there (``project_dirs``: timm's ``timm/`` beside its
``tests/``); never the standard library (already cheap), never spawnrun, pytest or
``__main__``.
"""

from __future__ import annotations

import sys
from collections.abc import Set
from pathlib import Path
from typing import Any


def library_modules(rootdir: Path, project: tuple[Path, ...] = ()) -> list[str]:
    """Third-party modules this process imported, in import order, and those of the
    ``project`` folders below the rootdir: the automatic preload."""
    return imported_since(frozenset(), rootdir, project)


def project_dirs(rootdir: Path, test_files: Set[Path]) -> tuple[Path, ...]:
    """The folders right below the rootdir whose imported modules are the project's own
    code, not the suite's: none of the run's test files lies in them, nor any conftest
    this process loaded (``kornia/`` and ``timm/`` beside their ``tests/``)."""
    tops: set[Path] = set()
    suite: set[Path] = set()
    for test_file in test_files:
        top = _top_below(test_file.resolve(), rootdir)
        if top is not None:
            suite.add(top)
    for module in list(sys.modules.values()):
        filename = getattr(module, "__file__", None)
        if not filename:
            continue
        try:
            path = Path(filename).resolve()
        except (OSError, ValueError):
            continue
        top = _top_below(path, rootdir)
        if top is None:
            continue
        if path.name.startswith("conftest"):
            suite.add(top)
        else:
            tops.add(top)
    return tuple(sorted(tops - suite))


def _top_below(path: Path, rootdir: Path) -> Path | None:
    """The folder right below ``rootdir`` that holds the resolved ``path`` (None: it is
    not in one)."""
    try:
        parts = path.relative_to(rootdir).parts
    except ValueError:
        return None
    return rootdir / parts[0] if len(parts) > 1 else None


_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))


def is_library(module: Any, rootdir: Path, project: tuple[Path, ...] = ()) -> bool:
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
    if path.name.startswith("conftest"):
        return False
    if path.is_relative_to(rootdir):
        return any(path.is_relative_to(folder) for folder in project)
    return True


def imported_since(before: Set[str], rootdir: Path, project: tuple[Path, ...] = ()) -> list[str]:
    """Libraries this process imported that were not in ``before``, in import order."""
    return [
        name
        for name, module in list(sys.modules.items())
        if name not in before and is_library(module, rootdir, project)
    ]
