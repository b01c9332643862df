"""Limits for the suite's waits that hold on a loaded machine (issue 47).

The suite must pass on a busy two-core CI machine (a load average of 8): there, starting
an interpreter, collecting and booting a child take several times what they take on a
quiet one. A wait whose only job is to catch a hang gets ``patient(quiet)``: the quiet
time times ``LOAD_PATIENCE``. Assertions that prove speed do not use it: they compare
against a measured baseline, a constant of spawnrun's, or the length of what they rule
out. Imported by test modules (a module of its own, as pytest advises against importing
from a conftest).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

#: How many times its quiet duration a wait that only catches a hang allows. Raise it
#: with SPAWNRUN_TEST_PATIENCE on a slower machine.
LOAD_PATIENCE = float(os.environ.get("SPAWNRUN_TEST_PATIENCE", "10"))

#: How often a wait looks again.
POLL = 0.05


def patient(quiet: float) -> float:
    """Seconds to allow for work that takes ``quiet`` seconds on a quiet machine."""
    return quiet * LOAD_PATIENCE


def wait_for(condition: Callable[[], object], what: str, quiet: float = 5.0) -> None:
    """Wait until ``condition()`` is true; fail naming ``what`` after ``patient(quiet)``."""
    limit = patient(quiet)
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {limit:.0f} s for {what}")
        time.sleep(POLL)


def finish(proc: subprocess.Popen[str], what: str, quiet: float = 5.0) -> str:
    """``proc``'s output once it exited; killed, and a failure naming ``what``, if it
    runs past ``patient(quiet)`` (its output is in the message)."""
    limit = patient(quiet)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"waited {limit:.0f} s for {what}; its output:\n{out}") from None
    return out or ""
