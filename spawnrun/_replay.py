"""Run one spawned test from the parent's side and replay its reports through pytest.

Runs in the parent. The child's reports go through the parent's
``pytest_runtest_logreport`` as they arrive, so the terminal, ``-x``, junitxml, ``--lf``
and other plugins see ordinary reports. Every test ends with a setup, (call) and
teardown report, whatever its child did: missing phases are synthesized as failures.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import time
import warnings
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from spawnrun import _protocol as proto
from spawnrun import _reports
from spawnrun import _runner

_serial = count(1)
#: The parent's forwarded options, computed once per run.
OPTIONS_KEY = pytest.StashKey[dict[str, Any]]()
_TAIL_BYTES = 8192


class Replay:
    """The reports of one test, in pytest's order, with the teardown held back.

    The teardown report waits until the parent has torn down its own fixture stack
    down to ``nextitem`` (module/class fixtures shared with in-process tests), so a
    failure there can be reported on this test, as pytest would.
    """

    def __init__(self, item: pytest.Item) -> None:
        self.item = item
        self.seen: dict[str, pytest.TestReport] = {}
        self.held: pytest.TestReport | None = None

    def add(self, report: pytest.TestReport) -> None:
        self.seen[report.when] = report
        if report.when == "teardown":
            self.held = report
        else:
            self.item.ihook.pytest_runtest_logreport(report=report)

    def fail(self, when: str, text: str, sections: list[tuple[str, str]] | None = None) -> None:
        self.add(_reports.make(self.item, when, "failed", text, sections))

    def died(self, when: str, text: str, sections: list[tuple[str, str]]) -> None:
        """A failure with no exception behind it: a crash or a timeout.

        xfail applies as to an exception raised in-process: an xfail test (strict or
        not) is xfailed, unless ``raises=`` names exception types, which a dead
        process is not one of: then it fails, saying why.
        """
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
        setup = self.seen.get("setup")
        if setup is None:
            return "setup"
        if setup.passed and "call" not in self.seen:
            return "call"
        return "teardown"

    def complete(self) -> None:
        """After a normal end: a passed setup needs a call report (the silent-pass guard)."""
        if "setup" not in self.seen:
            self.fail("setup", _reports.NO_CALL + " (nor any other report)")
        elif self.seen["setup"].passed and "call" not in self.seen:
            self.fail("call", _reports.NO_CALL)
        elif "teardown" not in self.seen:
            self.fail("teardown", _reports.NO_TEARDOWN)
        self.ensure_teardown()

    def ensure_teardown(self) -> None:
        if "teardown" not in self.seen:
            self.add(_reports.make(self.item, "teardown", "passed"))

    def flush(self, parent_error: pytest.TestReport | None) -> None:
        held = self.held
        if parent_error is not None:
            if held is None or held.passed:
                held = parent_error
            else:
                held.sections.append(
                    ("spawnrun: parent teardown error", str(parent_error.longrepr))
                )
        if held is not None:
            self.item.ihook.pytest_runtest_logreport(report=held)


def run_spawned(item: pytest.Item, nextitem: pytest.Item | None, timeout: float | None) -> None:
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    replay = Replay(item)
    interrupted = _drive(item, replay, timeout)
    if interrupted is not None:
        if interrupted.keyboard:
            raise KeyboardInterrupt
        pytest.exit(interrupted.message, interrupted.returncode)
    replay.flush(_parent_teardown(item, nextitem))
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)


def _candidate_args(item: pytest.Item) -> list[list[str]]:
    """The test's file alone first (cheap); what the parent collected on fallback."""
    first = [str(item.path)]
    fallback = list(item.config.args)
    return [first] if fallback == first else [first, fallback]


def _start(item: pytest.Item, args: list[str]) -> _runner.ChildProcess:
    config = item.config
    workdir = _runner.child_dir(config, item.nodeid, next(_serial))
    workdir.mkdir(parents=True, exist_ok=True)
    options = config.stash[OPTIONS_KEY].copy()
    options["basetemp"] = str(workdir / "tmp")
    live = config.getoption("capture") == "no"
    spec = proto.ChildSpec(
        nodeid=item.nodeid,
        args=args,
        plugin_args=_runner.plugin_args(config),
        option_dict=options,
        invocation_dir=str(config.invocation_params.dir),
        log_path=None if live else str(workdir / "output.log"),
        stacks_path=str(workdir / "stacks.txt"),
    )
    return _runner.ChildProcess(spec, env={})


def _drive(item: pytest.Item, replay: Replay, timeout: float | None) -> proto.Interrupted | None:
    problems: list[str] = []
    child: _runner.ChildProcess | None = None
    try:
        for args in _candidate_args(item):
            child = _start(item, args)
            msg = child.recv(timeout)
            if msg is None:
                _report_timeout(replay, child, timeout, "setup (while the child booted)")
                return None
            if isinstance(msg, proto.Booted) and msg.found:
                break
            if isinstance(msg, proto.Booted):
                problems.append(msg.problem)
                child.finish()
                child = None
                continue
            _report_death(replay, child, "setup")
            return None
        if child is None:
            replay.add(_reports.make(item, "setup", "passed"))
            replay.fail("call", _reports.NOT_FOUND + "\n\n" + "\n\n".join(problems))
            replay.ensure_teardown()
            return None
        interrupted = _stream(child, replay, timeout)
        child.finish()
        if child.reaped:
            _warn_reaped(item, replay, child.reaped)
        return interrupted
    except BaseException:
        if child is not None:
            child.kill()  # Ctrl-C or an internal error: the child must not outlive us
        raise
    finally:
        if child is not None:
            child.finish()


