"""What the parent shows while spawned tests run, and what it names when interrupted.

Runs in the parent. One test at a time needs nothing here: the scheduler logs the
test's start before its child runs, as pytest does (its node id line with ``-v``).
Several at once, on a terminal: a status line after the cursor (the tests running, their
devices, for how long), drawn only while the parent waits for its children and erased
before anything else writes, so pytest's own lines never move. Elsewhere (a CI log),
with ``-v``: a plain line as each test starts running in its child.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import pytest

#: A test running in a child: node id, devices, seconds since its go, phase.
Running = tuple[str, list[str], float, str]
#: How often the status line's times are redrawn.
REDRAW = 1.0
#: Narrower than this after the cursor, no status line is drawn.
_MIN_WIDTH = 24


def describe(running: Running) -> str:
    nodeid, devices, seconds, phase = running
    where = f" [gpu {','.join(devices)}]" if devices else ""
    return f"{nodeid}{where} ({phase}, {seconds:.0f} s)"


class Status:
    def __init__(self, config: pytest.Config, several: bool) -> None:
        self.config = config
        self.several = several
        #: Whether the parent is waiting for its children (only then is a line drawn).
        self.waiting = False
        self.drawn = ""
        self.announced: set[str] = set()

    def _reporter(self) -> object | None:
        return self.config.pluginmanager.get_plugin("terminalreporter")

    def _tty(self) -> bool:
        reporter = self._reporter()
        # A bool before pytest 8.4, a callable bool since.
        return reporter is not None and bool(getattr(reporter, "isatty", False))

    @contextlib.contextmanager
    def wait(self) -> Iterator[None]:
        """The parent waits for its children (the status line may show) until it ends."""
        self.waiting = True
        try:
            yield
        finally:
            self.waiting = False
            self.clear()

    def interval(self) -> float | None:
        """How long the parent may wait before the status line wants a redraw."""
        return REDRAW if self.drawn or (self.waiting and self.several and self._tty()) else None

    def update(self, running: Sequence[Running]) -> None:
        """The tests running now; announce new ones, redraw the status line."""
        if not self.several or self._reporter() is None:
            return
        if not self._tty():
            self._announce(running)
        elif self.waiting and running:
            self._draw(running)
        else:
            self.clear()

    def _announce(self, running: Sequence[Running]) -> None:
        if self.config.get_verbosity() <= 0:
            return
        reporter: Any = self._reporter()
        for test in running:
            if test[0] not in self.announced:
                self.announced.add(test[0])
                where = f" [gpu {','.join(test[1])}]" if test[1] else ""
                # As pytest writes its -v lines: a newline first, none after (the
                # reporter's "a line is open" mark makes its next line start anew).
                reporter.ensure_newline()
                reporter.write(f"spawnrun: running {test[0]}{where}", flush=True)
                reporter.currentfspath = -2
        # Forget tests that ended: a rerun in a fresh child is announced again.
        self.announced &= {t[0] for t in running}

    def _draw(self, running: Sequence[Running]) -> None:
        tw = self.config.get_terminal_writer()
        room = tw.fullwidth - max(0, tw.width_of_current_line) - 1
        text = f" [spawnrun: {len(running)} running: " + "; ".join(map(describe, running)) + "]"
        # One column per character, so that backspaces erase it exactly.
        text = text.encode("ascii", "replace").decode("ascii")
        if room < _MIN_WIDTH:
            text = ""
        elif len(text) > room:
            text = text[: room - 4] + "...]"
        if text != self.drawn:
            self.clear()
            # write_raw: after the cursor, without moving pytest's idea of its line.
            _write_raw(tw, text)
            self.drawn = text

    def clear(self) -> None:
        if self.drawn:
            n = len(self.drawn)
            _write_raw(self.config.get_terminal_writer(), "\b" * n + " " * n + "\b" * n)
            self.drawn = ""


def _write_raw(tw: Any, text: str) -> None:
    """Write after the cursor without moving the writer's idea of its current line.

    ``TerminalWriter.write_raw`` does that from pytest 8.1 on; before it, the writer's
    file is the one place to write to (``_file``: pytest 8.0 has no public name for it).
    """
    write_raw = getattr(tw, "write_raw", None)
    if write_raw is not None:
        write_raw(text, flush=True)
        return
    file = tw._file
    file.write(text)
    file.flush()
