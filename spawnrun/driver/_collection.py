"""The parent's work as pytest collects: children booted early for the files it lists,
and, once collection is done, what the driver and the next run get from it.

Runs in the parent only (the plugin's collection hooks call it). ``boot_early`` guesses,
from a file's text or what an earlier run remembered (``_early``), whether its tests
will be spawned and what they need, and has the dispatcher start a child for it (or,
in fast mode, a configured template primed). ``finish`` remembers which files' tests
were spawned, stops bytecode writing, hands the zygote what collection imported and the
driver the suite's spawned tests with their plans: made at collection (``_plan``), read
here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from spawnrun.config._plan import CAPACITY_KEY
from spawnrun.config._plan import INVENTORY_KEY
from spawnrun.config._plan import PER_GPU_KEY
from spawnrun.config._plan import PLAN_KEY
from spawnrun.config._plan import SETTINGS_KEY
from spawnrun.config._plan import _plan_from
from spawnrun.config._plan import _spawns
from spawnrun.devices import _packing
from spawnrun.driver import _early
from spawnrun.driver import _session
from spawnrun.launch import _starting
from spawnrun.proc import _bytecode

#: The files whose tests earlier runs spawned (``_early.remembered``), read once.
REMEMBERED_KEY = pytest.StashKey[dict[str, "_early.Guess"]]()


def boot_early(config: pytest.Config, path: Path) -> None:
    """Start a child for a test file whose tests will likely be spawned, if one is due.

    Likely: every test is (``--spawn-gpu``), the file names the spawn marker (its
    default count is guessed), or an earlier run spawned its tests (what the first one
    needed is guessed). Where too few devices are there, such tests are skipped: none
    is started. A test that needs others dismisses it.
    """
    scheduler = config.stash.get(_session.SCHEDULER_KEY, None)
    # Each collected file is read for a guess only while it may be of use.
    primes = _starting.may_prime(config)
    if scheduler is None or not (scheduler.early.wants() or primes):
        return
    settings = config.stash[SETTINGS_KEY]
    if REMEMBERED_KEY not in config.stash:
        config.stash[REMEMBERED_KEY] = _early.remembered(config)
    guess = _early.guess(path, settings.marker, config.stash[REMEMBERED_KEY], config.rootpath)
    marked, count, need, source = guess or (False, 0, None, "")
    if not (marked or settings.spawn_gpu):
        return  # an unmarked test spawns with --spawn-gpu only
    if count is None:
        count = settings.count
    ids = config.stash[INVENTORY_KEY].ids
    capacity = config.stash[CAPACITY_KEY]
    if marked and count > len(ids):
        return  # such tests are skipped here (a machine without GPUs, say)
    per_gpu = config.stash.get(PER_GPU_KEY, 1)
    plan = _plan_from(marked, count, settings, {}, ids, capacity, None, None, per_gpu)
    if need is not None:  # the budget the file's first spawned test had last time
        plan = replace(plan, need=need, budget_source=source, alone_because="")
    if scheduler.early.wants():
        scheduler.expect(str(path), plan)  # the dispatcher decides whether, and where
    elif primes:  # fast mode: a fork of a configured template, rather than a spawn
        devices = list(ids) if plan.every else list(ids[: plan.count])
        env = _starting.child_env(config, plan, devices, capacity)
        # The first tests wait for it where the cores are fewer than what would configure
        # pytest at once (it, the parent, the first jobs); else they do beside it.
        wait = scheduler.cpus < scheduler.limit + 2
        _starting.prime(config, str(path), env, wait)


def finish(session: pytest.Session) -> None:
    """Collection is done: what it found goes to the cache, the zygote and the driver."""
    scheduler = session.config.stash.get(_session.SCHEDULER_KEY, None)
    if scheduler is not None:
        spawned: dict[Path, _early.Guess] = {}
        for item in session.items:
            if item.path not in spawned and _spawns(item):  # the file's first spawned test
                plan = item.stash[PLAN_KEY]
                need = None if plan.need is _packing.ALONE else plan.need
                spawned[item.path] = (not plan.every, plan.count, need, plan.budget_source)
        settings = session.config.stash[SETTINGS_KEY]
        in_process = settings.no_spawn or settings.forced_inprocess
        # Not from a worker (it writes no cache; the controller collects none), nor
        # from a run that spawns nothing because it was told so.
        if not _session.xdist_worker() and not in_process:
            _early.remember(session.config, spawned, {i.path for i in session.items})
    _bytecode.stop()  # the tests see bytecode settings as they were
    holder = session.config.stash.get(_starting.ZYGOTE_KEY, None)
    if holder is not None:
        # Preload in the template what collection imported.
        holder.collected({Path(str(item.path)) for item in session.items})
    if scheduler is not None:
        # Once the zygote forks what collection imported: children may boot ahead now.
        scheduler.suite([(it, it.stash[PLAN_KEY]) for it in session.items if _spawns(it)])
