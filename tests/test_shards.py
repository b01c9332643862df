"""A suite split across CI nodes with pytest-split: every test runs once, in one shard.

Each shard is its own pytest run with spawnrun's default settings on the devices that
tests/conftest.py declares, as each CI node's pytest would be on its own GPUs.
"""

from __future__ import annotations

import collections
import json

import pytest

pytest.importorskip("pytest_split")

SHARDS = 2

# Each test body logs its node id and what it ran in, so "ran" means the body executed,
# not only that the parent printed a report.
SUITE = {
    "test_alpha": """
import os
import time
import pytest
import spawnrun

def log():
    with open(os.environ["SHARD_RAN_LOG"], "a") as f:
        f.write("%s %s %s\\n" % (
            os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0],
            int(spawnrun.is_child()),
            os.environ.get("CUDA_VISIBLE_DEVICES", "-"),
        ))

@pytest.mark.gpu
def test_gpu_one():
    log()
    time.sleep(0.3)  # the longest tests, one at each end: shards by duration differ
    assert spawnrun.is_child()

@pytest.mark.gpu(count=0)
def test_isolated():
    log()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""

def test_in_process():
    log()
    assert not spawnrun.is_child()

@pytest.mark.parametrize("n", [1, 2, 3])
def test_param(n):
    log()
""",
    "test_beta": """
import os
import time
import pytest
from test_alpha import log

@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2])
def test_gpu_param(n):
    log()

class TestGroup:
    def test_in_class(self):
        log()

@pytest.mark.gpu(count=0)
def test_isolated_too():
    log()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""

@pytest.mark.gpu
def test_gpu_last():
    log()
    time.sleep(0.3)
""",
}

SPAWNED = {
    "test_alpha.py::test_gpu_one",
    "test_alpha.py::test_isolated",
    "test_beta.py::test_gpu_param[1]",
    "test_beta.py::test_gpu_param[2]",
    "test_beta.py::test_isolated_too",
    "test_beta.py::test_gpu_last",
}


# In each child: whatever it deselected. A shard's selection is the parent's; a child
# that split its one file again would miss tests of its shard (and boot again for them).
CHILD_LOG = """
def pytest_deselected(items):
    if os.environ.get("SPAWNRUN_CHILD") == "1":
        with open(os.environ["SHARD_RAN_LOG"] + ".children", "a") as f:
            f.write("deselected %d\\n" % len(items))
"""


def _collected(pytester: pytest.Pytester) -> list[str]:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--collect-only", "-q")
    assert result.ret == 0, result.stdout.str()
    return [line for line in result.outlines if "::" in line]


def _ran(path) -> list[tuple[str, bool, str]]:
    rows = [line.split(" ") for line in path.read_text().splitlines()] if path.exists() else []
    return [(nodeid, spawned == "1", devices) for nodeid, spawned, devices in rows]


@pytest.mark.parametrize("durations", [False, True], ids=["evenly", "by-stored-durations"])
def test_two_shards_run_every_test_exactly_once(pytester, outcomes, monkeypatch, durations):
    pytester.makepyfile(**SUITE)
    outcomes.conftest(CHILD_LOG)
    log = pytester.path / "ran.log"
    monkeypatch.setenv("SHARD_RAN_LOG", str(log))
    collected = _collected(pytester)
    assert len(collected) == 11 and SPAWNED <= set(collected), collected
    if durations:
        # pytest-split's own workflow: a full run stores durations, shards split by them.
        # The parent stores them for spawned tests too (their reports are replayed).
        result, _ = outcomes.run("--store-durations")
        result.assert_outcomes(passed=11)
        stored = json.loads((pytester.path / ".test_durations").read_text())
        assert set(stored) == set(collected)
        assert stored["test_alpha.py::test_gpu_one"] >= 0.3, stored
        assert stored["test_beta.py::test_gpu_last"] >= 0.3, stored
        log.unlink()

    shards = []
    for group in range(1, SHARDS + 1):
        before = len(_ran(log))
        result, seen = outcomes.run("--splits", str(SHARDS), "--group", str(group))
        result.stdout.fnmatch_lines([f"*Running group {group}/{SHARDS}*"])
        if durations:
            result.stdout.no_fnmatch_line("*No test durations found*")
        result.stdout.no_fnmatch_line("*INTERNALERROR*")
        calls = [nodeid for nodeid, when, outcome, _ in seen if when == "call"]
        # Every phase of every test this shard ran passed.
        assert all(outcome == "passed" for _, _, outcome, _ in seen), seen
        result.assert_outcomes(passed=len(calls))
        ran = _ran(log)[before:]
        # The bodies that ran are the tests the parent reported, each once.
        assert sorted(nodeid for nodeid, _, _ in ran) == sorted(calls)
        assert {nodeid for nodeid, spawned, _ in ran if spawned} == SPAWNED & set(calls)
        assert {d for nodeid, spawned, d in ran if spawned and d} <= {"0", "1"}
        assert SPAWNED & set(calls), f"shard {group} ran no gpu test: {calls}"
        shards.append(calls)

    counts = collections.Counter(nodeid for calls in shards for nodeid in calls)
    assert set(counts) == set(collected), "a shard dropped or invented tests"
    assert set(counts.values()) == {1}, f"tests ran more than once: {counts}"
    assert not set(shards[0]) & set(shards[1])
    assert all(shards), "a shard ran nothing"
    children = pytester.path / "ran.log.children"
    assert not children.exists(), children.read_text()
