"""What earlier runs measured of each test, in pytest's cache: its peak device memory
and how long it ran (from its go to its end: setup, call and teardown in its child).

Runs in the parent. ``--spawn-pack auto`` budgets a test from the peak an earlier run
recorded for it; the dispatcher backfills by durations (``dispatch.starts``). The records
do not only grow: those of files that are gone are dropped, and so are those of tests
that a whole file's collection no longer yields (a test renamed or removed). A file
counts as wholly collected when the command line names it (or a folder above it) rather
than some of its tests, its collection did not fail, and ``--lf`` did not narrow it:
pytest then yields every test the file still has.

It also keeps the modules fast mode's template imports (learned preloads, the last
template's modules). Those are read as guesses, never trusted: ``check_modules`` keeps
only dotted names of installed libraries found outside the rootdir, and ``check_cache``
drops the rest from the cache and says so.
"""

from __future__ import annotations

import contextlib
import keyword
import math
import os
from collections.abc import Collection
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from spawnrun.proc import _libraries
from spawnrun.wire import _reports

#: Where learned peaks live in pytest's cache: node id -> bytes.
CACHE_PEAKS = "spawnrun/peaks"
#: Where learned durations live: node id -> seconds (setup, call and teardown).
CACHE_DURATIONS = "spawnrun/durations"
#: Where learned CPU loads live: node id -> the cores a test kept busy on average.
CACHE_LOADS = "spawnrun/cpu-loads"
#: Where learned preloads live: the third-party modules tests imported, in import order.
CACHE_PRELOADS = "spawnrun/preloads"
#: Where the library modules the last run's template imported live (``_headstart``).
CACHE_TEMPLATE_MODULES = "spawnrun/template-modules"
#: The most modules kept there.
MAX_PRELOADS = 3000
#: The longest module name taken from the cache.
MAX_NAME = 200

#: Why a name the cache gives is not imported (``check_modules``).
NOT_A_LIST = "not a list of module names"
NOT_A_NAME = "not a module name"
NOT_A_LIBRARY = "the standard library, pytest or spawnrun"
IN_ROOTDIR = "a module of the rootdir"
NOT_INSTALLED = "not found installed"
TOO_MANY = f"past the first {MAX_PRELOADS} names"
DROPPED = (
    "spawnrun: fast mode's template does not import what pytest's cache names but is no "
    "installed library, and the cache forgets it: {dropped}"
)
#: The names listed in that warning, at most, by key.
MAX_LISTED = 12
#: This run's tests' imports (``Done.imported``), in the order they were told.
IMPORTED_KEY = pytest.StashKey[dict[str, None]]()


#: What each learned record may be: its type, and the largest value taken (1 PiB of
#: device memory, about 115 days, 4,096 cores). Anything else (``Infinity``, a number
#: past any machine, a string) is dropped when read, with a warning naming the file.
BOUNDS: dict[str, tuple[type, float, str]] = {
    CACHE_PEAKS: (int, float(2**50), "1 PiB"),
    CACHE_DURATIONS: (float, 1e7, "10,000,000 s"),
    CACHE_LOADS: (float, 4096.0, "4,096 cores"),
}
BAD_RECORDS = (
    "spawnrun: pytest's cache held learned values that are no number spawnrun can use "
    "(not finite, negative or past {bound}), dropped: the tests are measured again: "
    "{path}: {records}"
)
#: The keys whose bad records this run has warned of.
WARNED_KEY = pytest.StashKey[set[str]]()


