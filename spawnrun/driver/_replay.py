"""Replay one spawned test's reports through the parent's hooks.

Runs in the parent. ``Replay`` buffers what a child reported (reports and warnings,
and the failures the parent made for it). When the test's reports are complete,
``Replay.emit`` feeds everything through the parent's hooks at once
(``logstart``, ``logreport`` for each phase, warnings, ``logfinish``), so the terminal,
``-x``, junitxml, ``--lf`` and other plugins see ordinary reports, also when several
children run at the same time. Every test ends with a setup, (call) and teardown
report, whatever its child did: missing phases are synthesized as failures.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any
from typing import NoReturn

import pytest

from spawnrun.wire import _replies
from spawnrun.wire import _reports


class Replay:
    """The reports and warnings of one test, buffered in pytest's order."""

    def __init__(self, item: pytest.Item) -> None:
        self.item = item
        #: The current execution's reports by phase (pytest-rerunfailures runs a test
        #: several times in one child: a new execution starts at its setup).
        self.seen: dict[str, pytest.TestReport] = {}
        #: The phase the child entered last, and how many executions it started.
        self.phase = ""
        self.executions = 0
        #: Reports made but not yet logged by the child (``Report.pending``), by phase.
        self.pending: dict[str, pytest.TestReport] = {}
        self.reports: list[pytest.TestReport] = []
        self.warnings: list[warnings.WarningMessage] = []
        #: What reached the child's terminal during the test, printed in its place:
        #: before the report of the same index, and after the last one.
        self.terminal_before: dict[int, str] = {}
        self.terminal = ""
        #: ``record_xml_attribute`` calls of the child, for junitxml.
        self.xml_attributes: list[tuple[str, str]] = []
        #: (name, value) pairs added to every report: devices, wall time.
        self.properties: list[tuple[str, object]] = []
        #: Whether ``pytest_runtest_logstart`` was called for this test.
        self.started = False
        #: Earlier runs' failures (and skips), kept where the test ran again (``carry``):
        #: logged before this run's reports, with pytest-rerunfailures' outcome "rerun".
        self.earlier: list[pytest.TestReport] = []
        #: Why it ran again: its first run's evidence against the run's guess.
        self.again_why = ""

    def enter(self, when: str) -> None:
        self.phase = when
        if when == "setup":
            self.executions += 1
            self.seen = {}
            self.pending = {}

    def add_pending(self, report: pytest.TestReport) -> None:
        self.pending[str(report.when)] = report

    def add(self, report: pytest.TestReport, terminal: str = "") -> None:
        if terminal:
            self.terminal_before[len(self.reports)] = terminal
        self.pending.pop(str(report.when), None)
        self.seen[str(report.when)] = report  # typed Optional before pytest 8.4
        self.reports.append(report)

    def fail(self, when: str, text: str, sections: list[tuple[str, str]] | None = None) -> None:
        self.add(_reports.make(self.item, when, "failed", text, sections))

    def died(self, when: str, text: str, sections: list[tuple[str, str]]) -> None:
        """A failure with no exception behind it: a crash or a timeout.

        xfail applies as to an exception raised in-process: an xfail test (strict or
        not) is xfailed, unless ``raises=`` names exception types, which a dead
        process is not one of: then it fails, saying why.
        """
        # Reports still to be logged when it died stand for their phases; a setup it
        # got past passed.
        for phase in ("setup", "call"):
            if phase in self.pending and phase not in self.seen:
                self.add(self.pending[phase])
        if when != "setup" and "setup" not in self.seen:
            self.add(_reports.make(self.item, "setup", "passed"))
        xfailed = _xfail_of(self.item)
        if xfailed is None:
            self.fail(when, text, sections)
        elif xfailed.raises is None:
            rep = _reports.make(self.item, when, "skipped", text, sections)
            rep.wasxfail = xfailed.reason
            self.add(rep)
        else:
            self.fail(when, f"{text}\n{_reports.XFAIL_RAISES}", sections)
        self.ensure_teardown()

    def pending_phase(self) -> str:
        """The phase a child that ends now leaves unfinished."""
        if self.phase and self.phase not in self.seen:
            return self.phase
        setup = self.seen.get("setup")
        if setup is None:
            return "setup"
        if setup.passed and "call" not in self.seen and _calls(self.item):
            return "call"
        return "teardown"

    def complete(self, notes: list[str]) -> None:
        """After a normal end: a passed setup needs a call report (the silent-pass guard).

        ``notes`` are errors the child met outside the test; they explain a missing
        report, so they go into the failure, else onto the teardown report.
        """
        extra = "".join(f"\n\n{_reports.CHILD_NOTES}:\n{n}" for n in notes)
        if "setup" not in self.seen:
            self.fail("setup", _reports.NO_CALL + " (nor any other report)" + extra)
        elif self.seen["setup"].passed and "call" not in self.seen and _calls(self.item):
            self.fail("call", _reports.NO_CALL + extra)
        elif "teardown" not in self.seen:
            self.fail("teardown", _reports.NO_TEARDOWN + extra)
        elif notes:
            self.note(_reports.CHILD_NOTES, "\n".join(notes))
        self.ensure_teardown()

    def rerun(self, execution: int) -> bool:
        """Turn the current execution's failures into reruns; False if it has none."""
        failed = [r for r in self.seen.values() if r.failed]
        if not failed:
            return False
        for report in failed:
            # pytest-rerunfailures' own outcome, which its report_teststatus renders.
            report.outcome = "rerun"  # type: ignore[assignment]
            report.rerun = execution  # type: ignore[attr-defined]
        self.seen = {}
        self.phase = ""
        return True

    def carry(self, first: Replay, why: str) -> None:
        """This run follows ``first``'s, which ended where a guess of the run's may be to
        blame (``why``): its failures and skips (where it passed in doubt, its call) are
        kept, to be shown as reruns before the reports that count; nothing else of it is
        (a passed setup would be a second test to junitxml)."""
        self.earlier = list(first.earlier)
        kept = [r for r in first.reports if r.failed or r.skipped]
        if not kept:  # it passed in doubt: its call (else setup) is the run shown
            kept = [r for r in first.reports if r.when == "call"] or first.reports[:1]
        for report in kept:
            report.spawnrun_first_outcome = report.outcome  # type: ignore[attr-defined]
            report.outcome = "rerun"  # type: ignore[assignment]
            report.rerun = len(self.earlier)  # type: ignore[attr-defined]
            report.spawnrun_again = why  # type: ignore[attr-defined]
            self.earlier.append(report)
        self.again_why = why

    def ensure_teardown(self) -> None:
        if "teardown" not in self.seen:
            self.add(_reports.make(self.item, "teardown", "passed"))

    def fail_passed(self, title: str, text: str) -> None:
        """The test fails after the fact: its passed call (else its passed setup) becomes
        a failure saying ``text``, its output kept; a test that failed already gets
        ``text`` as a section of its failure."""
        for when in ("call", "setup"):
            report = self.seen.get(when)
            if report is None or not report.passed:
                continue
            failed = _reports.make(self.item, when, "failed", text, list(report.sections))
            failed.duration, failed.start, failed.stop = report.duration, report.start, report.stop
            failed.user_properties = list(report.user_properties)
            self.reports[self.reports.index(report)] = self.seen[when] = failed
            return
        self.note_failure(title, text)

    def note_failure(self, title: str, text: str) -> None:
        """A section on the test's first failure (else its teardown report)."""
        target = next((r for r in self.reports if r.failed), self.seen.get("teardown"))
        if target is not None:
            target.sections.append((title, text))

    def note(self, title: str, text: str) -> None:
        """A section on the teardown report (the one junitxml and -rA show last)."""
        teardown = self.seen.get("teardown")
        if teardown is not None:
            teardown.sections.append((title, text))

    def emit(self, parent_error: pytest.TestReport | None, interrupted: bool = False) -> None:
        """Feed everything through the parent's hooks, the parent's teardown merged in.

        ``parent_error`` is a failure of the parent's own fixture teardown down to the
        next test (fixtures shared with in-process tests); pytest would report it on
        this test's teardown. A test that stopped the session (``interrupted``) gets
        only the reports it made, as in-process pytest would show.
        """
        item = self.item
        self.start()
        if self.xml_attributes:
            _xml_attributes(item, self.xml_attributes)
        for report in self.earlier:
            item.ihook.pytest_runtest_logreport(report=report)
        if interrupted:
            for i, report in enumerate(self.reports):
                self._write(self.terminal_before.get(i, ""))
                item.ihook.pytest_runtest_logreport(report=report)
            self._write(self.terminal)
            return
        for i, report in enumerate(self.reports):
            self._write(self.terminal_before.get(i, ""))
            if report.when == "teardown" and parent_error is not None:
                if report.passed:
                    report = parent_error
                else:
                    report.sections.append(
                        ("spawnrun: parent teardown error", str(parent_error.longrepr))
                    )
            report.user_properties.extend(self.properties)
            item.ihook.pytest_runtest_logreport(report=report)
        self._write(self.terminal)
        for wm in self.warnings:
            _reports.record_warning(item.config, wm, item.nodeid)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)

    def start(self) -> None:
        """Log the test's start (once): with -v, its node id line."""
        if not self.started:
            self.started = True
            item = self.item
            item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)

    def start_live(self) -> None:
        """With -s, log the start before the child runs, as pytest does before a test.

        The child writes straight to the parent's terminal; in-process, what a test
        prints follows its node id line. Only for a test that runs alone: several at
        once share the terminal, and their lines come in the order they end.
        """
        config = self.item.config
        if config.getoption("capture") != "no":
            return
        self.start()
        # The child writes to the terminal's file, not through this process's buffers.
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.flush()
        with contextlib.suppress(Exception):  # a replaced or closed stdout
            sys.stdout.flush()

    def _write(self, text: str) -> None:
        """Print what the child's terminal got, as pytest would have printed it."""
        reporter = self.item.config.pluginmanager.get_plugin("terminalreporter")
        if text and reporter is not None:
            reporter.write(text)


