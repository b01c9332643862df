"""Each test's plan, decided once at collection and kept in ``item.stash``.

Runs in the parent; no processes. Whether a test spawns, on how many devices, with what
budget (declared, or learned from earlier runs' peaks under ``spawn_pack = auto``), in
which scope's or template's child, with which timeout; which spawned tests share a child
and the order they run in. The run path (``plugin``, the driver) reads the plan and never
asks the markers again.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from spawnrun.config import _parse
from spawnrun.config import _settings
from spawnrun.devices import _inventory
from spawnrun.devices import _packing
from spawnrun.learn import _learned
from spawnrun.learn import _unforked

SETTINGS_KEY = pytest.StashKey[_settings.Settings]()
INVENTORY_KEY = pytest.StashKey[_inventory.Inventory]()
#: Per item: the validated marker arguments, whether it spawns, and what it needs.
ITEM_KEY = pytest.StashKey[dict[str, Any]]()
SPAWNS_KEY = pytest.StashKey[bool]()
PLAN_KEY = pytest.StashKey[_packing.Plan]()
#: Each device's memory (NVML's, or --spawn-gpu-memory), None where unknown.
CAPACITY_KEY = pytest.StashKey[dict[str, "int | None"]]()
#: Most tests at once on one device (``--spawn-per-gpu``, or the cores' default).
PER_GPU_KEY = pytest.StashKey[int]()


def plan_items(config: pytest.Config, items: list[pytest.Item], limit: int) -> list[pytest.Item]:
    """Every selected test's plan, made once (the run path only reads it): its marker
    validated, whether it spawns, what it needs (a test that can never get its devices is
    skipped in-process), and the tests in the order they run (``_scopes``)."""
    settings = config.stash[SETTINGS_KEY]
    inventory = config.stash[INVENTORY_KEY]
    ids = inventory.ids
    capacity = config.stash[CAPACITY_KEY]
    learned = _learned.peaks(config) if settings.pack == "auto" else {}
    # Tests whose fork an earlier run doubted: spawned fresh, never forked.
    unforked = _unforked.remembered(config) if settings.method == "forkserver" else {}
    known = _unforked.known_failures(config) if settings.method == "forkserver" else {}
    for item in items:
        overrides = _settings.marker_overrides(item, settings)
        item.stash[ITEM_KEY] = overrides
        spawns = _should_spawn(item, settings)
        plan = _plan(item, settings, overrides, ids, capacity, learned)
        if item.nodeid in unforked:
            why = _unforked.REMEMBERED.format(why=unforked[item.nodeid])
            plan = replace(plan, unforked=why)
            if spawns:
                _unforked.spawned_by_record(config, item.nodeid)
        elif item.nodeid in known:
            plan = replace(plan, known_failure=known[item.nodeid])
        item.stash[PLAN_KEY] = plan
        reason = ""
        if spawns or plan.count:
            reason = inventory.refuses(plan.count) or _cannot_run(plan, ids, capacity)
        if reason:
            # Skipped where it stands, in-process: no child for a test that cannot run.
            item.add_marker(pytest.mark.skip(reason=reason))
            spawns = False
        elif spawns and _skipped_statically(item):
            spawns = False  # pytest skips it here, as in the child, without a child
        item.stash[SPAWNS_KEY] = spawns
    return _scopes(config, settings, items, limit)


def _scopes(
    config: pytest.Config, settings: _settings.Settings, items: list[pytest.Item], limit: int
) -> list[pytest.Item]:
    """Which spawned tests share a child (``Plan.scope``), and the order they run in.

    A group's tests move to where its first test is, so one child runs them together;
    class and module scopes are together already. Tests of one scope need the same
    devices and budget: their child holds them for all.
    """
    members: dict[str, list[pytest.Item]] = {}
    for item in items:
        if item.stash[SPAWNS_KEY]:
            key = _scope_key(item, settings) or _template_key(item, settings)
            if key:
                members.setdefault(key, []).append(item)
    gpus = len(config.stash[INVENTORY_KEY].ids)
    members = _split_templates(members, limit, gpus)
    for key, tests in members.items():
        if _packing.is_template(key):
            # Same devices and need (the key says so); each keeps why it runs alone.
            for item in tests:
                item.stash[PLAN_KEY] = replace(item.stash[PLAN_KEY], scope=key)
            continue
        shared = _scope_plan(key, tests)
        for item in tests:
            item.stash[PLAN_KEY] = replace(shared, timeout=item.stash[PLAN_KEY].timeout)
    groups = {k: v for k, v in members.items() if k.startswith("group ")}
    if not groups:
        return items
    ordered: list[pytest.Item] = []
    moved = {id(t) for v in groups.values() for t in v}
    for item in items:
        key = item.stash[PLAN_KEY].scope if id(item) in moved else ""
        if not key:
            ordered.append(item)
        elif groups[key][0] is item:
            ordered += groups[key]
    return ordered


def _scope_plan(key: str, tests: list[pytest.Item]) -> _packing.Plan:
    """The devices and budget one child holds for all the tests of its scope.

    Declared needs must agree: a usage error names two tests that differ. Budgets the
    run learned (``--spawn-pack auto``) differ from test to test by nature: the child
    gets the largest, or runs alone while any of its tests has no peak recorded yet.
    Each test keeps its own timeout.
    """
    plans = [t.stash[PLAN_KEY] for t in tests]
    first = plans[0]
    for other, plan in zip(tests[1:], plans[1:], strict=True):
        same = (plan.count, plan.every) == (first.count, first.every)
        if same and (plan.need == first.need or (plan.learned and first.learned)):
            continue
        raise pytest.UsageError(
            f"{tests[0].nodeid} and {other.nodeid} share a child ({key}) but need "
            f"different devices or budgets ({_needs(first)} against {_needs(plan)}): "
            "give them the same count= and memory=, or different scopes"
        )
    chosen = first
    if any(p.need != first.need for p in plans):
        alone = [p for p in plans if p.need is _packing.ALONE]
        chosen = alone[0] if alone else max(plans, key=lambda p: p.need or 0)
        if alone:
            why = f"a test of its scope runs alone ({alone[0].alone_because})"
            chosen = replace(chosen, alone_because=why, budget_source="")
        else:
            chosen = replace(chosen, budget_source=f"{chosen.budget_source}, its scope's largest")
    return replace(chosen, scope=key)


def _needs(plan: _packing.Plan, budget: str = "") -> str:
    """What a test's devices are, and how it holds them: alone, or ``budget`` (its own,
    shown, when none is given)."""
    held = "alone" if plan.need is _packing.ALONE else budget or _packing.show(plan.need)
    return f"{'every GPU' if plan.every else plan.count}, {held}"


def _scope_key(item: pytest.Item, settings: _settings.Settings) -> str:
    """The scope whose child runs ``item`` ("": a child of its own)."""
    group = _closest_kwarg(item, settings, "group", _parse.parse_group)
    if group:
        return f"group {group}"
    scope = _closest_kwarg(item, settings, "scope", _parse.parse_scope) or settings.scope
    if scope == "module":
        return f"module {item.nodeid.split('::')[0]}"
    if scope == "class":
        cls = item.getparent(pytest.Class)
        return f"class {cls.nodeid}" if cls is not None else ""
    return ""


def _split_templates(
    members: dict[str, list[pytest.Item]], limit: int, gpus: int
) -> dict[str, list[pytest.Item]]:
    """Each template becomes as many as its tests can run at once.

    Tests of one template run one after another; with several templates they still run
    side by side, as many as the job limit (and, for tests alone on devices, the
    devices) allow: tests with a budget (``--spawn-gpu``'s, which hold every device)
    get as many as the job limit, and the dispatcher packs each fork's claim. A file's
    template is split round robin; the run's (``--spawn-template run``) in runs of
    consecutive tests, so that each collects only the files of its share. A template
    that would fork one test only costs a fork more than a child of its own: such a
    test has none.

    A file's template is split only as far as its tests are more than a job's share of
    the run's forked tests: each template collects the file again (kornia's files of
    about ten tests each collected it twice with two jobs), while the other files'
    templates keep the other jobs busy anyway. A run of one file is split as before.
    """
    split: dict[str, list[pytest.Item]] = {}
    forked = sum(
        len(tests)
        for key, tests in members.items()
        if _packing.is_template(key) and not key.endswith(RUN_TEMPLATE)
    )
    for key, tests in members.items():
        if not _packing.is_template(key):
            split[key] = tests
            continue
        plan = tests[0].stash[PLAN_KEY]
        if plan.need is not _packing.ALONE:
            at_once = limit  # budgets: each fork's claim is packed as a child's would be
        elif plan.every and gpus:
            at_once = 1  # it holds every device
        else:
            at_once = gpus // plan.count if plan.count else limit
        ways = max(1, min(limit, at_once, len(tests)))
        if not key.endswith(RUN_TEMPLATE) and forked:
            ways = min(ways, max(1, math.ceil(len(tests) * limit / forked - 1e-9)))
        for way in range(ways):
            if key.endswith(RUN_TEMPLATE):
                share = tests[way * len(tests) // ways : (way + 1) * len(tests) // ways]
            else:
                share = tests[way::ways]
            if len(share) > 1:
                split[f"{key} #{way + 1}" if ways > 1 else key] = share
    return split


#: Ends the key of a template of the run's files (``--spawn-template run``).
RUN_TEMPLATE = " of the run"


def _template_key(item: pytest.Item, settings: _settings.Settings) -> str:
    """The template a test of its own is forked from in fast mode ("": none).

    One per file and devices, for tests alone on them or with a budget (``--spawn-template
    run``: the same for the run's files): its tests run one after another, each in a fork
    of the process that collected their files, with its own budget. Marked tests with a
    memory budget keep children of their own, which may run side by side on a device.
    """
    if settings.method != "forkserver" or settings.template == "library":
        return ""
    plan = item.stash[PLAN_KEY]
    if plan.unforked:
        return ""  # spawned fresh: an earlier run's fork of it was in doubt
    if plan.count and plan.need is not _packing.ALONE:
        return ""
    # Tests alone on their devices apart from those with budgets (the dispatcher runs
    # them one way or the other); budgets differ within a template, as each fork takes
    # its own with its Go.
    needs = _needs(plan, "a budget each")
    if settings.template == "run":
        return f"{_packing.TEMPLATE_SCOPE}[{needs}]{RUN_TEMPLATE}"
    where = item.nodeid.split("::")[0]
    return f"{_packing.TEMPLATE_SCOPE}{where} [{needs}]"


def _closest_kwarg(item: pytest.Item, settings: _settings.Settings, name: str, parse: Any) -> Any:
    """A marker keyword from the closest spawn marker that has it (test, class, module)."""
    for mark in item.iter_markers(name=settings.marker):
        if name in mark.kwargs:
            return parse(
                mark.kwargs[name],
                f"{item.nodeid}: @pytest.mark.{settings.marker}({name}={mark.kwargs[name]!r})",
            )
    return None


def _cannot_run(plan: _packing.Plan, ids: tuple[str, ...], capacity: dict[str, int | None]) -> str:
    """Why a test can never get its devices ("" if it can)."""
    if plan.count > len(ids):
        gpus = "GPU" if plan.count == 1 else "GPUs"
        return f"needs {plan.count} {gpus}, {len(ids)} available"
    need = plan.need
    if need is _packing.ALONE or not (plan.count or plan.every):
        return ""
    wanted = len(ids) if plan.every else plan.count
    sizes = [capacity.get(d) for d in ids]
    big_enough = [c for c in sizes if c is None or c >= need]
    if len(big_enough) >= wanted:
        return ""
    largest = max(c for c in sizes if c is not None)
    return (
        f"needs {_packing.show(need)} of GPU memory ({plan.budget_source}), "
        f"more than the device's {_packing.show(largest)}"
    )


def _plan(
    item: pytest.Item,
    settings: _settings.Settings,
    overrides: dict[str, Any],
    ids: tuple[str, ...],
    capacity: dict[str, int | None],
    learned: dict[str, int],
) -> _packing.Plan:
    """What the test needs: devices, a budget on each (or alone, and why), a timeout."""
    marked = _settings.marked(item, settings)
    count = _device_count(item, settings, overrides)
    raw = _marker_memory(item, settings)
    peak = learned.get(item.nodeid)
    per_gpu = item.config.stash.get(PER_GPU_KEY, 1)
    return _plan_from(marked, count, settings, overrides, ids, capacity, raw, peak, per_gpu)


def _plan_from(
    marked: bool,
    count: int,
    settings: _settings.Settings,
    overrides: dict[str, Any],
    ids: tuple[str, ...],
    capacity: dict[str, int | None],
    raw: object,
    peak: int | None,
    per_gpu: int = 1,
) -> _packing.Plan:
    """``_plan`` from what it reads of the test (and a file's guess: ``_collection.boot_early``)."""
    timeout = overrides.get("timeout", settings.timeout)
    every = not marked  # --spawn-gpu alone: it sees every device, so it holds them all
    if not (count if marked else ids):
        return _packing.Plan(timeout, count, every=every)
    alone = _packing.Plan(timeout, count, every=every, alone_because="no memory budget")
    if settings.pack == "off":
        return replace(alone, alone_because="--spawn-pack off")
    if overrides.get("exclusive", settings.exclusive):
        return replace(alone, alone_because="exclusive=True")
    memory = overrides.get("memory", settings.memory)
    if memory is not None:
        source = f"memory={raw!r}" if raw is not None else f"spawn_memory {_packing.show(memory)}"
        return replace(alone, need=memory, alone_because="", budget_source=source)
    if settings.pack != "auto":
        return alone
    if peak is None:
        # A test the user marked runs alone until its peak is known; one that --spawn-gpu
        # spawns (most of a suite's, and most use little) shares a guessed share.
        sizes = [capacity.get(d) for d in ids]
        known = [c for c in sizes if c is not None]
        least = min(known) if known and len(known) == len(sizes) else None
        need = _packing.first_run_need(least, per_gpu) if every else _packing.ALONE
        if need is _packing.ALONE:
            return replace(alone, alone_because="no peak recorded yet", learned=True)
        source = _packing.FIRST_RUN_SOURCE
        return replace(alone, need=need, alone_because="", budget_source=source, learned=True)
    known = [c for c in capacity.values() if c is not None]
    need, why = _packing.learned_need(peak, min(known) if known else None)
    if need is _packing.ALONE:
        return replace(alone, alone_because=why, learned=True)
    source = f"learned: peak {_packing.show(peak)}"
    return replace(alone, need=need, alone_because="", budget_source=source, learned=True)


def _marker_memory(item: pytest.Item, settings: _settings.Settings) -> object:
    mark = item.get_closest_marker(settings.marker)
    return None if mark is None else mark.kwargs.get("memory")


def _skipped_statically(item: pytest.Item) -> bool:
    """Whether pytest will skip the test from its marks alone, whatever process runs it.

    ``skip``, or a ``skipif`` whose condition is already a boolean True. String
    conditions are left to the child: evaluating them here could run code (a CUDA
    query) in the parent.
    """
    if item.get_closest_marker("skip") is not None:
        return True
    marks = list(item.iter_markers("skipif"))
    conditions = [c for m in marks for c in (*m.args, m.kwargs.get("condition", False))]
    if any(isinstance(c, str) for c in conditions):
        return False
    return any(bool(c) for c in conditions)


def _should_spawn(item: pytest.Item, settings: _settings.Settings) -> bool:
    if settings.no_spawn or settings.forced_inprocess:
        return False
    return settings.spawn_gpu or _settings.marked(item, settings)


def _device_count(
    item: pytest.Item, settings: _settings.Settings, overrides: dict[str, Any]
) -> int:
    # Only the spawn marker asks for devices; tests spawned by --spawn-gpu alone ask for
    # none (and forked, standing in for it, for none either: its overrides say count=0).
    if not _settings.marked(item, settings):
        return 0
    count: int = overrides.get("count", settings.count)
    return count


def _spawns(item: pytest.Item) -> bool:
    """Whether the test runs in a child, as its plan says (``plan_items``).

    Plans are made at collection only: a test without one (added after spawnrun's
    ``pytest_collection_modifyitems``, by another plugin) runs in-process.
    """
    return item.stash.get(SPAWNS_KEY, False)
