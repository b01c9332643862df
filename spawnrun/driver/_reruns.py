"""Every run a test had, shown: tests that ran again after a guess's evidence.

Runs in the parent. A test runs again only where its first run's failure points at a
guess of the run's (``learn._evidence``); its first run's failures are then kept
(``Replay.carry``) and logged as reruns before the reports that count. This module makes
the rest of pytest see both runs:

* ``--spawn-confirm strict``: a test that passed only when run again fails, saying so;
* junitxml: the first run as a ``flakyFailure`` (``flakyError``) of the test's case where
  the second run passed, else a ``rerunFailure`` (``rerunError``), with its traceback and
  output, as Maven Surefire's schema has them;
* ``--lf``: a test that passed only when run again stays among the last failed;
* the summary names each such test, the evidence, and both outcomes, and a section shows
  each first run's failure in full (``pytest_terminal_summary``).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any

import pytest

from spawnrun.config._plan import SETTINGS_KEY
from spawnrun.driver import _replay
from spawnrun.learn import _evidence
from spawnrun.learn import _unforked

#: The tests of this run that ran again, in the order they were reported.
RUNS_KEY = pytest.StashKey[list["Rerun"]]()

STRICT = (
    "spawnrun: --spawn-confirm strict: this test passed only when it ran again; its "
    "first run failed ({why}). That run's failure:"
)


@dataclass
class Rerun:
    nodeid: str
    why: str
    #: The first run's failures (outcome "rerun"), as logged.
    first: list[pytest.TestReport]
    #: What the run that counts came to: passed, failed, error or skipped.
    outcome: str = ""


def before_emit(replay: _replay.Replay) -> None:
    """Before a test that ran again is logged: under ``strict``, one that passed only
    when it ran again fails; the summary keeps both runs."""
    if not replay.earlier:
        return
    config = replay.item.config
    first_failed = any(_failed(r) for r in replay.earlier)
    counted_passed = not any(r.failed for r in replay.reports)
    if config.stash[SETTINGS_KEY].confirm == "strict" and first_failed and counted_passed:
        first = "\n\n".join(str(r.longrepr) for r in replay.earlier if r.longrepr)
        text = STRICT.format(why=replay.again_why) + "\n" + first
        replay.fail_passed("spawnrun: first run", text)
    run = Rerun(replay.item.nodeid, replay.again_why, list(replay.earlier))
    run.outcome = _unforked.outcome(replay.reports)
    config.stash.setdefault(RUNS_KEY, []).append(run)


class Logged:
    """Where pytest logs reports (this process, or xdist's controller, which gets its
    workers' reports): a test's kept first runs reach junitxml, as Surefire's
    ``flakyFailure``/``rerunFailure`` of the test's case, and one that passed only when it
    ran again stays among ``--lf``'s last failed. Both are done as its teardown report
    comes, before junitxml closes its case and after pytest's cache provider dropped it
    at its passed call."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        #: Node id -> its kept first runs that failed, and whether its counted run failed.
        self.pending: dict[str, tuple[list[pytest.TestReport], bool]] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        first, failed = self.pending.get(report.nodeid, ([], False))
        if report.outcome == "rerun":  # type: ignore[comparison-overlap]
            if _failed(report):
                self.pending[report.nodeid] = ([*first, report], failed)
            return
        if not first:
            return
        failed = failed or report.failed
        self.pending[report.nodeid] = (first, failed)
        if report.when != "teardown":
            return
        del self.pending[report.nodeid]
        _junit(self.config, report, first, flaky=not failed)
        if not failed:
            lfplugin = self.config.pluginmanager.get_plugin("lfplugin")
            lastfailed = getattr(lfplugin, "lastfailed", None)
            if isinstance(lastfailed, dict):
                lastfailed[report.nodeid] = True


def _failed(report: pytest.TestReport) -> bool:
    """Whether a kept first run's report failed (it says "rerun" now)."""
    return getattr(report, "spawnrun_first_outcome", "") == "failed"


def _junit(
    config: pytest.Config,
    teardown: pytest.TestReport,
    first: list[pytest.TestReport],
    flaky: bool,
) -> None:
    """The first run as Surefire's ``flakyFailure``/``rerunFailure`` of the test's case."""
    xml = _replay.junitxml(config)
    if xml is None:
        return
    case = xml.node_reporter(teardown)  # the test's case (an xdist worker's too)
    kind = "flaky" if flaky else "rerun"
    for report in first:
        error = report.when != "call"
        tag = kind + ("Error" if error else "Failure")
        message = _evidence.crash_message(report) or str(report.longrepr or "").split("\n")[0]
        why = getattr(report, "spawnrun_again", "")
        child = ET.Element(tag, message=f"{why}: {message}"[:1000])
        child.set("type", "spawnrun.rerun")
        trace = ET.SubElement(child, "stackTrace")
        trace.text = str(report.longrepr or "")
        for title, content in report.sections:
            if title.startswith("Captured stdout"):
                ET.SubElement(child, "system-out").text = content
            elif title.startswith("Captured stderr"):
                ET.SubElement(child, "system-err").text = content
        case.append(child)


def lines(config: pytest.Config) -> list[str]:
    """The summary's words: each test that ran again, why, and what each run came to."""
    runs = config.stash.get(RUNS_KEY, [])
    if not runs:
        return []
    flaky = [r for r in runs if r.outcome in ("passed", "skipped") and any(map(_failed, r.first))]
    out = [
        f"{len(runs)} test{'s' if len(runs) != 1 else ''} ran again where the first run's "
        "evidence pointed at a guess of the run's (both runs are reported; the second "
        "run's outcome counts):"
    ]
    for run in runs[:10]:
        first = _first_line(run.first)
        out.append(f"  {run.nodeid}: {run.why}; first run: {first}; then {run.outcome}")
    if len(runs) > 10:
        out.append(f"  ... and {len(runs) - 10} more")
    if flaky:
        strict = config.stash[SETTINGS_KEY].confirm == "strict"
        out.append(
            f"{len(flaky)} of them passed only when run again: flaky, or the guess's "
            + (
                "(failed: --spawn-confirm strict)"
                if strict
                else "(--spawn-confirm strict fails them)"
            )
            + ": "
            + ", ".join(r.nodeid for r in flaky[:5])
            + (" ..." if len(flaky) > 5 else "")
        )
    return out


def shown(config: pytest.Config) -> frozenset[str]:
    """The tests whose runs ``lines`` lists."""
    return frozenset(r.nodeid for r in config.stash.get(RUNS_KEY, []))


def _first_line(reports: list[pytest.TestReport]) -> str:
    for report in reports:
        message = _evidence.crash_message(report)
        if message:
            return f"{report.when}: {message.splitlines()[0][:160]}"
        text = str(report.longrepr or "").strip().splitlines()
        if text and _failed(report):  # a death's words (spawnrun's): its first line
            return f"{report.when}: {text[0][:160]}"
    return "passed"


def show_first_runs(terminalreporter: Any, config: pytest.Config) -> None:
    """Each first run's failure in full, as pytest's failures section shows one."""
    runs = config.stash.get(RUNS_KEY, [])
    if not any(_failed(r) for run in runs for r in run.first) or config.option.tbstyle == "no":
        return
    terminalreporter.write_sep("=", "first runs of tests that ran again (spawnrun)")
    for run in runs:
        for report in filter(_failed, run.first):
            terminalreporter.write_sep("_", f"{run.nodeid} (first run, {report.when})")
            terminalreporter.line(f"ran again: {run.why}")
            # The terminal writer pytest's own failures section writes reports with.
            report.toterminal(terminalreporter._tw)
            for title, content in report.sections:  # its output, stacks, as pytest shows
                terminalreporter.write_sep("-", title)
                terminalreporter.line(content.rstrip("\n"))