def valid(key: str, value: object) -> bool:
    """Whether ``value`` is a record ``key`` may hold: a finite number of its type (an
    int for peaks), from 0 to its bound. Never raises (a huge int is compared as an
    int, never converted)."""
    kind, bound, _ = BOUNDS.get(key, (float, math.inf, ""))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind is int and not isinstance(value, int):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return 0 <= value <= bound


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
    """``key``'s valid records (``valid``); bad ones are dropped from the cache, with
    one warning naming its file. Never raises: an unreadable cache is an empty one."""
    try:
        cache = getattr(config, "cache", None)
        stored = cache.get(key, {}) if cache is not None else {}
        if not isinstance(stored, dict):
            return {}
        good: dict[str, int | float] = {}
        bad: dict[str, object] = {}
        for k, v in stored.items():
            if valid(key, v):
                good[str(k)] = v
            else:
                bad[str(k)] = v
        if bad:
            _drop_bad(config, key, good, bad)
        return good
    except Exception:  # noqa: BLE001 - learned state never breaks a run
        return {}


def _drop_bad(
    config: pytest.Config, key: str, good: dict[str, int | float], bad: dict[str, object]
) -> None:
    warned = config.stash.setdefault(WARNED_KEY, set())
    if key in warned:
        return
    warned.add(key)
    speaks = os.environ.get("PYTEST_XDIST_WORKER", "gw0") in ("", "gw0")
    if not speaks:
        return
    cache: Any = getattr(config, "cache", None)
    with contextlib.suppress(Exception):  # a read-only cache: dropped when read, again
        cache.set(key, good)
    where = getattr(cache, "_cachedir", None)
    path = str(Path(where) / "v" / key) if where else key
    shown = [f"{nodeid} = {_shown_value(v)}" for nodeid, v in list(bad.items())[:MAX_LISTED]]
    more = len(bad) - len(shown)
    records = ", ".join(shown) + (f" and {more} more" if more > 0 else "")
    text = BAD_RECORDS.format(bound=BOUNDS[key][2], path=path, records=records)
    _reports.record_warning(config, _reports.warning(text), "")


