"""``--spawn-explain``: where and how each selected test would run, before anything runs.

Runs in the parent, after collection, from the plans decided for each test (``_plan``):
spawned or in-process and why, its devices, its budget and where it came from (declared
or learned) or why it runs alone, the scope whose child it shares or the template it is
forked from, whether its child may boot unclaimed (``_boots``), and what an earlier run
measured of its duration, by which it may be backfilled (``dispatch.starts``). One line
per test, in the order pytest would run them; nothing is started.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence

import pytest

from spawnrun.config import _settings
from spawnrun.config._plan import PLAN_KEY
from spawnrun.config._plan import SPAWNS_KEY
from spawnrun.devices import _packing
from spawnrun.dispatch import events as ev


def lines(
    items: Sequence[pytest.Item],
    settings: _settings.Settings,
    boots: Mapping[str, str],
    header: Sequence[str],
    durations: Mapping[str, float] | None = None,
) -> list[str]:
    """``durations``: what earlier runs measured, where backfilling is on (None: off)."""
    out = list(header)
    for item in items:
        out.append(f"{item.nodeid}: {describe(item, settings, boots, durations)}")
    return out


def describe(
    item: pytest.Item,
    settings: _settings.Settings,
    boots: Mapping[str, str],
    durations: Mapping[str, float] | None = None,
) -> str:
    skip = item.get_closest_marker("skip")
    if skip is not None and not item.stash.get(SPAWNS_KEY, False):
        reason = skip.kwargs.get("reason") or (skip.args[0] if skip.args else "")
        return f"skipped here ({reason})" if reason else "skipped here"
    if not item.stash.get(SPAWNS_KEY, False):
        return f"in-process ({_why_in_process(item, settings)})"
    plan = item.stash[PLAN_KEY]
    parts = ["spawned", _devices(plan)]
    if plan.count or plan.every:
        if plan.need is _packing.ALONE:
            parts.append(f"alone on its devices ({plan.alone_because or 'no memory budget'})")
        else:
            parts.append(f"budget {_packing.show(plan.need)} ({plan.budget_source})")
    parts.append(f"timeout {'none' if plan.timeout is None else f'{plan.timeout:g} s'}")
    if plan.forked:
        parts.append(f"forked from {plan.scope} (fast mode)")
    elif plan.unforked:
        parts.append(f"not forked, spawned fresh: {plan.unforked}")
    elif plan.scope:
        parts.append(f"shares a child: {plan.scope}")
    if plan.count or plan.every:
        parts.append(_boot(str(item.path), boots))
        if durations is not None and not plan.scope:
            parts.append(_backfill(durations.get(item.nodeid)))
    return "; ".join(parts)


def _backfill(seconds: float | None) -> str:
    if seconds is None:
        return "no duration recorded yet (it starts in pytest's order)"
    return (
        f"ran {seconds:.2f} s last time (it may start ahead of a test that waits for "
        "devices, if it ends before that test could start)"
    )


def _devices(plan: _packing.Plan) -> str:
    if plan.every:
        return "every GPU (what the parent sees)"
    if plan.count == 0:
        return "no GPU"
    return f"{plan.count} GPU" + ("s" if plan.count > 1 else "")


def _why_in_process(item: pytest.Item, settings: _settings.Settings) -> str:
    if settings.forced_inprocess:
        return settings.forced_inprocess.removeprefix("spawnrun: ")
    if settings.no_spawn:
        return "--no-spawn"
    return f"not marked {settings.marker}, and --spawn-gpu not given"


def _boot(path: str, boots: Mapping[str, str]) -> str:
    touched = boots.get(path)
    if touched is None:
        return "its child holds its devices from its start (its file's boot is not known yet)"
    if touched == ev.CONTEXT:
        return "its child holds its devices from its start (its file's boot makes a context)"
    what = "initializes the driver" if touched == ev.DRIVER else "touches no device"
    return f"its child may boot unclaimed (its file's boot {what})"
