"""Tests whose outcome a fork may have changed: not forked again while they are as they were.

Runs in the parent. Fast mode forks a test from a template: a guess that the template's
imports, seeded streams and module state are what the test's own spawned child would
have. Where a forked test's failure points at the fork (``learn._evidence``: an error
that names forking, a failure where its fork saw it write a variable the template's
imports had read, a death in the fork), it runs again in a fresh spawned child and that
run's reports count (``_units.Units._again``). Where a forked test failed with no such
sign, or passed in doubt, its report counts as it is, once (a second run is unfaithful
itself), and it is ``unsure``. Each such test is kept here for the summary and in
pytest's cache (``spawnrun/unforked``, node id -> why and the signature of its file and
conftests): the next run spawns it fresh from the start (``Plan.unforked``) instead of
repeating the guess, until the test's file or its conftests change (a fixed test is
forked again).

Except where the fork was not to blame: a test that failed in its fork and in its
spawned run alike (the same outcome, the same failure: the phase, the exception and its
message) is kept as a known failure (node id -> its failure and the signature of its
file and conftests, ``_boots.signature``). While those are unchanged, the next run forks
it again, and where it fails there with that same failure, the fork's reports count
(``Plan.known_failure``): a spawned child would report what two processes already did.
Any other failure, or a changed file, is confirmed spawned as before. peft's suite has
seven tests that fail in every mode; each spawned confirmation collects an 18,413-id
file (about 8 s on two cores).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from spawnrun.learn import _boots
from spawnrun.learn import _evidence

KEY = "spawnrun/unforked"
#: Records kept at most (the oldest go first).
LIMIT = 5_000
#: This run's: node id -> (why, outcome in the fork, outcome spawned, failure in the
#: fork, failure spawned).
RUN_KEY = pytest.StashKey[dict[str, list[str]]]()
#: This run's tests that failed forked as they had failed spawned (not run again).
KNOWN_KEY = pytest.StashKey[list[str]]()
#: This run's forked tests that failed with no sign the fork was to blame, or skipped
#: themselves (their reports count; the next run spawns them): node id -> (why, the
#: failure in the fork).
UNSURE_KEY = pytest.StashKey[dict[str, tuple[str, str]]]()
#: This run's tests spawned, not forked, because an earlier run's record says so.
RECORDED_KEY = pytest.StashKey[list[str]]()
#: This run's tests spawned because of such a record, that failed as their fork had:
#: node id -> that failure (the fork was not to blame: a known failure from now on).
ALIKE_KEY = pytest.StashKey[dict[str, str]]()
#: A failure's words kept at most.
FAILURE_LIMIT = 2_000

FAILED_IN_FORK = "it failed in a fork of a template"
XFAILED_IN_FORK = "an xfail held in a fork of a template (it raised there)"
NOT_FOUND_IN_FORK = "a fork of a template did not find it"
REMEMBERED = "an earlier run: {why}"


def _records(config: Any) -> dict[str, Any]:
    """What earlier runs recorded, validated: node id -> why, or a known failure's
    record (never raises)."""
    cache = getattr(config, "cache", None)
    if cache is None:
        return {}
    try:
        found = cache.get(KEY, {})
    except Exception:  # noqa: BLE001 - an unreadable cache is an empty one
        return {}
    if not isinstance(found, dict):
        return {}
    return {k: v for k, v in found.items() if isinstance(k, str) and _valid(v)}


def _valid(record: Any) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("signature"), str):
        return False  # (a bare reason: an older record, kept for good; expired now)
    if "why" in record:
        forked = record.get("forked_failure", "")
        return isinstance(record["why"], str) and bool(record["why"]) and isinstance(forked, str)
    return isinstance(record.get("failure"), str) and bool(record["failure"])


def remembered(config: Any) -> dict[str, str]:
    """Tests an earlier run doubted, their file and conftests unchanged since: node id ->
    why (never raises)."""
    doubted = {}
    for nodeid, record in _records(config).items():
        if "why" in record and _unchanged(config, nodeid, record["signature"]):
            doubted[nodeid] = record["why"]
    return doubted


def known_failures(config: Any) -> dict[str, str]:
    """Tests that failed forked and spawned alike in an earlier run, their file and
    conftests unchanged since: node id -> that failure (never raises)."""
    known = {}
    for nodeid, record in _records(config).items():
        if "failure" in record and _unchanged(config, nodeid, record["signature"]):
            known[nodeid] = record["failure"]
    return known


def _unchanged(config: Any, nodeid: str, signature: str) -> bool:
    """Whether the test's file and conftests are as they were when ``signature`` was
    taken (a file that could not be read then has none: never unchanged)."""
    return bool(signature) and signature == _signature(config, nodeid)


def _signature(config: Any, nodeid: str) -> str:
    """The modification times of the test's file and its conftests (``_boots``)."""
    root = Path(str(config.rootpath))
    return _boots.signature(str(root / nodeid.split("::")[0]), root)


def failure(reports: list[Any]) -> str:
    """A failed test's failure, to compare between runs: the phase, then the crash
    line (the exception and its message); "" where none failed."""
    for report in reports:
        if not report.failed:
            continue
        # (pytest's crash message always names the exception: never empty)
        words = _evidence.crash_message(report)
        words = words or (str(report.longrepr).strip().splitlines() or [""])[-1]
        return f"{report.when}: {words}"[:FAILURE_LIMIT]
    return ""


def accepted(config: Any, nodeid: str) -> None:
    """The test failed in its fork as it had failed spawned: that report counts."""
    config.stash.setdefault(KNOWN_KEY, []).append(nodeid)


