"""What earlier runs measured of each test, in pytest's cache: its peak device memory
and how long it ran (from its go to its end: setup, call and teardown in its child).

Runs in the parent. ``--spawn-pack auto`` budgets a test from the peak an earlier run
recorded for it; the dispatcher backfills by durations (``dispatch.core``). The records
do not only grow: those of files that are gone are dropped, and so are those of tests
that a whole file's collection no longer yields (a test renamed or removed). A file
counts as wholly collected when the command line names it (or a folder above it) rather
than some of its tests, its collection did not fail, and ``--lf`` did not narrow it:
pytest then yields every test the file still has.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

#: Where learned peaks live in pytest's cache: node id -> bytes.
CACHE_PEAKS = "spawnrun/peaks"
#: Where learned durations live: node id -> seconds (setup, call and teardown).
CACHE_DURATIONS = "spawnrun/durations"
#: Where learned CPU loads live: node id -> the cores a test kept busy on average.
CACHE_LOADS = "spawnrun/cpu-loads"
#: Where learned preloads live: the third-party modules tests imported, in import order.
CACHE_PRELOADS = "spawnrun/preloads"
#: The most modules kept there.
MAX_PRELOADS = 3000
#: This run's tests' imports (``Done.imported``), in the order they were told.
IMPORTED_KEY = pytest.StashKey[dict[str, None]]()


def peaks(config: pytest.Config) -> dict[str, int]:
    """Peaks recorded by earlier runs, node id -> bytes."""
    return {k: int(v) for k, v in _load(config, CACHE_PEAKS).items() if isinstance(v, int)}


def durations(config: pytest.Config) -> dict[str, float]:
    """Durations recorded by earlier runs, node id -> seconds."""
    return {k: float(v) for k, v in _load(config, CACHE_DURATIONS).items()}


def loads(config: pytest.Config) -> dict[str, float]:
    """CPU loads recorded by earlier runs, node id -> cores."""
    return {k: float(v) for k, v in _load(config, CACHE_LOADS).items()}


def _load(config: pytest.Config, key: str) -> dict[str, int | float]:
    cache = getattr(config, "cache", None)
    stored = cache.get(key, {}) if cache is not None else {}
    if not isinstance(stored, dict):
        return {}
    ok = (int, float)
    return {
        str(k): v
        for k, v in stored.items()
        if isinstance(v, ok) and not isinstance(v, bool) and v >= 0
    }


def preloads(config: pytest.Config) -> list[str]:
    """The modules earlier runs' tests imported that their boots had not."""
    cache = getattr(config, "cache", None)
    stored = cache.get(CACHE_PRELOADS, []) if cache is not None else []
    if not isinstance(stored, list):
        return []
    return [str(m) for m in stored if isinstance(m, str) and m][:MAX_PRELOADS]


def saw_imports(config: pytest.Config, modules: list[str]) -> None:
    """A test's child imported ``modules`` (third-party, not imported by its boot)."""
    if modules:
        seen = config.stash.setdefault(IMPORTED_KEY, {})
        seen.update(dict.fromkeys(str(m) for m in modules))


def store_preloads(config: pytest.Config) -> None:
    """Keep the earlier runs' list with this run's new modules after it."""
    cache = getattr(config, "cache", None)
    seen = config.stash.get(IMPORTED_KEY, {})
    if cache is None or not seen:
        return
    old = preloads(config)
    merged = list(dict.fromkeys([*old, *seen]))[:MAX_PRELOADS]
    if merged != old:
        cache.set(CACHE_PRELOADS, merged)


class Collected:
    """The node ids this run's collection yielded, and the files it yielded wholly."""

    def __init__(self, config: pytest.Config) -> None:
        self.root = config.rootpath
        self.ids: set[str] = set()
        #: Files (as node ids spell them) whose collection ended, and those it failed in.
        self.files: set[str] = set()
        self.failed: set[str] = set()
        # --lf collects only the failed tests of a file that has some: never whole.
        self.narrowed = bool(config.getoption("lf", False))
        base = config.invocation_params.dir
        self.partial = {
            (base / str(arg).split("::")[0]).resolve() for arg in config.args if "::" in str(arg)
        }

    def item(self, nodeid: str) -> None:
        self.ids.add(nodeid)

    def report(self, report: pytest.CollectReport) -> None:
        file = report.nodeid.split("::")[0]
        (self.failed if report.failed else self.files).add(file)

    def whole(self, file: str) -> bool:
        """Whether this run's collection yielded every test the file has."""
        if self.narrowed or file in self.failed or file not in self.files:
            return False
        return (self.root / file).resolve() not in self.partial


def store(
    config: pytest.Config, key: str, measured: Mapping[str, float], collected: Collected | None
) -> None:
    """Keep this run's records beside the earlier ones that still name a test."""
    cache = getattr(config, "cache", None)
    if cache is None:
        return
    stored = cache.get(key, {})
    stored = stored if isinstance(stored, dict) else {}
    merged = {**stored, **measured}
    # By file, looked at once however many tests it has: (it exists, it was wholly collected).
    files: dict[str, tuple[bool, bool]] = {}
    kept = {}
    for nodeid, record in merged.items():
        file = str(nodeid).split("::")[0]
        if file not in files:
            whole = collected is not None and collected.whole(file)
            files[file] = ((config.rootpath / file).exists(), whole)
        exists, whole = files[file]
        if not exists:
            continue  # the file is gone
        if whole and collected is not None and nodeid not in collected.ids:
            continue  # the file's collection no longer yields this test
        kept[nodeid] = record
    if kept != stored:
        cache.set(key, kept)
