"""Reports the parent makes itself: a test not found, a missing phase, a dead child.

Runs in the parent. Message prefixes are constants so tests can import them.
"""

from __future__ import annotations

import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

#: junitxml properties: the budget a test ran with, and the peak it is learned by.
BUDGET_PROPERTY = "spawnrun_budget_mib"
LEARNED_PEAK = "spawnrun_device_peak_mib"
#: A spawned test's wall time from its go to its end (its child's setup, call, teardown).
WALL_PROPERTY = "spawnrun_wall_s"
#: The cores it kept busy meanwhile, on average (what its job slots are learned by).
CPU_LOAD_PROPERTY = "spawnrun_cpu_load"

NOT_FOUND = "spawnrun: the spawned child could not find this test"
BOOT_FAILED = "spawnrun: pytest failed in the spawned child before it reached this test"
NO_CALL = "spawnrun: the spawned child ended without a call report for this test"
NO_TEARDOWN = "spawnrun: the spawned child ended without a teardown report"
DIED = "spawnrun: the child process running this test died"
NOT_STARTED = "spawnrun: the child process for this test could not be started"
STUCK = "spawnrun: nothing could start this test (a scheduling bug: please report it)"
CHILD_NOTES = "spawnrun: child notes"
PIPE_CLOSED = (
    "it closed its pipe to the parent before reporting the end of the test (did the test "
    "close the file descriptors it inherited?) and, still running, was killed"
)
UNREADABLE = "what it sent the parent cannot be read"
TIMEOUT = "Timeout"
REAPED = "spawnrun: reaped {n} process(es) left behind by this test"
#: What the test's own process found still running below it as it left (``_leftovers``).
LEFT_RUNNING = (
    "spawnrun: this test left {n} process(es) running, ended as its process left "
    "(SIGTERM, then SIGKILL after {grace:g} s): {names}"
)
NO_PROC = (
    "spawnrun: /proc is not mounted: processes that spawned tests leave behind cannot be "
    "found, so they are neither ended nor counted (mount /proc to have them reaped)"
)
STUCK_EXIT = (
    "spawnrun: the child of this test did not exit within {s:g} s of the test's end and "
    "was killed (a non-daemon thread or process it left behind?)"
)
BAD_EXIT = "spawnrun: the child of this test exited with status {code} after the test's end"
STACKS = "spawnrun: Python stacks of all threads of the child"
#: At a timeout, one section for each process below the child.
BELOW = "spawnrun: Python stacks of process {pid} (parent {ppid}): {command}"
NOT_ASKED = (
    "(not asked: it never loaded spawnrun's hook, being no Python process, or started "
    "with -I/-S/-E or an environment without the child's PYTHONPATH)"
)
NO_ANSWER = (
    "(asked, but it wrote nothing before the kill: it may have replaced the SIGUSR1 "
    "handler, or ended meanwhile)"
)
#: Processes below a child shown at most, each stack at most TAIL_BYTES.
BELOW_SHOWN = 32
INTERRUPTED_RUNNING = "spawnrun: interrupted while these tests ran in children (killed)"
CAPTURED = "spawnrun: output the test printed before the end (tail)"
OUTPUT = "spawnrun: child process stdout/stderr (tail)"
BOOT_NOTE = "spawnrun: booted ahead"
TAIL_BYTES = 8192
XFAIL_RAISES = (
    "spawnrun: the test is marked xfail(raises=...), and the death of a process "
    "is no exception of those types"
)


class SpawnrunWarning(pytest.PytestWarning):
    """Something spawnrun did on a test's behalf that its author should know."""


def warning(text: str, filename: str = "", lineno: int = 0) -> warnings.WarningMessage:
    """A warning at a test's location or, by default, where spawnrun gives it.

    pytest prints ``file:line`` before every warning; a run-wide note without a test
    points at spawnrun's own code, as pytest's own warnings do, never at line 0.
    """
    if not filename:
        caller = sys._getframe(1)
        filename, lineno = caller.f_code.co_filename, caller.f_lineno
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


def killed_by(code: int | None) -> str:
    """The cause 'killed by signal NAME (N)' for an exit code -N; "" for any other."""
    if code is None or code >= 0:
        return ""
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown signal"
    return f"killed by signal {name} ({-code})"


def death_text(nodeid: str, phase: str, code: int | None, cause: str = "") -> str:
    """What ended a child: ``cause`` where the parent knows better (a closed pipe), else
    the signal (with the OOM hint for SIGKILL) or exit status."""
    if cause:
        pass
    elif killed_by(code):
        cause = killed_by(code)
        if code == -signal.SIGKILL:
            cause += "; the kernel's out-of-memory killer is a common cause"
    elif code is None:
        cause = "ended with an unknown status before reporting the end of the test"
    else:
        cause = f"exited with status {code} before reporting the end of the test"
    return f"{DIED} during {phase}: {cause}\nnode id: {nodeid}"


def evidence(
    spec: Any, reaped: int, below: Sequence[tuple[int, int, str, str]] = ()
) -> list[tuple[str, str]]:
    """What a person needs to debug a dead or stuck child: stacks and output tails.

    ``below``: the processes below the child at a timeout (pid, parent pid, command
    line, where it was asked to write its stacks or "" if it could not be asked).
    """
    sections = []
    stacks_path = Path(spec.stacks_path)
    workdir = stacks_path.parent
    stacks = tail(stacks_path)
    if stacks:
        sections.append((STACKS, stacks))
    for pid, ppid, command, path in below[:BELOW_SHOWN]:
        text = (tail(Path(path)) or NO_ANSWER) if path else NOT_ASKED
        sections.append((BELOW.format(pid=pid, ppid=ppid, command=command), text))
    if len(below) > BELOW_SHOWN:
        rest = " ".join(str(p[0]) for p in below[BELOW_SHOWN:])
        sections.append(("spawnrun", f"{len(below) - BELOW_SHOWN} more processes: {rest}"))
    captured = [tail(p) for p in sorted(workdir.glob("capture-*.out"))]
    captured = [c for c in captured if c]
    if captured:
        sections.append((CAPTURED, "\n".join(captured)))
    if spec.log_path:
        out = tail(Path(spec.log_path))
        if out:
            sections.append((OUTPUT, out))
    if reaped:
        sections.append(("spawnrun", REAPED.format(n=reaped)))
    return sections


def size_of(path: str | Path) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


def tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    if size > TAIL_BYTES:
        data = f"[... {size - TAIL_BYTES} bytes cut ...]\n" + data
    return data.strip()


#: The section that says why a scope's child did not run the next test.
#: The summary's words for files whose template may not fork their tests.
NOT_A_TEMPLATE = (
    "not forked from a template that collected it (unsafe to fork after its collection); "
    "each test collected its file in a child of its own"
)
REPLACED_TITLE = "spawnrun: child replaced"


#: A running test's report when the session stopped under it.
STOPPED = (
    "spawnrun: stopped while running, because the session stopped (-x, --maxfail or an interrupt)"
)

#: Why a test's first failure did not count: it started before a test pytest reached
#: first (backfilled while that one waited for its devices, or past a gathered test).
OUT_OF_ORDER = "ran out of order (backfilled, or past a test waiting for its devices alone)"