def unsure(config: Any, nodeid: str, why: str, outcome: str, failed: str = "") -> None:
    """The test ``outcome``-ed in its fork (``why``; ``failed``: its failure there) with
    no sign the fork was to blame: that report counts; the next run spawns it."""
    config.stash.setdefault(UNSURE_KEY, {})[nodeid] = (f"{why} ({outcome} forked, counted)", failed)


def spawned_by_record(config: Any, nodeid: str) -> None:
    """This run spawns the test, not forking it, as an earlier run's record says."""
    config.stash.setdefault(RECORDED_KEY, []).append(nodeid)


def spawned(config: Any, nodeid: str, failed: str) -> None:
    """A test spawned because an earlier run was unsure of its fork ended with
    ``failed`` ("" none): where its fork had failed so, the fork was not to blame, and the
    next run forks it again, trusting that failure (a known failure)."""
    record = _records(config).get(nodeid)
    if record and failed and record.get("forked_failure") == failed:
        config.stash.setdefault(ALIKE_KEY, {})[nodeid] = failed


def note(config: Any, nodeid: str, why: str, outcome: str, failed: str = "") -> None:
    """The test ran again spawned because of ``why``; ``outcome`` and ``failed``: in
    the fork."""
    config.stash.setdefault(RUN_KEY, {})[nodeid] = [why, outcome, "", failed, ""]


def confirmed(config: Any, nodeid: str, outcome: str, failed: str = "") -> None:
    """The spawned run of a test noted here ended with ``outcome`` (``failed``)."""
    entry = config.stash.get(RUN_KEY, {}).get(nodeid)
    if entry is not None and not entry[2]:
        entry[2], entry[4] = outcome, failed


def save(config: Any) -> None:
    """Keep this run's records for the next (with the earlier ones, most recent last)."""
    run = config.stash.get(RUN_KEY, {})
    unsure_ = config.stash.get(UNSURE_KEY, {})
    alike = config.stash.get(ALIKE_KEY, {})
    cache = getattr(config, "cache", None)
    if not (run or unsure_ or alike) or cache is None:
        return
    new = run.keys() | unsure_.keys() | alike.keys()
    kept = {k: v for k, v in _records(config).items() if k not in new}
    for nodeid, (why, failed) in unsure_.items():
        record = {"why": why, "signature": _signature(config, nodeid)}
        kept[nodeid] = {**record, "forked_failure": failed} if failed else record
    for nodeid, failed in alike.items():
        kept[nodeid] = {"failure": failed, "signature": _signature(config, nodeid)}
    for nodeid, (why, fork, spawned, fork_failed, spawned_failed) in run.items():
        signature = _signature(config, nodeid)
        alike = fork == spawned and fork_failed == spawned_failed
        if alike and spawned_failed:
            kept[nodeid] = {"failure": spawned_failed, "signature": signature}
        else:
            kept[nodeid] = {"why": why, "signature": signature}
    with contextlib.suppress(Exception):  # a read-only cache: the guess is made again
        cache.set(KEY, dict(list(kept.items())[-LIMIT:]))


def lines(config: Any, shown: frozenset[str] = frozenset()) -> list[str]:
    """The summary's words for the tests a fork's guess may have changed (``shown``:
    those that ran again whose runs another line lists)."""
    run = config.stash.get(RUN_KEY, {})
    known = config.stash.get(KNOWN_KEY, [])
    unsure_ = config.stash.get(UNSURE_KEY, {})
    recorded = config.stash.get(RECORDED_KEY, [])
    out = []
    if recorded:
        many = len(recorded) != 1
        out.append(
            f"{len(recorded)} test{'s' if many else ''} spawned, not forked, as an earlier "
            f"run's record says (--spawn-explain says why for each): {', '.join(recorded[:5])}"
            + (" ..." if len(recorded) > 5 else "")
        )
    if unsure_:
        many = len(unsure_) != 1
        kept = getattr(config, "cache", None) is not None
        out.append(
            f"{len(unsure_)} forked test{'s' if many else ''} ended where the fork may have "
            "changed what they saw, with no sign it did (a failure of the test's own, an "
            "xfail that held): "
            f"{'their reports count' if many else 'its report counts'}, not run again"
            + (
                f"; the next run spawns {'them' if many else 'it'} while "
                f"{'their files and conftests are' if many else 'its file and conftests are'}"
                " unchanged:"
                if kept
                else ":"
            )
        )
        for nodeid, (why, _) in list(unsure_.items())[:10]:
            out.append(f"  {nodeid}: {why}")
        if len(unsure_) > 10:
            out.append(f"  ... and {len(unsure_) - 10} more")
    if known:
        out.append(
            f"{len(known)} test{'s' if len(known) != 1 else ''} failed in a fork as "
            f"{'they' if len(known) != 1 else 'it'} failed spawned in an earlier run, "
            "file and conftests unchanged (the fork's report counts, not run again): "
            + ", ".join(known[:5])
            + (" ..." if len(known) > 5 else "")
        )
    if not run:
        return out
    changed = [n for n, (_, fork, spawned, *_) in run.items() if spawned and spawned != fork]
    out += [
        f"{len(run)} test{'s' if len(run) != 1 else ''} ran again in a fresh spawned child "
        "after a fork (that run's outcome counts; the next run does not fork "
        f"{'them' if len(run) != 1 else 'it'}):"
    ]
    listed = [(n, r) for n, r in run.items() if n not in shown]
    for nodeid, (why, fork, spawned, *_) in listed[:10]:
        outcome = f"{fork} forked, {spawned or 'not run'} spawned"
        out.append(f"  {nodeid}: {why} ({outcome})")
    if len(listed) > 10:
        out.append(f"  ... and {len(listed) - 10} more")
    if len(listed) < len(run):
        out.append(f"  {len(run) - len(listed)} listed below, with both runs")
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
