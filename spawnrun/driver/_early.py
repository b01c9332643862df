"""Children started while the parent collects, each for a file it has not imported yet.

Runs in the parent. pytest lists a directory's files before it imports any of them
(``pytest_collect_file``), and the parent's collection may spend most of its time in
the first module's imports (transformers: 10 s without bytecode). A child started for
such a file, as soon as the file is listed, makes the same imports at the same time
instead of after. It collects its file, as a test's child does, then waits to be told
its test (``Assign``).

Nothing is sent later that its code could have read at import: a file's first test
takes the child only if it would have started one with the same arguments and the
same environment (its devices, its budget); the parent's own environment changes
since reach it with the go, as they reach a child booted ahead. A guess that turns out
wrong (the file's tests are not spawned, not selected, or need other devices) costs
only that child's boot: it is dismissed.

Which files get one (``guess``): every file with ``--spawn-gpu``; else a file whose
text names the marker (planned on its default device count), or whose tests were
spawned when an earlier run collected it (pytest's cache: a conftest that adds the
marker, say), planned as its first spawned test was.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from spawnrun.launch import _runner

#: pytest's cache: the files (relative to the rootdir) whose tests the last run that
#: collected them spawned.
SPAWNED_KEY = "spawnrun/spawned-files"
#: How much of a test file is searched for the spawn marker's name.
_MARKER_SCAN = 1 << 20


@dataclass
class EarlyChild:
    path: str
    child: _runner.ChildProcess
    devices: list[str]
    env: dict[str, str]
    #: The parent's environment when it started (what a go's changes are measured from).
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    started: float = field(default_factory=time.monotonic)


class Early:
    """The children started early and not yet taken by a test, at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting: list[EarlyChild] = []
        #: Until the parent's collection ends: no child is started early after it.
        self.open = limit > 0
        #: For the run summary: started early, and taken by a test.
        self.started = 0
        self.taken = 0

    def wants(self) -> bool:
        return self.open and len(self.waiting) < self.limit

    def add(self, early: EarlyChild) -> None:
        self.waiting.append(early)
        self.started += 1

    def take(
        self, args: list[str], env: Mapping[str, str]
    ) -> tuple[EarlyChild | None, list[_runner.ChildProcess]]:
        """The child started for ``args`` with ``env``, and those of ``args`` that will not do.

        A test of the file that needs another environment (other devices, a budget)
        shows that the guess was wrong: that child is dismissed.
        """
        dismissed: list[_runner.ChildProcess] = []
        for early in list(self.waiting):
            if [early.path] != args:
                continue
            self.waiting.remove(early)
            if early.env == dict(env) and not early.child.gone:
                self.taken += 1
                return early, dismissed
            dismissed.append(_dismiss(early))
        return None, dismissed

    def close(self) -> list[_runner.ChildProcess]:
        """The session ends: every child still waiting is dismissed."""
        self.open = False
        dismissed = [_dismiss(e) for e in self.waiting]
        self.waiting = []
        return dismissed


def _dismiss(early: EarlyChild) -> _runner.ChildProcess:
    """The child's pipe closes: it reads no test, and its pytest ends by itself."""
    early.child.close_pipe()
    return early.child


#: A file's first spawned test, as a guess: (marked, its device count, None: the
#: marker's default count; its budget in bytes, None: none; where the budget came from).
Guess = tuple[bool, "int | None", "int | None", str]


def guess(path: Path, marker: str, remembered: dict[str, Guess], rootdir: Path) -> Guess | None:
    """What the file's first spawned test likely needs (None: likely none is spawned).

    An earlier run's record of the file, else the marker's default if its text names
    the marker.
    """
    known = remembered.get(_relative(path, rootdir))
    if known is not None:
        return known
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(_MARKER_SCAN)
    except OSError:
        return None
    found = re.search(rf"\bmark\.{re.escape(marker)}\b(\([^()]*\))?", text)
    if found is None:
        return None
    # Its first mark's literal count (``gpu(count=0)``: no device), else the default.
    count = re.search(r"\bcount\s*=\s*(\d+)\b", found.group(1) or "")
    return (True, int(count.group(1)) if count else None, None, "")


def remembered(config: Any) -> dict[str, Guess]:
    """What the first spawned test of each file needed when earlier runs collected it."""
    cache = getattr(config, "cache", None)
    found = cache.get(SPAWNED_KEY, {}) if cache is not None else {}
    if not isinstance(found, dict):
        return {}
    out: dict[str, Guess] = {}
    for path, value in found.items():
        if not (isinstance(value, list) and len(value) in (2, 4) and isinstance(value[1], int)):
            continue
        need, source = (value[2], value[3]) if len(value) == 4 else (None, "")
        if (need is None or isinstance(need, int)) and isinstance(source, str):
            out[str(path)] = (bool(value[0]), value[1], need, source)
    return out


def remember(config: Any, spawned: Mapping[Path, Guess], collected: Iterable[Path]) -> None:
    """Keep what each collected file's first spawned test needed (its devices and
    budget: a child started for the file serves it only with the same environment);
    other files' entries stay."""
    cache = getattr(config, "cache", None)
    if cache is None:
        return
    rootdir = Path(config.rootpath)
    before = remembered(config)
    seen = {_relative(p, rootdir) for p in collected}
    now = {k: v for k, v in before.items() if k not in seen}
    now.update({_relative(p, rootdir): guess for p, guess in spawned.items()})
    if now != before:
        cache.set(SPAWNED_KEY, {k: list(v) for k, v in sorted(now.items())})


def _relative(path: Path, rootdir: Path) -> str:
    try:
        return str(Path(path).relative_to(rootdir))
    except ValueError:
        return str(path)


def asked_for(parent: Any, path: Path) -> bool:
    """Whether pytest will collect ``path``: it is, or lies below, a path it was given.

    pytest (8 on) lists a directory's every file, through this hook, before it keeps
    only those the command line names (``pytest test_zz.py`` lists ``test_aa.py`` too):
    a child must never import a file pytest itself will not.
    """
    given = getattr(parent.session, "_initialpaths", None)
    if not given:
        return True  # unknown: as before
    # A set's lookups, one per level above the file: pytest lists every file of a
    # directory once per file argument in it (80 file arguments: 6400 listings).
    return path in given or any(p in given for p in Path(path).parents)
