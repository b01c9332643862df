"""What each test file's boot did to its devices, kept between runs in pytest's cache.

Runs in the parent. A child's boot (imports, its conftests, collecting its file) either
leaves the devices it sees untouched, initializes the driver (``cuInit``: a conftest
that calls ``torch.cuda.is_available()``), or makes a context (device memory). The
dispatcher lets a child boot without a claim only where its file is known not to make a
context (``dispatch.state.Run.boots``). A record holds while the file and the conftests
above it are unchanged (their modification times); records of files that are gone are
dropped when the run stores its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

CACHE_KEY = "spawnrun/boots"


def signature(path: str, root: Path) -> str:
    """The file's and its conftests' modification times ("" if it cannot be read)."""
    try:
        times = [Path(path).stat().st_mtime_ns]
    except OSError:
        return ""
    for parent in Path(path).parents:
        try:
            times.append((parent / "conftest.py").stat().st_mtime_ns)
        except OSError:
            pass
        if parent == root or parent == parent.parent:
            break
    return ":".join(str(t) for t in times)


def load(config: pytest.Config) -> tuple[tuple[str, str], ...]:
    """The records of files unchanged since they were made: (path, touched)."""
    cache = getattr(config, "cache", None)
    stored = cache.get(CACHE_KEY, {}) if cache is not None else {}
    if not isinstance(stored, dict):
        return ()
    out = []
    for path, record in stored.items():
        if not (isinstance(record, list) and len(record) == 2):
            continue
        touched, seen = record
        if isinstance(touched, str) and seen and seen == signature(path, config.rootpath):
            out.append((path, touched))
    return tuple(sorted(out))


def store(config: pytest.Config, boots: Mapping[str, str]) -> None:
    """Keep this run's records beside the earlier ones of files that still exist."""
    cache = getattr(config, "cache", None)
    if cache is None or not boots:
        return
    stored = cache.get(CACHE_KEY, {})
    stored = stored if isinstance(stored, dict) else {}
    merged = {p: r for p, r in stored.items() if Path(p).exists()}
    for path, touched in boots.items():
        seen = signature(path, config.rootpath)
        if seen:
            merged[path] = [touched, seen]
    cache.set(CACHE_KEY, merged)
