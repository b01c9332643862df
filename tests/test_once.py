"""A test runs once, as in plain pytest, unless its first run's failure points at a guess
of the run's; where it runs again, both runs are shown (issue 56).

One inner suite holds the cases; each run of it is a session (fast mode's first run, its
second with the cache kept, ``--spawn-confirm strict``, ``-x``), and each case's report is
asserted afterwards. The stand-in for state that is not fork-safe is a module that
remembers the pid that imported it: in a fork of a template the test's pid differs.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

SUITE = """
import os, time, pytest
PID = os.getpid()

def forked():
    return os.getpid() != PID

def test_a_counts_its_runs():
    runs = int(open("runs.txt").read()) if os.path.exists("runs.txt") else 0
    open("runs.txt", "w").write(str(runs + 1))
    assert runs > 0, "its first run ever"

def test_b_leaves_a_directory():
    os.mkdir("results")
    assert 1 == 2, "wrong answer"

def test_c_crashes_in_a_fork():
    if forked():
        os.abort()

@pytest.mark.timeout(3)
def test_d_hangs_in_a_fork():
    if forked():
        time.sleep(60)

@pytest.mark.xfail(strict=True)
def test_f_xfails_in_a_fork():
    assert not forked()

def test_g_names_fork_in_its_error():
    if forked():
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")
"""

FAST = ("--spawn-gpu", "--spawn-method", "forkserver", "-p", "no:randomly", "-v")


def _statuses(result: pytest.RunResult) -> dict[str, list[str]]:
    """Each test's statuses on its -v lines, in order (a kept first run's RERUN first)."""
    out: dict[str, list[str]] = {}
    for line in result.stdout.lines:
        found = re.match(
            r"^test_once\.py::(\w+) (PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR|RERUN)", line
        )
        if found:
            out.setdefault(found.group(1), []).append(found.group(2))
    return out


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_once=SUITE)
    return pytester


def _clean(pytester: pytest.Pytester) -> None:
    for name in ("runs.txt",):
        (pytester.path / name).unlink(missing_ok=True)
    (pytester.path / "results").exists() and (pytester.path / "results").rmdir()


def test_a_failure_of_the_tests_own_counts_once_and_evidence_runs_it_again_shown(suite):
    first = suite.runpytest_subprocess(*FAST, "--junitxml=first.xml")
    first.stdout.no_fnmatch_line("*INTERNALERROR*")
    seen = _statuses(first)
    # Failures of the test's own: once, with their own words (no second run's).
    assert (suite.path / "runs.txt").read_text() == "1"
    assert seen["test_a_counts_its_runs"] == ["FAILED"]
    assert seen["test_b_leaves_a_directory"] == ["FAILED"]
    first.stdout.fnmatch_lines(["FAILED*test_b_leaves_a_directory - AssertionError: wrong answer"])
    first.stdout.no_fnmatch_line("*FileExistsError*")
    # Evidence against the fork (a death, a hang, an error that names forking): the
    # first run is kept and shown, the spawned run counts.
    for name in (
        "test_c_crashes_in_a_fork",
        "test_d_hangs_in_a_fork",
        "test_g_names_fork_in_its_error",
    ):
        assert seen[name] == ["RERUN", "PASSED"], (name, seen)
    first.stdout.fnmatch_lines(["*first runs of tests that ran again (spawnrun)*"])
    first.stdout.fnmatch_lines(["*3 of them passed only when run again*"])
    # An xfail that held in a fork counts; the next run spawns the test.
    assert seen["test_f_xfails_in_a_fork"] == ["XFAIL"]
    cases = {c.get("name"): c for c in ET.parse(suite.path / "first.xml").iter("testcase")}
    assert [e.tag for e in cases["test_c_crashes_in_a_fork"] if e.tag != "properties"] == [
        "flakyFailure"
    ]
    flaky = cases["test_c_crashes_in_a_fork"].find("flakyFailure")
    assert flaky is not None and "crashed in a fork" in flaky.get("message", "")
    assert "SIGABRT" in (flaky.findtext("stackTrace") or "")
    failure = cases["test_b_leaves_a_directory"].find("failure")
    assert failure is not None and "wrong answer" in failure.get("message", "")
    lastfailed = suite.runpytest_subprocess("--cache-show", "cache/lastfailed")
    for name in ("test_a", "test_b", "test_c", "test_d", "test_g"):
        lastfailed.stdout.fnmatch_lines([f"*test_once.py::{name}*"])

    explain = suite.runpytest_subprocess(*FAST, "--spawn-explain")
    explain.stdout.fnmatch_lines(
        [
            "*test_a_counts_its_runs*not forked, spawned fresh: an earlier run: it failed "
            "in a fork of a template*",
            "*test_c_crashes_in_a_fork*not forked, spawned fresh: an earlier run: it crashed "
            "in a fork of a template*",
        ]
    )
    _clean(suite)
    second = suite.runpytest_subprocess(*FAST)
    again = _statuses(second)
    assert (suite.path / "runs.txt").read_text() == "1"
    assert again["test_a_counts_its_runs"] == ["FAILED"]
    # Spawned now: what a fresh interpreter gives, run once.
    assert again["test_f_xfails_in_a_fork"] == ["FAILED"]  # XPASS(strict), as plain
    for name in ("test_c_crashes_in_a_fork", "test_d_hangs_in_a_fork"):
        assert again[name] == ["PASSED"], (name, again)
    second.stdout.no_fnmatch_line("*RERUN*")
    second.stdout.fnmatch_lines(
        ["*tests spawned, not forked, as an earlier run's record says (--spawn-explain*"]
    )


def test_strict_fails_a_test_that_passed_only_when_run_again(suite):
    result = suite.runpytest_subprocess(*FAST, "--spawn-confirm", "strict")
    assert _statuses(result)["test_c_crashes_in_a_fork"] == ["RERUN", "FAILED"]
    result.stdout.fnmatch_lines(["*spawnrun: --spawn-confirm strict: this test passed only*"])


def test_x_stops_at_the_first_failure_as_plain_pytest_does(suite):
    plain = suite.runpytest_subprocess("-p", "no:spawnrun", "-x", "-p", "no:randomly")
    _clean(suite)
    fast = suite.runpytest_subprocess(*FAST, "-x")
    fast.stdout.no_fnmatch_line("*INTERNALERROR*")
    assert plain.parseoutcomes() == fast.parseoutcomes() == {"failed": 1}
    assert _statuses(fast) == {"test_a_counts_its_runs": ["FAILED"]}


def test_under_xdist_both_runs_reach_the_controllers_junitxml_and_lf(suite):
    """xdist's controller writes junitxml and ``--lf``'s record from its workers'
    reports: a test's kept first run reaches both there too."""
    result = suite.runpytest_subprocess(*FAST, "-n", "2", "--junitxml=x.xml")
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    cases = {c.get("name"): c for c in ET.parse(suite.path / "x.xml").iter("testcase")}
    flaky = cases["test_c_crashes_in_a_fork"].find("flakyFailure")
    assert flaky is not None and "crashed in a fork" in flaky.get("message", "")
    lastfailed = suite.runpytest_subprocess("--cache-show", "cache/lastfailed")
    lastfailed.stdout.fnmatch_lines(["*test_once.py::test_c_crashes_in_a_fork*"])
