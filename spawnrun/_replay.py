"""One spawned test from the parent's side: drive its child, then replay its reports.

Runs in the parent. A ``Job`` reacts to its child's messages (booted, reports,
warnings, done, death, timeout) and buffers what the child reported. When the child is
finished, ``Job.replay`` feeds everything through the parent's hooks at once
(``logstart``, ``logreport`` for each phase, warnings, ``logfinish``), so the terminal,
``-x``, junitxml, ``--lf`` and other plugins see ordinary reports, also when several
children run at the same time. Every test ends with a setup, (call) and teardown
report, whatever its child did: missing phases are synthesized as failures.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import time
import warnings
from collections.abc import Mapping
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from spawnrun import _forkserver
from spawnrun import _protocol as proto
from spawnrun import _reports
from spawnrun import _runner

_serial = count(1)
#: The parent's forwarded options, computed once per run.
OPTIONS_KEY = pytest.StashKey[dict[str, Any]]()
#: Set with --spawn-method forkserver.
ZYGOTE_KEY = pytest.StashKey[_forkserver.ZygoteHolder]()
_TAIL_BYTES = 8192


class Replay:
    """The reports and warnings of one test, buffered in pytest's order."""

    def __init__(self, item: pytest.Item) -> None:
        self.item = item
        self.seen: dict[str, pytest.TestReport] = {}
        self.reports: list[pytest.TestReport] = []
        self.warnings: list[warnings.WarningMessage] = []
        #: (name, value) pairs added to every report: devices, wall time.
        self.properties: list[tuple[str, object]] = []

    def add(self, report: pytest.TestReport) -> None:
        self.seen[report.when] = report
        self.reports.append(report)

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

    def complete(self, notes: list[str]) -> None:
        """After a normal end: a passed setup needs a call report (the silent-pass guard).

        ``notes`` are errors the child met outside the test; they explain a missing
        report, so they go into the failure, else onto the teardown report.
        """
        extra = "".join(f"\n\n{_reports.CHILD_NOTES}:\n{n}" for n in notes)
        if "setup" not in self.seen:
            self.fail("setup", _reports.NO_CALL + " (nor any other report)" + extra)
        elif self.seen["setup"].passed and "call" not in self.seen:
            self.fail("call", _reports.NO_CALL + extra)
        elif "teardown" not in self.seen:
            self.fail("teardown", _reports.NO_TEARDOWN + extra)
        elif notes:
            self.note(_reports.CHILD_NOTES, "\n".join(notes))
        self.ensure_teardown()

    def ensure_teardown(self) -> None:
        if "teardown" not in self.seen:
            self.add(_reports.make(self.item, "teardown", "passed"))

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
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        if interrupted:
            for report in self.reports:
                item.ihook.pytest_runtest_logreport(report=report)
            return
        for report in self.reports:
            if report.when == "teardown" and parent_error is not None:
                if report.passed:
                    report = parent_error
                else:
                    report.sections.append(
                        ("spawnrun: parent teardown error", str(parent_error.longrepr))
                    )
            report.user_properties.extend(self.properties)
            item.ihook.pytest_runtest_logreport(report=report)
        for wm in self.warnings:
            _reports.record_warning(item.config, wm, item.nodeid)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)