def _stream(
    child: _runner.ChildProcess, replay: Replay, timeout: float | None
) -> proto.Interrupted | None:
    config = replay.item.config
    interrupted: proto.Interrupted | None = None
    child.go()
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        msg = child.recv(remaining)
        if msg is None:
            _report_timeout(replay, child, timeout, replay.pending_phase())
            return None
        if isinstance(msg, proto.Report):
            rep = config.hook.pytest_report_from_serializable(config=config, data=msg.data)
            replay.add(rep)
        elif isinstance(msg, proto.WarningRecord):
            _replay_warning(replay.item, msg)
        elif isinstance(msg, proto.Interrupted):
            interrupted = msg
        elif isinstance(msg, proto.Done):
            if interrupted is None:
                replay.complete()
                if msg.notes and replay.held is not None:
                    replay.held.sections.append((_reports.CHILD_NOTES, "\n".join(msg.notes)))
            return interrupted
        elif msg is _runner.DIED:
            _report_death(replay, child, replay.pending_phase())
            return None


def _report_death(replay: Replay, child: _runner.ChildProcess, phase: str) -> None:
    code = child.finish(grace=5.0)
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        cause = f"killed by signal {name} ({-code})"
        if -code == signal.SIGKILL:
            cause += "; the kernel's out-of-memory killer is a common cause"
    else:
        cause = f"exited with status {code} before reporting the end of the test"
    text = f"{_reports.DIED} during {phase}: {cause}\nnode id: {replay.item.nodeid}"
    replay.died(phase, text, _evidence(child))


def _report_timeout(
    replay: Replay, child: _runner.ChildProcess, timeout: float | None, phase: str
) -> None:
    # Ask faulthandler in the child for every thread's stack, give it a moment to
    # write, then take the whole process group down.
    stacks = Path(child.spec.stacks_path)
    before = _size(stacks)
    child.dump_stacks()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        time.sleep(0.05)
        size = _size(stacks)
        if size > before:
            time.sleep(0.1)
            if _size(stacks) == size:
                break
    child.kill()
    child.finish(grace=5.0)
    text = f"{_reports.TIMEOUT} (>{timeout:g} s) during {phase}\nnode id: {replay.item.nodeid}"
    replay.died(phase.split(" ")[0], text, _evidence(child))


def _evidence(child: _runner.ChildProcess) -> list[tuple[str, str]]:
    """What a person needs to debug a dead or stuck child: stacks and output tails."""
    sections = []
    workdir = Path(child.spec.stacks_path).parent
    stacks = _tail(workdir / "stacks.txt")
    if stacks:
        sections.append((_reports.STACKS, stacks))
    captured = [_tail(p) for p in sorted(workdir.glob("capture-*.out"))]
    captured = [c for c in captured if c]
    if captured:
        sections.append((_reports.CAPTURED, "\n".join(captured)))
    if child.spec.log_path:
        out = _tail(Path(child.spec.log_path))
        if out:
            sections.append((_reports.OUTPUT, out))
    if child.reaped:
        sections.append(("spawnrun", _reports.REAPED.format(n=child.reaped)))
    return sections


def _warn_reaped(item: pytest.Item, replay: Replay, n: int) -> None:
    text = _reports.REAPED.format(n=n)
    if replay.held is not None:
        replay.held.sections.append(("spawnrun", text))
    wm = warnings.WarningMessage(
        _reports.SpawnrunWarning(text), _reports.SpawnrunWarning, str(item.path), 0
    )
    item.ihook.pytest_warning_recorded.call_historic(
        kwargs=dict(warning_message=wm, when="runtest", nodeid=item.nodeid, location=None)
    )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _xfail_of(item: pytest.Item) -> Any:
    # pytest evaluates xfail conditions in _pytest.skipping and has no public API for
    # it; the parent needs the verdict to judge a crash as pytest would an exception.
    if item.config.option.runxfail:
        return None
    from _pytest.skipping import evaluate_xfail_marks

    return evaluate_xfail_marks(item)


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    if size > _TAIL_BYTES:
        data = f"[... {size - _TAIL_BYTES} bytes cut ...]\n" + data
    return data.strip()


def _replay_warning(item: pytest.Item, rec: proto.WarningRecord) -> None:
    category: type[Warning] = UserWarning
    with contextlib.suppress(Exception):
        found = importlib.import_module(rec.category_module)
        for part in rec.category_name.split("."):
            found = getattr(found, part)
        if isinstance(found, type) and issubclass(found, Warning):
            category = found
    try:
        message: Warning = category(rec.message)
    except Exception:  # noqa: BLE001 - a category with a custom signature
        message = UserWarning(rec.message)
    wm = warnings.WarningMessage(message, category, rec.filename, rec.lineno)
    item.ihook.pytest_warning_recorded.call_historic(
        kwargs=dict(warning_message=wm, when="runtest", nodeid=item.nodeid, location=None)
    )


def _parent_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> pytest.TestReport | None:
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
    report: pytest.TestReport = item.ihook.pytest_runtest_makereport(item=item, call=call)
    return report
