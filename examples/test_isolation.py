"""Isolation at work: each ``gpu`` test below runs in a fresh spawn child.

Run with ``--no-spawn`` to see the state-leak check fail: in one process the leak is real.
"""

from __future__ import annotations

import os

import fakedevice
import pytest

import spawnrun

# Set by conftest.py in the parent (not imported from it: several conftest modules
# share that name, so "import conftest" is ambiguous).
PARENT_PID_ENV = "SPAWNRUN_EXAMPLES_PARENT_PID"
LEAK_ENV = "SPAWNRUN_EXAMPLES_LEAK"

#: Module-level state a test can pollute; a fresh process re-imports it clean.
cache: dict[str, int] = {}


@pytest.mark.gpu
def test_device_works_in_spawned_child() -> None:
    # The parent initialized the device at conftest import. A child *forked* from it
    # would raise fakedevice.FORK_ERROR here; a spawned child did its own clean init.
    assert fakedevice.compute(21) == 42
    assert fakedevice.is_initialized()


@pytest.mark.gpu
def test_pid_differs_from_parent() -> None:
    assert spawnrun.is_child()
    assert os.getpid() != int(os.environ[PARENT_PID_ENV])


@pytest.mark.gpu
def test_pollutes_global_state() -> None:
    # Deliberately leak: no monkeypatch, no cleanup.
    cache["answer"] = 42
    os.environ[LEAK_ENV] = "leaked"
    assert cache == {"answer": 42}


@pytest.mark.gpu
def test_sees_clean_state() -> None:
    # Runs after the polluter; clean only because this is a new process.
    assert cache == {}
    assert LEAK_ENV not in os.environ


def test_unmarked_runs_in_parent() -> None:
    assert not spawnrun.is_child()
    assert os.getpid() == int(os.environ[PARENT_PID_ENV])
    assert fakedevice.compute(1) == 2
