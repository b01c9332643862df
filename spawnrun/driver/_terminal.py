"""What the run writes in the terminal besides the tests' own lines: its header, the
spawnrun summary section (each xdist worker's too), and ``--spawn-explain``'s answer.

Runs in the parent only (the plugin's hooks call it). ``--spawn-explain``'s per-test
lines are ``config._explain``'s; the summary's counts and lines are the driver's
(``_summary``); the interrupted tests are described by ``_status``, imported when a run
was interrupted, as ``_explain`` and ``_boots`` are when asked for.
"""

from __future__ import annotations

from typing import Any

import pytest

from spawnrun.config import _settings
from spawnrun.config._plan import CAPACITY_KEY
from spawnrun.config._plan import INVENTORY_KEY
from spawnrun.config._plan import SETTINGS_KEY
from spawnrun.devices import _packing
from spawnrun.driver import _ending
from spawnrun.driver import _reruns
from spawnrun.driver import _session
from spawnrun.launch import _starting
from spawnrun.learn import _learned
from spawnrun.learn import _unforked
from spawnrun.wire import _reports

#: Under xdist: each worker's summary lines, sent in its ``workeroutput``.
WORKER_SUMMARY = "spawnrun_summary"
WORKER_SUMMARIES_KEY = pytest.StashKey[dict[str, list[str]]]()


def header(config: pytest.Config) -> list[str]:
    """The lines under pytest's header: what is spawned, how, on which devices."""
    settings = config.stash.get(SETTINGS_KEY, None)
    if settings is None:
        return []
    if settings.forced_inprocess:
        return [settings.forced_inprocess]
    if settings.no_spawn:
        return ["spawnrun: --no-spawn given, every test runs in-process"]
    what = "every test" if settings.spawn_gpu else f"tests marked {settings.marker}"
    scheduler = config.stash[_session.SCHEDULER_KEY]
    how = "a fresh spawn child"
    if settings.method == "forkserver":
        how = "a fresh forked child (fast mode, --spawn-method forkserver)"
    lines = [
        f"spawnrun: {what} run in {how}, up to {scheduler.limit} at once, "
        f"{scheduler.lookahead} booted ahead",
        config.stash[INVENTORY_KEY].describe(),
    ]
    capacity = config.stash[CAPACITY_KEY]
    if capacity and settings.pack != "off" and None in capacity.values():
        lines.append(
            "spawnrun: each GPU test runs alone on its GPU, even with a memory= budget: "
            "how much memory the GPUs have is unknown here (NVML is not available). "
            "To let budgeted tests share a GPU, give it: --spawn-gpu-memory 80GiB"
        )
    elif capacity and settings.pack != "off":
        sizes = sorted({_packing.show(c) for c in capacity.values()})
        lines.append(
            f"spawnrun: packing {settings.pack}: tests with a memory budget share a GPU, "
            f"up to {scheduler.allocator.per_gpu} at once, within its memory "
            f"({', '.join(sizes)}) less {_packing.show(_packing.RESERVE)} per test"
        )
    return lines


def summary_lines(config: pytest.Config) -> list[str]:
    """The spawnrun section's lines: the driver's summary, the tests fast mode's
    template declined to fork, those a fork's guess may have changed (an xdist worker's:
    its groups that xdist spread over workers too)."""
    scheduler = config.stash.get(_session.SCHEDULER_KEY, None)
    settings = config.stash.get(SETTINGS_KEY, None)
    # Which tests ran alone, listed where budgets are learned: asked for, or (the default)
    # once an earlier run recorded peaks.
    auto = settings is not None and settings.pack == "auto"
    if auto and _settings.source_of(config, "pack") == "the default":
        auto = bool(_learned.peaks(config))
    if scheduler is not None:  # what tests' processes ended as they left counts too
        scheduler.reaped += config.stash.get(_ending.LEFT_RUNNING_KEY, 0)
        config.stash[_ending.LEFT_RUNNING_KEY] = 0
    lines = scheduler.summary(list_alone=auto) if scheduler is not None else []
    holder = config.stash.get(_starting.ZYGOTE_KEY, None)
    if holder is not None:
        lines += holder.declined_lines()
    lines += _unforked.lines(config, _reruns.shown(config))
    lines += _reruns.lines(config)
    if scheduler is not None and _session.xdist_worker():
        lines += scheduler.split_groups()
    return lines


