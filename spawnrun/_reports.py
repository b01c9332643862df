"""Reports the parent makes itself: a test not found, a missing phase, a dead child.

Runs in the parent. Message prefixes are constants so tests can import them.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

NOT_FOUND = "spawnrun: the spawned child could not find this test"
NO_CALL = "spawnrun: the spawned child ended without a call report for this test"
NO_TEARDOWN = "spawnrun: the spawned child ended without a teardown report"
DIED = "spawnrun: the child process running this test died"
CHILD_NOTES = "spawnrun: child notes"
TIMEOUT = "Timeout"
REAPED = "spawnrun: reaped {n} process(es) left behind by this test"
STACKS = "spawnrun: Python stacks of all threads of the child"
CAPTURED = "spawnrun: output the test printed before the end (tail)"
OUTPUT = "spawnrun: child process stdout/stderr (tail)"
XFAIL_RAISES = (
    "spawnrun: the test is marked xfail(raises=...), and the death of a process "
    "is no exception of those types"
)


class SpawnrunWarning(pytest.PytestWarning):
    """Something spawnrun did on a test's behalf that its author should know."""


def warning(text: str, filename: str, lineno: int = 0) -> warnings.WarningMessage:
    return warnings.WarningMessage(SpawnrunWarning(text), SpawnrunWarning, filename, lineno)


def record_warning(config: pytest.Config, wm: warnings.WarningMessage, nodeid: str) -> None:
    """Into the warnings summary, as pytest records a warning raised by a test."""
    config.hook.pytest_warning_recorded.call_historic(
        kwargs=dict(warning_message=wm, when="runtest", nodeid=nodeid, location=None)
    )


def make(
    item: pytest.Item,
    when: str,
    outcome: str,
    longrepr: Any = None,
    sections: list[tuple[str, str]] | None = None,
) -> pytest.TestReport:
    return pytest.TestReport(
        nodeid=item.nodeid,
        location=item.location,
        keywords={k: 1 for k in item.keywords},
        outcome=outcome,  # type: ignore[arg-type]
        longrepr=longrepr,
        when=when,  # type: ignore[arg-type]
        sections=sections or [],
        duration=0.0,
        start=0.0,
        stop=0.0,
        user_properties=list(item.user_properties),
    )