def _calls(item: pytest.Item) -> bool:
    """Whether pytest calls the test after its setup (not with --setup-only/--setup-plan)."""
    return not item.config.getoption("setuponly", False)


class Rendered:
    """A failure rendering that crossed the wire as text (a doctest's ``ReprFailDoctest``).

    In-process it has no one-line crash message, so the short summary shows none; a
    plain string would put its first line there.
    """

    def __init__(self, text: str) -> None:
        self.text = text

    def toterminal(self, out: Any) -> None:
        for line in self.text.split("\n"):
            out.line(line)

    def __str__(self) -> str:
        return self.text


def restore(report: pytest.TestReport, data: dict[str, Any], rendered: bool) -> None:
    """Undo what a report's trip through JSON changed (what pytest's own decoding misses)."""
    if rendered and isinstance(report.longrepr, str):
        report.longrepr = Rendered(report.longrepr)  # type: ignore[assignment]
    # pytest's subtest reports repr their kwargs when made and again when decoded
    # (pytest 9's ``SubtestContext._from_json``): keep the values as sent.
    context = getattr(report, "context", None)
    sent = data.get("_subtest.context")
    if context is not None and isinstance(sent, dict) and isinstance(sent.get("kwargs"), dict):
        with contextlib.suppress(Exception):
            object.__setattr__(context, "kwargs", dict(sent["kwargs"]))