def keep_worker_summary(node: Any) -> None:
    """xdist's controller: keep what a worker's spawned tests came to, for the summary."""
    lines = getattr(node, "workeroutput", {}).get(WORKER_SUMMARY)
    if isinstance(lines, list) and lines:
        worker = str(getattr(node, "workerinput", {}).get("workerid", "?"))
        summaries = node.config.stash.setdefault(WORKER_SUMMARIES_KEY, {})
        summaries[worker] = [str(line) for line in lines]


def write_summary(terminalreporter: Any) -> None:
    """The spawnrun section: the summary (each worker's lines after it), the tests an
    interrupt stopped, and long waits for device memory."""
    config = terminalreporter.config
    scheduler = config.stash.get(_session.SCHEDULER_KEY, None)
    lines = summary_lines(config)
    for worker, theirs in sorted(config.stash.get(WORKER_SUMMARIES_KEY, {}).items()):
        lines += [f"[{worker}] {line}" for line in theirs]
    if lines:
        terminalreporter.write_sep("-", "spawnrun")
        for line in lines:
            terminalreporter.write_line(line)
    if scheduler is not None and scheduler.interrupted:
        from spawnrun.driver import _status

        terminalreporter.write_sep("!", _reports.INTERRUPTED_RUNNING)
        for running in scheduler.interrupted:
            terminalreporter.write_line(_status.describe(running))
    if scheduler is not None and scheduler.long_settles:
        terminalreporter.section("spawnrun: waits for device memory")
        for nodeid, seconds in scheduler.long_settles:
            terminalreporter.write_line(f"{seconds:.1f}s after {nodeid}")


def explain(session: pytest.Session) -> bool:
    """``--spawn-explain``: say where each test would run; run nothing. False where the
    run was not asked to explain."""
    config = session.config
    settings = config.stash.get(SETTINGS_KEY, None)
    if settings is None or not settings.explain:
        return False
    from spawnrun.config import _explain
    from spawnrun.learn import _boots

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    scheduler = config.stash[_session.SCHEDULER_KEY]
    fast = settings.method == "forkserver"
    children = f"children {'forked from templates (fast mode)' if fast else 'spawned'}"
    per_gpu = f"at most {scheduler.allocator.per_gpu} per GPU"
    packing = f"packing {settings.pack}; {children}"
    head = [config.stash[INVENTORY_KEY].describe()]
    if _session.xdist_controller(config):
        # The controller collects nothing itself (its workers do): it collects here, to
        # say what each worker would do with each test; a worker runs one at a time.
        if not session.items:
            session.perform_collect()
        head.append(
            "spawnrun: under xdist, each worker runs one test's child at a time, "
            f"{per_gpu} over all workers; {packing}"
        )
        backfill, gather = 0, 0
    else:
        head.append(f"spawnrun: up to {scheduler.limit} test(s) at once, {per_gpu}; {packing}")
        backfill, gather = scheduler.backfill(), scheduler.gather()
    head += [
        _on_off(
            "backfilling",
            backfill,
            "by the durations earlier runs recorded",
            "no duration recorded yet, one job at a time, or under xdist",
        ),
        _on_off(
            "gathering",
            gather,
            f"up to {gather} tests that need their GPUs alone wait for one drain",
            "one job at a time, under xdist, or a failure stops the session",
        ),
    ]
    if session.testsfailed and not config.option.continue_on_collection_errors:
        # pytest stops at a collection error and runs nothing: so says the answer.
        errors = f"{session.testsfailed} error(s) during collection"
        head.append(
            f"spawnrun: no test would run: {errors}, where pytest stops "
            "(--continue-on-collection-errors runs the others)"
        )
        if reporter is not None:
            reporter.write_sep("-", "spawnrun: where each test would run (nothing ran)")
            for line in head:
                reporter.write_line(line)
        return False  # pytest's own loop then ends the session at the error, as always
    durations = scheduler.durations if backfill else None
    text = _explain.lines(session.items, settings, dict(_boots.load(config)), head, durations)
    if reporter is not None:
        reporter.write_sep("-", "spawnrun: where each test would run (nothing ran)")
        for line in text:
            reporter.write_line(line)
    return True


def _on_off(mechanism: str, on: int, why_on: str, why_off: str) -> str:
    """``--spawn-explain``'s line for a scheduling mechanism the run may turn off."""
    return f"spawnrun: {mechanism} {'on' if on else 'off'} ({why_on if on else why_off})"
