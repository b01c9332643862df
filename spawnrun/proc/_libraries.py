"""Which modules a process imported are third-party libraries (both sides).

Runs in the parent (the fast mode's automatic preload: what collection imported) and in
a child (what its test imported that its boot had not: learned preloads, ``_learned``).
Never a module below the rootdir (the suite, its conftests), except, for the automatic
preload, the project's own packages there (``project_dirs``: timm's ``timm/`` beside its
``tests/``); never the standard library (already cheap), never spawnrun, pytest or
``__main__``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Set
from pathlib import Path
from typing import Any


def library_modules(rootdir: Path, project: tuple[Path, ...] = ()) -> list[str]:
    """Third-party modules this process imported, in import order, and those of the
    ``project`` folders below the rootdir: the automatic preload."""
    return imported_since(None, rootdir, project)


def project_dirs(rootdir: Path, test_files: Set[Path]) -> tuple[Path, ...]:
    """The folders right below the rootdir whose imported modules are the project's own
    code, not the suite's: none of the run's test files lies in them, nor any conftest
    this process loaded (``kornia/`` and ``timm/`` beside their ``tests/``)."""
    root = str(rootdir)
    tops: set[str] = set()
    suite: set[str] = set()
    for test_file in test_files:
        top = _top_below(str(test_file.resolve()), root)
        if top is not None:
            suite.add(top)
    for module in list(sys.modules.values()):
        filename = getattr(module, "__file__", None)
        path = _real(filename) if isinstance(filename, str) else None
        if path is None:
            continue
        top = _top_below(path, root)
        if top is None:
            continue
        if os.path.basename(path).startswith("conftest"):
            suite.add(top)
        else:
            tops.add(top)
    return tuple(Path(top) for top in sorted(tops - suite))


def _top_below(path: str, root: str) -> str | None:
    """The folder right below ``root`` that holds the resolved ``path`` (None: it is not
    in one). Strings, not ``pathlib``: it is asked about each of ~1700 modules (torch's)
    between the parent's collection and its first test."""
    if not _inside(path, root):
        return None
    first, sep, _ = path[len(root.rstrip(os.sep)) + 1 :].partition(os.sep)
    return os.path.join(root, first) if sep else None


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies below it (both absolute and resolved)."""
    folder = folder.rstrip(os.sep) or os.sep
    return path == folder or path.startswith(folder if folder == os.sep else folder + os.sep)


#: Each module file's resolved path, and each folder's: a process with torch has ~1700
#: modules in ~200 folders, and resolving every path apart took ~0.1 s of the parent's
#: time between its collection and its first test.
_real_files: dict[str, str | None] = {}
_real_folders: dict[str, str] = {}


def real_path(filename: str) -> Path | None:
    """``Path(filename).resolve()``, resolving each folder once (None: it cannot be)."""
    path = _real(filename)
    return Path(path) if path is not None else None


def _real(filename: str) -> str | None:
    if filename in _real_files:
        return _real_files[filename]
    path: str | None
    try:
        if not filename or os.path.islink(filename):
            path = str(Path(filename).resolve()) if filename else None
        else:
            folder, name = os.path.split(os.path.abspath(filename))
            real = _real_folders.get(folder)
            if real is None:
                real = _real_folders[folder] = os.path.realpath(folder)
            path = os.path.join(real, name)
    except (OSError, ValueError):
        path = None
    _real_files[filename] = path
    return path


_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))
#: Top-level names that are never a library to preload, wherever they are found.
NOT_LIBRARIES = frozenset({"spawnrun", "__main__", "conftest", "pytest", "_pytest"})


def never_library(top: str) -> bool:
    """Whether top-level name ``top`` is the standard library, pytest or spawnrun."""
    return top in _STDLIB or top in NOT_LIBRARIES or top in sys.builtin_module_names


def origins(top: str) -> list[str] | None:
    """Where top-level module ``top``'s code comes from, resolved: its file, or a
    namespace package's folders (None: it is not found, or not from files).

    Found without running any of its code: only a top-level name is looked up (finding
    ``a.b`` would import ``a``), and the finders on ``sys.meta_path`` only locate it.
    """
    module = sys.modules.get(top)
    if module is not None:
        filename = getattr(module, "__file__", None)
        folders = getattr(module, "__path__", None)
    else:
        try:
            spec = importlib.util.find_spec(top)
        except Exception:  # noqa: BLE001 - any finder's failure: not found
            return None
        if spec is None:
            return None
        filename = spec.origin if spec.has_location else None
        folders = spec.submodule_search_locations
    paths = [filename] if isinstance(filename, str) else list(folders or [])
    found = [_real(p) for p in paths if isinstance(p, str) and os.path.isabs(p)]
    real = [p for p in found if p is not None]
    return real if real and len(real) == len(paths) else None


def outside(paths: list[str], rootdir: Path) -> bool:
    """Whether none of ``paths`` (resolved) lies below ``rootdir`` (resolved)."""
    return not any(_inside(p, str(rootdir)) for p in paths)


def is_library(module: Any, rootdir: Path, project: tuple[Path, ...] = ()) -> bool:
    name = getattr(module, "__name__", "") or ""
    top = name.partition(".")[0]
    if not name or top in _STDLIB or top in ("spawnrun", "__main__", "conftest"):
        return False
    if name.startswith("_pytest") or top == "pytest":
        return False  # pytest itself comes first, whole
    filename = getattr(module, "__file__", None)
    path = _real(filename) if isinstance(filename, str) else None
    if path is None:
        return False
    if os.path.basename(path).startswith("conftest"):
        return False
    if _inside(path, str(rootdir)):
        return any(_inside(path, str(folder)) for folder in project)
    return True


def imported_since(mark: Mark | None, rootdir: Path, project: tuple[Path, ...] = ()) -> list[str]:
    """Libraries this process imported since ``mark`` (None: ever), in import order."""
    names = added_since(mark) if mark is not None else list(sys.modules)
    return [n for n in names if is_library(sys.modules.get(n), rootdir, project)]


#: Where ``sys.modules`` stood: how many names it had, and the last of them.
Mark = tuple[int, str | None]


def mark() -> Mark:
    return len(sys.modules), next(reversed(sys.modules), None)


def added_since(mark: Mark) -> list[str]:
    """The names ``sys.modules`` got since ``mark``, in the order they came; where names
    were removed meanwhile, every name it has (a superset).

    ``sys.modules`` keeps names in the order they were added, so only the new ones are
    looked at: in a forked child, each name looked at is a page copied (a snapshot of
    torch's ~1700 names cost a fork 1.4 ms and 600 page faults).
    """
    count, last = mark
    added = []
    for name in reversed(sys.modules):
        if name == last:
            break
        added.append(name)
    if len(sys.modules) - count != len(added):
        return list(sys.modules)
    added.reverse()
    return added
