"""What a failed first run says about the run's guess: run the test again, or let it count.

Runs in the parent; pure (reports in, words out). Plain pytest runs a test once. A guess
of the run's (a fork of a template, a budget guessed on a first run or learned) may cause
a failure that a fresh spawned child run alone would not have; the test then runs again,
and that run counts. But a second run is itself unfaithful: a test that counts its runs,
fails on its first run ever, or leaves a directory behind fails otherwise the second time,
and a flaky test would be retried silently. So a test runs again only where its first
run's failure is of a kind the guess can cause:

* a budget (``memory``): out of memory (torch's and JAX's errors, a CUDA or cuBLAS
  allocation failure, ``MemoryError``), or a skip whose reason is memory;
* a fork (``fork``): an error that names forking (CUDA's "Cannot re-initialize CUDA in
  forked subprocess" and its kind), a hang pytest-timeout ended in the test's process, or
  a fork that saw the test give a variable another value than a library of its template
  read at import (``Done.doubt``; passed or not, it saw that library otherwise).

A process that died (a signal, the OOM killer, a hang) is judged where it ends
(``_jobends``). Any other failure is the test's own: it counts as it is, once.
"""

from __future__ import annotations

import re
from typing import Any

#: Words of an error that running out of (device or host) memory raises.
_MEMORY = re.compile(
    r"OutOfMemoryError|out of memory|RESOURCE_EXHAUSTED|\bMemoryError\b|"
    r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation|"
    r"CUDA_ERROR_OUT_OF_MEMORY|HIP_ERROR_OUT_OF_MEMORY|hipErrorOutOfMemory|"
    r"[Ff]ailed to allocate|[Nn]ot enough memory|[Ii]nsufficient memory",
)
#: Words of a skip's reason that says memory was short (a test that reads what is free).
_SKIP_MEMORY = re.compile(r"memory|\bOOM\b|VRAM", re.IGNORECASE)
#: Words of an error raised by state a fork inherited and may not use.
_FORK = re.compile(
    r"\bfork(ed|ing)?\b|after_fork|at_fork|re-?initiali[sz]e CUDA",
    re.IGNORECASE,
)
#: A hang that pytest-timeout ended inside the test's process (its own words).
_HANG = re.compile(r"Timeout \(>[0-9.]+s\) from pytest-timeout")
#: At most this much of a failure is searched (a traceback's last lines name its error).
_TAIL = 20_000


def memory(reports: list[Any]) -> str:
    """Why the first run's failure (or skip) may be a guessed budget's: "" if not."""
    for report in reports:
        if report.failed:
            found = _MEMORY.search(_words(report))
            if found:
                return f"it ran out of memory ({_line(report, found)})"
        elif report.skipped and not hasattr(report, "wasxfail"):
            found = _SKIP_MEMORY.search(_skip_reason(report))
            if found:
                return f"it skipped for want of memory ({_skip_reason(report)[:200]})"
    return ""


def fork(reports: list[Any], doubt: str = "") -> str:
    """Why the first run's outcome may be the fork's: "" if not. A doubt (the fork saw
    the test give a variable another value than a library of its template read at
    import) holds whatever the outcome: the test saw that library otherwise than a
    spawned child would, and may have passed because of it."""
    if doubt:
        return doubt
    failed = [r for r in reports if r.failed]
    for report in failed:
        found = _FORK.search(_words(report))
        if found:
            return f"its error names forking ({_line(report, found)})"
        found = _HANG.search(_words(report))
        if found:
            return f"it hung ({_line(report, found)})"
    return ""


def unsure(reports: list[Any]) -> bool:
    """Whether a forked test that did not fail may still owe its outcome to the fork: an
    xfail held in its call (it raised there: a failure that the mark hid; spawned, a
    strict xfail may pass, XPASS(strict)). A skip does not count: a project's own skips
    in the call are common and read its configuration (peft's suite skips 16 of 307
    sampled tests so), and each would cost a spawned child on the next run."""
    return any(r.when == "call" and r.skipped and hasattr(r, "wasxfail") for r in reports)


def crash_message(report: Any) -> str:
    """The exception and message pytest's traceback ends with ("": a report with no
    structured traceback, such as a death's words or a skip)."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    message = getattr(crash, "message", None)
    return message if isinstance(message, str) else ""


def _words(report: Any) -> str:
    """The failure's crash message and the error lines of its traceback."""
    text = str(getattr(report, "longrepr", "") or "")[-_TAIL:]
    errors = "\n".join(line for line in text.splitlines() if line.startswith("E "))
    return "\n".join(w for w in (crash_message(report), errors) if w)


def _line(report: Any, found: re.Match[str]) -> str:
    """The line of the failure that holds ``found``, shortened."""
    words = _words(report)
    start = words.rfind("\n", 0, found.start()) + 1
    end = words.find("\n", found.end())
    line = words[start : end if end >= 0 else len(words)].strip()
    line = line[1:].strip() if line.startswith("E ") else line
    # Its first sentence: CUDA's words go on about each process's memory.
    return line.split(". ")[0][:160]


def _skip_reason(report: Any) -> str:
    longrepr = getattr(report, "longrepr", None)
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr or "")