def raise_interrupt(msg: _replies.Interrupted) -> NoReturn:
    """Stop the parent's session as the child's test stopped its own.

    A KeyboardInterrupt is raised from a frame placed at the test's own line (code
    compiled under the test file's name): pytest names the place an interrupt was
    raised under its banner, and that place is the test's, not spawnrun's.
    """
    if not msg.keyboard:
        pytest.exit(msg.message, msg.returncode)
    exc = KeyboardInterrupt(msg.message) if msg.message else KeyboardInterrupt()
    if msg.path and msg.lineno > 0:
        code = compile("\n" * (msg.lineno - 1) + "raise exc", msg.path, "exec")
        exec(code, {"exc": exc})
    raise exc


def _xfail_of(item: pytest.Item) -> Any:
    # pytest evaluates xfail conditions in _pytest.skipping and has no public API for
    # it; the parent needs the verdict to judge a crash as pytest would an exception.
    if item.config.option.runxfail:
        return None
    from _pytest.skipping import evaluate_xfail_marks

    return evaluate_xfail_marks(item)


def warning_message(rec: _replies.WarningRecord) -> warnings.WarningMessage:
    """Rebuild a child's warning without importing anything in the parent.

    The class is taken from a module the parent already has (``sys.modules``); a
    warning class of a module the parent never imported (torch's, say) becomes a
    stand-in subclass of UserWarning that keeps its name and module, so the summary
    reads the same and the parent never imports a library for a warning's sake.
    """
    category: type[Warning] | None = None
    found: Any = sys.modules.get(rec.category_module)
    for part in rec.category_name.split("."):
        found = getattr(found, part, None)
    if isinstance(found, type) and issubclass(found, Warning):
        category = found
    else:
        category = _stand_in(rec.category_module, rec.category_name)
    try:
        message: Warning = category(rec.message)
    except Exception:  # noqa: BLE001 - a category with a custom signature
        category = _stand_in(rec.category_module, rec.category_name)
        message = category(rec.message)
    return warnings.WarningMessage(message, category, rec.filename, rec.lineno)


