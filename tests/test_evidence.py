"""learn/_evidence: which first-run failures point at a guess of the run's (pure logic)."""

from __future__ import annotations

import pytest

from spawnrun.learn import _evidence


def report(outcome: str, text: str = "", when: str = "call") -> pytest.TestReport:
    longrepr: object = text
    if outcome == "skipped":
        longrepr = ("test_x.py", 3, f"Skipped: {text}")
    return pytest.TestReport(
        "test_x.py::test_x", ("test_x.py", 2, "test_x"), {}, outcome, longrepr, when
    )


def failed(error: str) -> pytest.TestReport:
    return report(
        "failed", f"    def test_x():\n>       model()\nE       {error}\n\ntest_x.py:3: {error}"
    )


@pytest.mark.parametrize(
    "error",
    [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "RuntimeError: CUDA error: out of memory",
        "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate",
        "MemoryError",
        "RuntimeError: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    ],
)
def test_out_of_memory_points_at_a_budget(error):
    assert "out of memory" in _evidence.memory([report("passed", when="setup"), failed(error)])


@pytest.mark.parametrize(
    "error",
    [
        "AssertionError: wrong answer",
        "FileExistsError: [Errno 17] File exists: 'results'",
        "AssertionError: assert 0.73 < 0.5",
        "RuntimeError: memory layout mismatch",  # names memory, not running out of it
    ],
)
def test_a_failure_of_the_tests_own_points_at_no_guess(error):
    assert _evidence.memory([failed(error)]) == ""
    assert _evidence.fork([failed(error)]) == ""


def test_a_skip_for_want_of_memory_points_at_a_budget_and_another_skip_does_not():
    assert "want of memory" in _evidence.memory([report("skipped", "not enough memory free")])
    assert _evidence.memory([report("skipped", "needs CUDA 12")]) == ""


@pytest.mark.parametrize(
    "error, words",
    [
        ("RuntimeError: Cannot re-initialize CUDA in forked subprocess.", "names forking"),
        ("RuntimeError: this handle is not valid after fork()", "names forking"),
        ("Failed: Timeout (>3.0s) from pytest-timeout.", "it hung"),
    ],
)
def test_an_error_of_fork_unsafe_state_or_a_hang_points_at_the_fork(error, words):
    assert words in _evidence.fork([failed(error)])


def test_a_doubt_counts_whatever_the_outcome():
    doubt = "X was set to '1' in its process, and lib had read it at import"
    assert _evidence.fork([failed("AssertionError")], doubt) == doubt
    assert _evidence.fork([report("passed")], doubt) == doubt
    assert _evidence.fork([report("passed")]) == ""


def test_an_xfail_that_held_in_the_call_is_unsure_and_a_skip_is_not():
    xfailed = report("skipped", "x")
    xfailed.wasxfail = ""
    assert _evidence.unsure([report("passed", when="setup"), xfailed])
    assert not _evidence.unsure([report("skipped", "not supported for this config")])
    assert not _evidence.unsure([report("skipped", "no GPU", when="setup")])
    assert not _evidence.unsure([report("passed")])
