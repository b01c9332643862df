"""The child's terminal: where its pytest terminal reporter writes, and how much of a text
travels to the parent.

Runs in the child only (a spawned child, a fork of a template). The relay (``_relay``)
puts ``quiet_reporter`` in place of pytest's terminal reporter, writing into a ``Sink``;
a test's turn (``_turn``) reads what the test wrote there. Imports nothing of spawnrun.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import IO
from typing import Any

import pytest

#: A captured-output section longer than this keeps only its tail, so a test that
#: prints 100 MB neither floods the pipe nor bloats the parent.
SECTION_LIMIT = 256 * 1024


class Sink(io.TextIOBase):
    """Where the child's terminal reporter writes.

    While the child boots and ends: a file of its own (its header and collection lines
    are not the user's business; an error before the test is read from there). During
    the test: the child's output file, where what pytest writes (``--setup-show``,
    live logs, a plugin's dump) and what bypasses capture keep their order; the parent
    replays that in the test's place. With -s the output streams live and the reporter
    keeps its own file. Line-buffered: a plugin may end the process right after writing.
    """

    encoding = "utf-8"

    def __init__(self, path: str) -> None:
        self.own = self.target = _line_file(path, "w")
        self.current = path

    def to_output(self, path: str) -> None:
        self.target = _line_file(path, "a")
        self.current = path

    def reopen(self, path: str) -> None:
        """A fork's own file from now on (a configured template's fork)."""
        if self.target is not self.own:
            self.target.close()
        self.own.close()
        self.own = self.target = _line_file(path, "w")
        self.current = path

    def to_own(self) -> None:
        if self.target is not self.own:
            self.target.close()
            self.target = self.own
            self.current = self.own.name

    def write(self, text: str) -> int:
        return self.target.write(text)

    def flush(self) -> None:
        self.target.flush()

    def isatty(self) -> bool:
        return False


def _line_file(path: str, mode: str) -> IO[str]:
    return open(path, mode, buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115


def quiet_reporter(done: Callable[[], bool]) -> Any:
    """pytest's terminal reporter without its per-test lines: the parent prints those.

    Nor its session's end once ``done()`` (the relay said "done"): the summary would go
    to the child's own terminal file, which nobody reads after the test (an early end's words
    are read from it only before), and the plugins' ``pytest_terminal_summary`` hooks it
    calls cost a child its exit time for nothing (hypothesis's imports the whole of
    hypothesis, assert-rewritten: ~0.5 s of CPU per child). The session's own end
    (``pytest_sessionfinish``, ``pytest_unconfigure``) still runs.
    """
    base = _terminal_reporter()

    class QuietReporter(base):  # type: ignore[misc, valid-type]
        @pytest.hookimpl(wrapper=True)
        def pytest_sessionfinish(self, session: Any, exitstatus: Any) -> Any:
            if done():
                return (yield)
            return (yield from super().pytest_sessionfinish(session, exitstatus))

        def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
            pass

        def pytest_runtest_logreport(self, report: Any) -> None:
            pass

        def pytest_runtest_logfinish(self, nodeid: str) -> None:
            pass

    return QuietReporter


def _terminal_reporter() -> Any:
    """pytest's TerminalReporter class: public from pytest 8.4, internal before."""
    reporter = getattr(pytest, "TerminalReporter", None)
    if reporter is None:
        from _pytest.terminal import TerminalReporter as reporter
    return reporter


def bounded(content: str) -> str:
    if len(content) <= SECTION_LIMIT:
        return content
    cut = len(content) - SECTION_LIMIT
    return f"[spawnrun: {cut} characters cut, the last {SECTION_LIMIT} follow]\n" + content[cut:]
