"""Tests whose outcome a fork may have changed: confirmed spawned, never forked again.

Runs in the parent. Fast mode forks a test from a template: a guess that the template's
imports, seeded streams and module state are what the test's own spawned child would
have. Where a forked test fails, or its fork saw it write a variable the template's
imports had read (``Done.doubt``), it runs again in a fresh spawned child and that run's
reports count (``_units.Units._again``). Each such test is kept here for the summary and
in pytest's cache (``spawnrun/unforked``, node id -> why): the next run spawns it fresh
from the start (``Plan.unforked``) instead of repeating the guess.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

KEY = "spawnrun/unforked"
#: Records kept at most (the oldest go first).
LIMIT = 5_000
#: This run's: node id -> (why, outcome in the fork, outcome spawned).
RUN_KEY = pytest.StashKey[dict[str, list[str]]]()

FAILED_IN_FORK = "it failed in a fork of a template"
NOT_FOUND_IN_FORK = "a fork of a template did not find it"
REMEMBERED = "an earlier run: {why}"


def remembered(config: Any) -> dict[str, str]:
    """What earlier runs recorded, validated: node id -> why (never raises)."""
    cache = getattr(config, "cache", None)
    if cache is None:
        return {}
    try:
        found = cache.get(KEY, {})
    except Exception:  # noqa: BLE001 - an unreadable cache is an empty one
        return {}
    if not isinstance(found, dict):
        return {}
    return {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}


def note(config: Any, nodeid: str, why: str, outcome: str) -> None:
    """The test ran again spawned because of ``why``; ``outcome``: in the fork."""
    config.stash.setdefault(RUN_KEY, {})[nodeid] = [why, outcome, ""]


def confirmed(config: Any, nodeid: str, outcome: str) -> None:
    """The spawned run of a test noted here ended with ``outcome``."""
    entry = config.stash.get(RUN_KEY, {}).get(nodeid)
    if entry is not None and not entry[2]:
        entry[2] = outcome


def save(config: Any) -> None:
    """Keep this run's records for the next (with the earlier ones, most recent last)."""
    run = config.stash.get(RUN_KEY, {})
    cache = getattr(config, "cache", None)
    if not run or cache is None:
        return
    kept = {k: v for k, v in remembered(config).items() if k not in run}
    kept.update({nodeid: why for nodeid, (why, _, _) in run.items()})
    with contextlib.suppress(Exception):  # a read-only cache: the guess is made again
        cache.set(KEY, dict(list(kept.items())[-LIMIT:]))


def lines(config: Any) -> list[str]:
    """The summary's words for the tests a fork's guess may have changed."""
    run = config.stash.get(RUN_KEY, {})
    if not run:
        return []
    changed = [n for n, (_, fork, spawned) in run.items() if spawned and spawned != fork]
    out = [
        f"{len(run)} test{'s' if len(run) != 1 else ''} ran again in a fresh spawned child "
        "after a fork (that run's outcome counts; the next run does not fork "
        f"{'them' if len(run) != 1 else 'it'}):"
    ]
    for nodeid, (why, fork, spawned) in list(run.items())[:10]:
        outcome = f"{fork} forked, {spawned or 'not run'} spawned"
        out.append(f"  {nodeid}: {why} ({outcome})")
    if len(run) > 10:
        out.append(f"  ... and {len(run) - 10} more")
    if changed:
        out.append(
            f"  the fork changed the outcome of {len(changed)}: {', '.join(changed[:5])}"
            + (" ..." if len(changed) > 5 else "")
        )
    return out


def outcome(reports: list[Any]) -> str:
    """What a test's reports came to: error, failed, skipped or passed."""
    if any(r.failed and r.when != "call" for r in reports):
        return "error"
    if any(r.failed for r in reports):
        return "failed"
    if any(r.skipped for r in reports):
        return "skipped"
    return "passed"
