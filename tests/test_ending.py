"""A child's life after its test (``_ending``), driven without processes.

The stand-in child records what the ending asks of it; its group members and exit are
set by the test. End-to-end behaviour (reaping real processes, stuck exits, a scope's
handover) is in test_crashes.py and test_scopes.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from spawnrun.driver import _ending
from spawnrun.driver._ending import Ending
from spawnrun.driver._ending import Stage
from spawnrun.launch import _runner
from spawnrun.wire import _replies
from spawnrun.wire import _reports


class StandIn:
    def __init__(self) -> None:
        self.pid = 4242
        self.gone = False
        self.conn = object()
        self.sentinel = 7
        self.exitcode: int | None = 0
        self.asked: list[str] = []
        self.words: list[Any] = []

    def stop(self) -> None:
        self.asked.append("stop")

    def kill(self) -> None:
        self.asked.append("kill")

    def reaped(self) -> None:
        self.gone = True

    def messages(self) -> list[Any]:
        words, self.words = self.words, []
        return words

    def others(self) -> list[int]:
        return []


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The child's process group as the ending sees it; signals are recorded, not sent."""
    members: list[int] = []
    monkeypatch.setattr(_runner, "group_members", lambda pgid: list(members))
    monkeypatch.setattr(_runner, "signal_pids", lambda pids, signum: None)
    monkeypatch.setattr(_ending._devices, "nvml_available", lambda: False)
    return members


def ending(child: StandIn, stage: Stage, **kwargs: Any) -> Ending:
    args: dict[str, Any] = dict(
        devices=["0"], claimed=["0"], held=["0"], token="t1", settle=None, pids={4242},
        left_behind=[],
    )  # fmt: skip
    args.update(kwargs)
    return Ending(None, child, stage, **args)  # type: ignore[arg-type]


def test_a_scope_child_between_tests_is_taken_with_its_devices(group):
    child = StandIn()
    e = ending(child, Stage.HANDOVER, scope="module test_a.py")
    assert e.deadline is None  # it waits without a deadline of its own
    held = e.held
    assert e.take() is child
    assert (e.stage, e.child, e.held, held) == (Stage.GONE, None, [], ["0"])
    assert e.take() is None  # once


def test_a_gone_or_dismissed_scope_child_is_not_taken(group):
    child = StandIn()
    e = ending(child, Stage.HANDOVER)
    e.dismiss()
    assert child.asked == ["stop"] and e.stage is Stage.EXITING
    assert e.take() is None
    dead = StandIn()
    dead.gone = True
    assert ending(dead, Stage.HANDOVER).take() is None


def test_an_exit_is_reaped_then_settled_and_its_last_words_kept(group, monkeypatch):
    child = StandIn()
    e = ending(child, Stage.EXITING)
    assert e.listening
    child.words = [_replies.After(["teardown of the session failed"])]
    group.append(999)  # a process the test left behind
    e.on_exit()
    assert child.gone and e.stage is Stage.REAPING
    assert e.after_notes == ["teardown of the session failed"]
    e.on_deadline(e.since + _ending.REAP_PATIENCE + 0.01)
    assert e.left_behind == [999] and e.reaped_count == 1
    group.clear()
    e.on_deadline(e.deadline or 0.0)
    assert e.stage is Stage.GONE and e.deadline is None
    assert _reports.REAPED.format(n=1) in e.warnings()
    assert any("teardown of the session failed" in w for w in e.warnings())


def test_an_exit_that_left_nothing_behind_is_gone_at_once(group):
    # Its devices, and the session's end, wait for it to be gone: not a poll later.
    e = ending(StandIn(), Stage.EXITING)
    e.on_exit()
    assert e.deadline == e.since
    e.on_deadline(e.since)
    assert e.stage is Stage.GONE


@pytest.mark.parametrize("after_done, aborted", [(True, False), (False, False), (True, True)])
def test_an_exit_status_of_its_own_after_done_is_a_warning(group, after_done, aborted):
    """An atexit handler's os._exit(3) after "done" is told; a timeout's or a stop's kill
    (not after "done", or by spawnrun) is not the child's own."""
    child = StandIn()
    e = ending(child, Stage.EXITING)
    e.after_done = after_done
    if aborted:
        e.abort()
    child.exitcode = 3
    e.on_exit()
    told = _reports.BAD_EXIT.format(code=3) in e.warnings()
    assert told is (after_done and not aborted)


def test_a_child_that_does_not_exit_is_killed_and_said_stuck(group):
    child = StandIn()
    e = ending(child, Stage.EXITING, reaped=2)
    e.on_deadline(e.since + _ending.EXIT_GRACE - 1)
    assert child.asked == []
    e.on_deadline(e.since + _ending.EXIT_KILL)
    assert child.asked == ["kill"]
    assert e.stuck and e.stuck in e.warnings()
    assert e.reaped_count == 2  # the test's own deaths, counted on


def test_an_abort_ends_a_waiting_child(group):
    child = StandIn()
    e = ending(child, Stage.HANDOVER)
    e.abort()
    assert child.asked == ["kill"] and e.stage is Stage.EXITING
