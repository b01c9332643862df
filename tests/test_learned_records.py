"""What runs learn is read back checked: a record pytest's cache holds that is no usable
number (``Infinity``, an integer past any machine, text) is dropped with one warning
naming its file, and never ends a run in an INTERNALERROR (``_learned.valid``)."""

from __future__ import annotations

import json

import pytest

SUITE = """
import pytest

@pytest.mark.gpu(memory="1GiB")
def test_budgeted():
    pass

@pytest.mark.gpu
def test_alone(record_property):
    record_property("spawnrun_cpu_load", float("inf"))  # a test may write it itself
    record_property("spawnrun_device_peak_mib", float("nan"))

def test_in_process():
    pass
"""

ARGS = ("-p", "no:randomly", "--spawn-gpus", "2", "--spawn-gpu-memory", "80GiB")


@pytest.mark.parametrize(
    "key, text",
    [
        ("cpu-loads", '{"test_suite.py::test_budgeted": Infinity, "test_suite.py::test_alone": 3}'),
        ("peaks", f'{{"test_suite.py::test_budgeted": {10**400}}}'),
        ("durations", '{"test_suite.py::test_alone": 1e308, "test_suite.py::test_budgeted": "x"}'),
    ],
    ids=["infinite-load", "huge-peak", "huge-or-text-duration"],
)
def test_a_bad_learned_record_is_dropped_and_named(pytester, key, text):
    pytester.makepyfile(test_suite=SUITE)
    first = pytester.runpytest_subprocess(*ARGS)
    first.assert_outcomes(passed=3)
    path = pytester.path / ".pytest_cache" / "v" / "spawnrun" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    second = pytester.runpytest_subprocess(*ARGS)
    second.stdout.no_fnmatch_line("*INTERNALERROR*")
    second.assert_outcomes(passed=3, warnings=1)
    second.stdout.fnmatch_lines(
        [f"*pytest's cache held learned values that are no number*{path}: test_suite.py::*"]
    )
    kept = json.loads(path.read_text())
    assert all(isinstance(v, (int, float)) and v < 10**7 for v in kept.values()), kept
    third = pytester.runpytest_subprocess(*ARGS)  # dropped: nothing to say again
    third.assert_outcomes(passed=3)
    third.stdout.no_fnmatch_line("*cache held learned values*")


def test_a_value_a_test_records_itself_is_never_learned_unusable(pytester):
    """``record_property("spawnrun_cpu_load", float("inf"))`` in a passing test: before,
    the cache kept it and every later run ended in an INTERNALERROR (OverflowError)."""
    pytester.makepyfile(test_suite=SUITE)
    for _ in range(2):
        result = pytester.runpytest_subprocess(*ARGS)
        result.stdout.no_fnmatch_line("*INTERNALERROR*")
        result.assert_outcomes(passed=3)
        result.stdout.no_fnmatch_line("*cache held learned values*")
    loads = pytester.path / ".pytest_cache" / "v" / "spawnrun" / "cpu-loads"
    assert "Infinity" not in (loads.read_text() if loads.exists() else "")
