"""What the suite's files import at their top level, read, not run.

Runs in the parent, before collection: for the template started early and for the one
started at session start. Fast mode's template imports the libraries a test's child
would import (torch) ahead of the tests, so that a fork finds them imported. After
collection, what collection imported is known (``_forkserver``'s automatic preload);
what earlier runs imported is in pytest's cache (``_learned``). A first run, or one
without the cache, knows neither until the parent has collected, and the template then
imported torch only after the parent had (on two cores: the first test forked 0.9 s
after collection ended). Read from the files instead, before collection, the
template's imports overlap the parent's own.

Only names found outside the rootdir count (installed libraries, never the suite's own
modules), and only what a top-level ``import`` or ``from`` line names: the checks that
any preload passes (``_preloads.may_keep``) still apply, and a file read here that the
run then deselects only makes the template import what collection imports anyway.
"""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import glob
import importlib.util
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spawnrun.proc._libraries import real_path

#: At most this many test files are read (in the order collection would reach them),
#: in at most this many folders: a suite's files import much the same libraries.
MAX_FILES = 64
MAX_FOLDERS = 256
#: A top-level ``import a.b, c`` or ``from a.b import c`` line (not a relative import).
_IMPORT = re.compile(rb"^(?:import[ \t]+([\w. \t,]+)|from[ \t]+(\w[\w.]*)[ \t]+import\b)", re.M)


def conftest_imports(config: Any, rootdir: Path) -> list[str]:
    """The libraries the initial conftests import at their top level.

    The conftests pytest is about to load (in the rootdir and down to each directory the
    command line names, and the ``test*`` folders there) say what the parent will
    import first (torch).
    """
    base = config.invocation_params.dir
    folders: set[Path] = set()
    for arg in named_paths(config) or [str(base)]:
        path = (base / arg).resolve()
        folder = path if path.is_dir() else path.parent
        with contextlib.suppress(OSError):
            folders.update(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("test"))
        while folder.is_relative_to(rootdir):
            folders.add(folder)
            if folder == rootdir:
                break
            folder = folder.parent
    names: list[str] = []
    for folder in sorted(folders):
        try:
            tree = ast.parse((folder / "conftest.py").read_bytes())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.append(node.module)
    return _libraries(names, rootdir)


def test_file_imports(config: Any, rootdir: Path, args: list[str]) -> list[str]:
    """The libraries the first ``MAX_FILES`` test files under ``args`` import at their
    top level (a line scan: a file is not parsed)."""
    names: list[str] = []
    for path in _test_files(config, args):
        try:
            text = path.read_bytes()
        except OSError:
            continue
        for plain, source in _IMPORT.findall(text):
            if source:
                names.append(source.decode())
                continue
            for part in plain.decode().split(","):
                words = part.split()
                if words:
                    names.append(words[0])
    return _libraries(names, rootdir)


def named_paths(config: Any) -> list[str]:
    """The paths the command line names (before pytest has parsed it in full)."""
    return [str(a).split("::")[0] for a in config.known_args_namespace.file_or_dir or []]


def paths_to_collect(config: Any) -> list[str]:
    """What pytest will collect, before it has parsed its command line in full: the
    paths it names, else ``testpaths`` where pytest runs from the rootdir (as pytest
    takes them then), else the working directory."""
    named = named_paths(config)
    if named or Path(config.invocation_params.dir) != Path(config.rootpath):
        return named
    found: list[str] = []
    for pattern in config.getini("testpaths") or []:
        found += sorted(glob.glob(str(pattern), root_dir=config.rootpath)) or []
    return found


def _test_files(config: Any, args: list[str]) -> Iterator[Path]:
    """Test files under ``args`` (files, or folders walked in sorted order)."""
    patterns = [str(p) for p in config.getini("python_files")]
    skip = [str(p) for p in config.getini("norecursedirs")]
    base = Path(config.invocation_params.dir)
    files = folders = 0
    for arg in args or [str(base)]:
        path = base / arg.split("::")[0]
        if path.is_file():
            files += 1
            yield path
            continue
        for top, dirs, names in os.walk(path):
            folders += 1
            dirs[:] = sorted(d for d in dirs if not any(fnmatch.fnmatch(d, p) for p in skip))
            for name in sorted(names):
                if name.endswith(".py") and any(fnmatch.fnmatch(name, p) for p in patterns):
                    files += 1
                    yield Path(top, name)
                    if files >= MAX_FILES:
                        return
            if folders >= MAX_FOLDERS:
                break
        if files >= MAX_FILES or folders >= MAX_FOLDERS:
            return


def _libraries(names: list[str], rootdir: Path) -> list[str]:
    unique = list(dict.fromkeys(names))
    found = {top for top in {n.partition(".")[0] for n in unique} if found_outside(top, rootdir)}
    return [n for n in unique if n.partition(".")[0] in found]


def found_outside(top: str, rootdir: Path) -> bool:
    """Whether top-level module ``top`` is found outside the rootdir (not imported)."""
    if top in sys.stdlib_module_names or top in ("pytest", "_pytest", "spawnrun"):
        return False
    module = sys.modules.get(top)
    origin = getattr(module, "__file__", None)
    if module is None:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return False
        origin = spec.origin if spec is not None else None
    if not origin or not os.path.isabs(origin):
        return False
    path = real_path(origin)
    return path is not None and not path.is_relative_to(rootdir)