class Job:
    """A spawned test in flight: its child, its state, its buffered reports.

    A job may be started ahead of its turn (booted ahead): its child imports, configures
    and collects while other tests run, and waits. ``dispatch`` gives it its devices
    (sent with the go) when its turn comes; only then does its timeout start.
    """

    def __init__(
        self,
        item: pytest.Item,
        timeout: float | None,
        env: Mapping[str, str] | None = None,
        parent_error: pytest.TestReport | None = None,
    ) -> None:
        self.item = item
        self.timeout = timeout
        #: None until the job is dispatched: its environment is not known before.
        self.env: dict[str, str] | None = None if env is None else dict(env)
        self.parent_error = parent_error
        self.replay = Replay(item)
        self.candidates = _candidate_args(item)
        self.problems: list[str] = []
        self.child: _runner.ChildProcess | None = None
        self.booted = False
        self.running = False
        self.done = False
        #: The child initialized a device runtime while booting ahead: start afresh.
        self.restart = ""
        self.interrupted: proto.Interrupted | None = None
        self.deadline: float | None = None
        self.started = time.monotonic()
        #: Devices the scheduler gave it, and their used memory before it ran (NVML).
        self.devices: list[str] = []
        self.baseline: dict[str, int] | None = None

    @property
    def dispatched(self) -> bool:
        return self.env is not None

    def start(self) -> None:
        # A child booted ahead inherits the parent's environment; one started at its
        # turn gets its devices before its interpreter starts.
        self.child = _start(self.item, self.candidates.pop(0), self.env or {})
        self.booted = self.running = False
        self._arm()

    def dispatch(self, env: Mapping[str, str]) -> None:
        """Its turn: devices are free. Go now if booted, else as soon as it is."""
        self.env = dict(env)
        self.started = time.monotonic()
        if self.restart:
            self.candidates = _candidate_args(self.item)
            self.start()
        elif self.booted and not self.done:
            self._go()
        self._arm()

    def _go(self) -> None:
        assert self.child is not None and self.env is not None
        self.child.go(self.env)
        self.running = True
        self._arm()

    def _arm(self) -> None:
        active = self.dispatched and self.timeout is not None
        self.deadline = time.monotonic() + self.timeout if active else None  # type: ignore[operator]

    def on_message(self, msg: proto.Message | _runner.Died) -> None:
        child = self.child
        assert child is not None
        replay = self.replay
        if isinstance(msg, proto.Booted) and msg.found:
            self.booted = True
            if msg.device_runtime and not self.dispatched:
                # Its devices would come too late: CUDA is already up in the child.
                self.restart = msg.device_runtime
                child.kill()
                child.finish()
            elif self.dispatched:
                self._go()
        elif isinstance(msg, proto.Booted):
            self.problems.append(msg.problem)
            child.finish()
            if self.candidates:
                self.start()
            else:
                replay.add(_reports.make(self.item, "setup", "passed"))
                replay.fail("call", _reports.NOT_FOUND + "\n\n" + "\n\n".join(self.problems))
                replay.ensure_teardown()
                self._finish()
        elif isinstance(msg, proto.Report):
            config = self.item.config
            replay.add(config.hook.pytest_report_from_serializable(config=config, data=msg.data))
        elif isinstance(msg, proto.WarningRecord):
            replay.warnings.append(_warning_message(msg))
        elif isinstance(msg, proto.Interrupted):
            self.interrupted = msg
        elif isinstance(msg, proto.Done):
            if self.interrupted is None:
                replay.complete(msg.notes)
            self._finish()
        else:  # the child died
            phase = replay.pending_phase() if self.running else "setup"
            _report_death(replay, child, phase)
            self._finish()

    def on_timeout(self) -> None:
        assert self.child is not None
        phase = self.replay.pending_phase() if self.running else "setup (while the child booted)"
        _report_timeout(self.replay, self.child, self.timeout, phase)
        self._finish()

    def abort(self, reason: str) -> None:
        """End the child now (-x, an interrupt elsewhere); say so on the test."""
        if self.child is not None:
            self.child.kill()
        if self.interrupted is None:
            skipped = (str(self.item.path), 0, reason)
            phase = self.replay.pending_phase()
            self.replay.add(_reports.make(self.item, phase, "skipped", skipped))
            self.replay.ensure_teardown()
        self._finish()

    def _finish(self) -> None:
        child = self.child
        assert child is not None
        child.finish()
        self.done = True
        self.replay.properties.append(
            ("spawnrun_wall_s", round(time.monotonic() - self.started, 3))
        )
        if child.reaped:
            text = _reports.REAPED.format(n=child.reaped)
            self.replay.note("spawnrun", text)
            self.replay.warnings.append(_reports.warning(text, str(self.item.path)))

    def replay_and_raise(self) -> None:
        """Replay what the child reported; re-raise its pytest.exit / KeyboardInterrupt."""
        if self.interrupted is not None:
            # As in-process: the reports so far, then the session stops.
            self.replay.emit(None, interrupted=True)
            if self.interrupted.keyboard:
                raise KeyboardInterrupt
            pytest.exit(self.interrupted.message, self.interrupted.returncode)
        self.replay.emit(self.parent_error)


def _candidate_args(item: pytest.Item) -> list[list[str]]:
    """The test's file alone first (cheap); what the parent collected on fallback."""
    first = [str(item.path)]
    fallback = list(item.config.args)
    return [first] if fallback == first else [first, fallback]


def _start(item: pytest.Item, args: list[str], env: Mapping[str, str]) -> _runner.ChildProcess:
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
    holder = config.stash.get(ZYGOTE_KEY, None)
    if holder is not None:
        forked = holder.fork(config, spec, env)
        if forked is not None:
            return forked
    return _runner.ChildProcess(spec, env=env)


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
    stacks_path = Path(child.spec.stacks_path)
    workdir = stacks_path.parent
    stacks = _tail(stacks_path)
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


def _warning_message(rec: proto.WarningRecord) -> warnings.WarningMessage:
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
    return warnings.WarningMessage(message, category, rec.filename, rec.lineno)


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
    report: pytest.TestReport = item.ihook.pytest_runtest_makereport(item=item, call=call)
    return report
