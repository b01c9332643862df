"""``--spawn-explain``: where and how each selected test would run, with nothing run."""

from __future__ import annotations

import pytest

SUITE = """
import os
import pytest

def ran():
    with open(os.environ["RAN"], "a") as f:
        f.write("ran\\n")

@pytest.mark.gpu(memory="2GiB")
def test_budget():
    ran()

@pytest.mark.gpu(exclusive=True)
def test_alone():
    ran()

@pytest.mark.gpu(count=3)
def test_three():
    ran()

def test_plain():
    ran()
"""

ARGS = ["--spawn-gpus", "0,1", "--spawn-gpu-memory", "80GiB"]


def test_explain_says_where_each_test_would_run_and_runs_nothing(pytester, monkeypatch):
    ran = pytester.path / "ran.txt"
    monkeypatch.setenv("RAN", str(ran))
    pytester.makepyfile(test_suite=SUITE)
    explained = pytester.runpytest_subprocess(*ARGS, "--spawn-explain")
    assert explained.ret == pytest.ExitCode.OK
    assert not ran.exists()  # no test, no child
    explained.stdout.fnmatch_lines(
        [
            "*spawnrun: where each test would run (nothing ran)*",
            "spawnrun: 2 GPU(s) [[]0, 1[]]*",
            "spawnrun: up to * test(s) at once, at most * per GPU; packing auto; children spawned",
            "spawnrun: backfilling off (no duration recorded yet, one job at a time, or "
            "under xdist)",
            "spawnrun: gathering on (up to 32 tests that need their GPUs alone wait for one drain)",
            "test_suite.py::test_budget: spawned; 1 GPU; budget 2.0 GiB (memory='2GiB'); "
            "timeout none; its child holds its devices from its start (its file's boot is "
            "not known yet)",
            "test_suite.py::test_alone: spawned; 1 GPU; alone on its devices (exclusive=True);*",
            "test_suite.py::test_three: skipped here (needs 3 GPUs, 2 available)",
            "test_suite.py::test_plain: in-process (not marked gpu, and --spawn-gpu not given)",
        ]
    )
    explained.stdout.no_fnmatch_line("*started while collecting*")
    stopping = pytester.runpytest_subprocess(*ARGS, "--spawn-explain", "-x")
    stopping.stdout.fnmatch_lines(["spawnrun: gathering off (*a failure stops the session)"])
    # After a run, what the file's boot touched is known: its children may boot unclaimed.
    pytester.runpytest_subprocess(*ARGS).assert_outcomes(passed=3, skipped=1)
    again = pytester.runpytest_subprocess(*ARGS, "--spawn-explain")
    again.stdout.fnmatch_lines(
        [
            "spawnrun: backfilling on (by the durations earlier runs recorded)",
            "test_suite.py::test_budget: *its child may boot unclaimed "
            "(its file's boot touches no device); ran *.** s last time (it may start ahead "
            "of a test that waits for devices, if it ends before that test could start)",
        ]
    )


def test_explain_under_xdist_lists_each_test_and_what_a_worker_does(pytester, monkeypatch):
    """The xdist controller collects nothing itself: explain listed no test, and said
    backfilling and gathering were on, which they are not under xdist."""
    ran = pytester.path / "ran.txt"
    monkeypatch.setenv("RAN", str(ran))
    pytester.makepyfile(test_suite=SUITE)
    explained = pytester.runpytest_subprocess(*ARGS, "--spawn-explain", "-n", "2")
    assert explained.ret == pytest.ExitCode.OK
    assert not ran.exists()
    explained.stdout.fnmatch_lines(
        [
            "spawnrun: under xdist, each worker runs one test's child at a time, at most * "
            "per GPU over all workers; packing auto; children spawned",
            "spawnrun: backfilling off (*)",
            "spawnrun: gathering off (*)",
            "test_suite.py::test_budget: spawned; 1 GPU; budget 2.0 GiB (memory='2GiB');*",
            "test_suite.py::test_plain: in-process (not marked gpu, and --spawn-gpu not given)",
        ]
    )


def test_explain_says_a_collection_error_stops_the_run(pytester, monkeypatch):
    """A module that fails to import stops pytest before any test: explain says so and
    lists no plan (it listed the others' as if they would run); with
    ``--continue-on-collection-errors`` it lists them."""
    monkeypatch.setenv("RAN", str(pytester.path / "ran.txt"))
    pytester.makepyfile(test_suite=SUITE, test_broken="import no_such_module_here\n")
    stopped = pytester.runpytest_subprocess(*ARGS, "--spawn-explain")
    assert stopped.ret == pytest.ExitCode.INTERRUPTED
    stopped.stdout.fnmatch_lines(
        [
            "spawnrun: no test would run: 1 error(s) during collection, where pytest stops "
            "(--continue-on-collection-errors runs the others)",
            "*Interrupted: 1 error during collection*",
        ]
    )
    stopped.stdout.no_fnmatch_line("test_suite.py::test_budget:*")
    going = pytester.runpytest_subprocess(
        *ARGS, "--spawn-explain", "--continue-on-collection-errors"
    )
    going.stdout.fnmatch_lines(["test_suite.py::test_budget: spawned;*"])
