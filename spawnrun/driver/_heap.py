"""The parent's objects at its end: frozen where no test ran in this process.

Runs in the parent. A pytest process that imported torch holds ~250,000 objects, and its
end walks them all, more than once: pytest's own collections as its configuration ends
(five passes from 8.4, one on CPython in later releases), then the interpreter's as it
tears its modules down. In a run of 40 trivial tests that took 0.28-0.41 s for pytest's
passes, and exiting a process that imported torch takes ~0.3 s against ~0.1 s with
its objects frozen. The time is serial: nothing else runs at a session's end.

Where every test ran in a child, the parent's objects are its collection's and
spawnrun's own. One collection at unconfigure finalizes what of them is garbage (its
unraisable exceptions are reported as pytest's own pass would report them); freezing
what is left (``gc.freeze``) leaves the passes after it only the objects made since.

Nothing changes where a test ran in this process (``--no-spawn``, a test that does not
spawn): its garbage is collected as plain pytest collects it. Nor where the process
goes on after the session (``pytest.main`` called by a program, an in-process pytester
run): frozen objects are never collected, so a second session would keep the first
one's.
"""

from __future__ import annotations

import gc
import sys

import pytest

#: Whether a test ran in this process (set by the first one).
RAN_HERE_KEY = pytest.StashKey[bool]()


def ran_here(config: pytest.Config) -> None:
    """A test's protocol runs in this process."""
    config.stash[RAN_HERE_KEY] = True


def freeze_if_spared(config: pytest.Config, xdist_worker: bool) -> None:
    """At unconfigure: collect once and freeze, where no test ran here and the process
    ends with this session."""
    if config.stash.get(RAN_HERE_KEY, False) or not _process_ends_with_session(xdist_worker):
        return
    gc.collect()
    gc.freeze()


def _process_ends_with_session(xdist_worker: bool) -> bool:
    """Whether the process ends with this session: pytest's command line runs one
    (its entry point, ``console_main``, under one ``main``), and so does an xdist
    worker (its session under no ``main``); a session of ``pytest.main`` called from
    a program or a test (pytester) adds a ``main`` of its own. pytest offers no public
    way to ask; these are its function names in ``_pytest.config``, from 8.0 (``main``,
    ``console_main``) to 9.2 (``_main`` and ``_console_main`` beside them)."""
    import _pytest.config

    here = _pytest.config.__file__
    sessions = 0
    command_line = False
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == here:
            if code.co_name in ("main", "_main"):
                sessions += 1
            elif code.co_name in ("console_main", "_console_main"):
                command_line = True
        frame = frame.f_back  # type: ignore[assignment]
    if xdist_worker:
        return sessions == 0
    return command_line and sessions == 1