_STAND_INS: dict[tuple[str, str], type[Warning]] = {}


def _stand_in(module: str, qualname: str) -> type[Warning]:
    key = (module, qualname)
    if key not in _STAND_INS:
        name = qualname.rsplit(".", 1)[-1]
        cls = type(name, (UserWarning,), {"__module__": module, "__qualname__": qualname})
        _STAND_INS[key] = cls
    return _STAND_INS[key]


def parent_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> pytest.TestReport | None:
    """Tear the parent's fixture stack down to what ``nextitem`` still needs.

    pytest keeps that stack in ``session._setupstate`` and exposes no public API for
    it; without this, in-process tests sharing a module or class with spawned ones
    fail with "previous item was not torn down properly".
    """
    setupstate = item.session._setupstate
    call = pytest.CallInfo.from_call(
        lambda: setupstate.teardown_exact(nextitem),
        when="teardown",
        reraise=(pytest.exit.Exception, KeyboardInterrupt),
    )
    if call.excinfo is None:
        return None
    try:
        report: pytest.TestReport = item.ihook.pytest_runtest_makereport(item=item, call=call)
    except Exception:  # noqa: BLE001 - a plugin that expects the phases it saw in-process
        # (pytest-rerunfailures keeps state from the setup report, made in the child).
        report = pytest.TestReport.from_item_and_call(item, call)
    return report


def junitxml(config: pytest.Config) -> Any:
    """The parent's junitxml writer, or None without ``--junitxml``.

    junitxml keeps it under a stash key that pytest does not export. Without it, what a
    child recorded for junitxml has nowhere to go, as in-process.
    """
    from _pytest.junitxml import xml_key

    return config.stash.get(xml_key, None)


def _xml_attributes(item: pytest.Item, attributes: list[tuple[str, str]]) -> None:
    """Give junitxml the ``record_xml_attribute`` calls made in a child."""
    xml = junitxml(item.config)
    if xml is not None:
        reporter = xml.node_reporter(item.nodeid)
        for name, value in attributes:
            reporter.add_attribute(name, value)


def suite_property(config: pytest.Config, name: str, value: str) -> None:
    """Give junitxml a ``record_testsuite_property`` call made in a child."""
    xml = junitxml(config)
    if xml is not None:
        xml.add_global_property(name, value)