def _shown_value(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**12:
        return f"an integer of {len(str(abs(value)))} digits"
    return _short(repr(value))


def preloads(config: pytest.Config) -> list[str]:
    """The modules earlier runs' tests imported that their boots had not (those that
    pass ``check_modules``)."""
    return cached_modules(config, CACHE_PRELOADS)


def template_modules(config: pytest.Config) -> list[str]:
    """The library modules the last run's template imported (those that pass
    ``check_modules``)."""
    return cached_modules(config, CACHE_TEMPLATE_MODULES)


def cached_modules(config: pytest.Config, key: str) -> list[str]:
    """The modules the cache's ``key`` names that a template may import."""
    cache = getattr(config, "cache", None)
    stored = cache.get(key, []) if cache is not None else []
    return check_modules(stored, Path(config.rootpath).resolve())[0]


def check_cache(config: pytest.Config) -> tuple[list[str], set[str]]:
    """The learned preloads a template may import, and the names of the cache's lists
    of modules to import that no template may: those are dropped from the cache, and
    the run says so once.

    The cache is a file in the project that anything may have written (an older
    spawnrun, another branch's run, a hand): what it names is a guess, imported only
    where it is an installed library (``check_modules``).
    """
    cache = getattr(config, "cache", None)
    if cache is None:
        return [], set()
    rootdir = Path(config.rootpath).resolve()
    rejected: set[str] = set()
    listed = []
    learned: list[str] = []
    # Under xdist the first worker speaks and writes for the run (each checks).
    speaks = os.environ.get("PYTEST_XDIST_WORKER", "gw0") in ("", "gw0")
    for key in (CACHE_PRELOADS, CACHE_TEMPLATE_MODULES):
        kept, dropped = check_modules(cache.get(key, []), rootdir)
        if key == CACHE_PRELOADS:
            learned = kept
        if not dropped:
            continue
        rejected.update(dropped)
        listed.append(listing(key, dropped))
        if speaks:
            with contextlib.suppress(Exception):  # a read-only cache: checked next time
                cache.set(key, kept)
    if listed and speaks:
        text = DROPPED.format(dropped="; ".join(listed))
        _reports.record_warning(config, _reports.warning(text), "")
    return learned, rejected


def listing(key: str, dropped: Mapping[str, str]) -> str:
    """What the warning says of one key: each name dropped and why."""
    names = [f"{name} ({why})" for name, why in dropped.items()]
    more = len(names) - MAX_LISTED
    return f"{key}: " + ", ".join(names[:MAX_LISTED]) + (f" and {more} more" if more > 0 else "")


def check_modules(
    stored: object, rootdir: Path, limit: int = MAX_PRELOADS
) -> tuple[list[str], dict[str, str]]:
    """The names of ``stored`` that a template may import, in order, and why each other
    one may not (keyed by the name, or its ``repr`` where it is no module name).

    A list of dotted identifiers, at most ``limit``, each of a top-level package that is
    found outside the rootdir without running any of its code (``_libraries.origins``),
    and that is not the standard library, pytest or spawnrun: what a child would have
    reported (``_libraries.is_library``). Never a module of the suite or the project.
    """
    if not isinstance(stored, list):
        return [], {_short(repr(stored)): NOT_A_LIST}
    kept: list[str] = []
    dropped: dict[str, str] = {}
    tops: dict[str, str] = {}  # top-level name -> why not ("": it may be imported)
    for name in stored:
        if not is_module_name(name):
            dropped[_shown(name)] = NOT_A_NAME
            continue
        assert isinstance(name, str)
        top = name.partition(".")[0]
        if top not in tops:
            tops[top] = _why_not(top, rootdir)
        if tops[top]:
            dropped[name] = tops[top]
        elif len(kept) >= limit:
            dropped[name] = TOO_MANY
        else:
            kept.append(name)
    return kept, dropped


def is_module_name(name: object) -> bool:
    """Whether ``name`` is a dotted name of identifiers (``a.b_c``), none a keyword."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        return False
    return all(part.isidentifier() and not keyword.iskeyword(part) for part in name.split("."))


def _why_not(top: str, rootdir: Path) -> str:
    if _libraries.never_library(top):
        return NOT_A_LIBRARY
    found = _libraries.origins(top)
    if found is None:
        return NOT_INSTALLED
    return "" if _libraries.outside(found, rootdir) else IN_ROOTDIR


def _shown(value: object) -> str:
    """A name as the warning lists it: itself, or its ``repr`` where it is no name."""
    return str(value) if is_module_name(value) else _short(repr(value))


def _short(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def forget(config: pytest.Config, tops: Collection[str]) -> None:
    """Drop the modules of the top-level packages ``tops`` from the cache's lists."""
    cache = getattr(config, "cache", None)
    if cache is None or not tops:
        return
    for key in (CACHE_PRELOADS, CACHE_TEMPLATE_MODULES):
        stored = cache.get(key, [])
        if not isinstance(stored, list):
            continue
        kept = [m for m in stored if not (isinstance(m, str) and m.partition(".")[0] in tops)]
        if kept != stored:
            with contextlib.suppress(Exception):  # a read-only cache
                cache.set(key, kept)


def saw_imports(config: pytest.Config, modules: list[str]) -> None:
    """A test's child imported ``modules`` (third-party, not imported by its boot).

    Only what an import statement can name is kept: ``sysconfig`` imports its data
    module by a name with hyphens (``_sysconfigdata__x86_64-linux-gnu``), which the next
    run would refuse with a warning, and the run after it learn again."""
    names = [str(m) for m in modules if is_module_name(m)]
    if names:
        seen = config.stash.setdefault(IMPORTED_KEY, {})
        seen.update(dict.fromkeys(names))


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
    with contextlib.suppress(Exception):  # learned state never breaks a run
        _store(config, cache, key, measured, collected)


def _store(
    config: pytest.Config,
    cache: Any,
    key: str,
    measured: Mapping[str, float],
    collected: Collected | None,
) -> None:
    stored = cache.get(key, {})
    stored = stored if isinstance(stored, dict) else {}
    merged = {k: v for k, v in {**stored, **measured}.items() if valid(key, v)}
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
