"""Coverage of the code that runs in children, under ``coverage run`` and pytest-cov.

The inner suite's ``lib.on_gpu`` runs only in a child (a gpu-marked test), ``lib.in_process``
only in the parent: line 2 is covered only if the child's measurement reached the data.
"""

from __future__ import annotations

import json
import sys

import pytest

LIB = """\
def on_gpu():
    return "gpu"


def in_process():
    return "cpu"
"""
GPU_ONLY_LINE = 2
PARENT_ONLY_LINE = 6

SUITE = """
import pytest

import lib


@pytest.mark.gpu
def test_gpu():
    assert lib.on_gpu() == "gpu"


def test_cpu():
    assert lib.in_process() == "cpu"
"""

METHODS = pytest.mark.parametrize("method", ["spawn", "forkserver"])


def _suite(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(lib=LIB, test_lib=SUITE)


def _executed(pytester: pytest.Pytester, report: str) -> set[int]:
    data = json.loads((pytester.path / report).read_text())
    return set(data["files"]["lib.py"]["executed_lines"])


def _coverage(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    result = pytester.run(sys.executable, "-m", "coverage", *args, timeout=120)
    assert result.ret == 0, result.outlines + result.errlines
    return result


@METHODS
def test_coverage_run_with_parallel_measures_children(pytester, method):
    # docs/guide/compatibility.md's configuration for `coverage run -m pytest`: parallel mode,
    # nothing else.
    pytest.importorskip("coverage")
    _suite(pytester)
    (pytester.path / ".coveragerc").write_text("[run]\nparallel = true\n")
    result = _coverage(
        pytester, "run", "-m", "pytest", "-p", "no:cacheprovider", "--spawn-method", method
    )
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    # One data file for the parent, one for the child (the forkserver's template, which
    # never runs a test, saves none).
    assert len(list(pytester.path.glob(".coverage.*"))) >= 2
    _coverage(pytester, "combine")
    _coverage(pytester, "json", "-o", "cov.json")
    assert {GPU_ONLY_LINE, PARENT_ONLY_LINE} <= _executed(pytester, "cov.json")


@METHODS
def test_pytest_cov_measures_children(pytester, method):
    pytest.importorskip("pytest_cov")
    _suite(pytester)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--spawn-method",
        method,
        "--cov=lib",
        "--cov-report=json:cov.json",
    )
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    # Before children left pytest-cov to the parent, the child's own controller combined
    # and rewrote the data files while the parent read them: a corrupt data file
    # (INTERNALERROR) or a file gone under the parent's combine (this warning).
    for lines in (result.outlines, result.errlines):
        assert not [line for line in lines if "CoverageWarning" in line]
    assert {GPU_ONLY_LINE, PARENT_ONLY_LINE} <= _executed(pytester, "cov.json")
