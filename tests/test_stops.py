"""Options that stop a session (``-x``, ``--maxfail``, ``--sw``, ``--sw-skip``) give in-process
pytest's outcomes however many tests run at once, and a test that ran out of its order and
failed counts only once it fails again in its order (issue 43).

Each case runs the same suite plainly (``--no-spawn``: the oracle) and spawned, and compares
what pytest reported: outcomes, the "stopping after N failures" count, and what the next
``--lf`` run picks up.
"""

from __future__ import annotations

import re

import pytest

from spawnrun.wire._reports import OUT_OF_ORDER

NO_SPAWN = "--no-spawn"


def _outcome(result: pytest.RunResult) -> tuple[dict[str, int], list[str]]:
    """What pytest reported: the outcome counts and the lines that name a stop or a test."""
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    counts = {k: v for k, v in result.parseoutcomes().items() if k not in ("seconds",)}
    said = [
        line
        for line in result.stdout.lines
        if re.match(r"^(FAILED|PASSED|ERROR) ", line) or "stopping after" in line
    ]
    return counts, said


def _both(pytester: pytest.Pytester, *args: str) -> tuple[object, object]:
    plain = _outcome(pytester.runpytest_subprocess(*args, NO_SPAWN))
    spawned = _outcome(pytester.runpytest_subprocess(*args))
    return plain, spawned


MAXFAIL = """
import time
import pytest

@pytest.mark.gpu(count=0)
def test_a_spawned_fails_late():
    time.sleep(1.5)
    assert False

def test_b_fails_here():
    assert False

def test_c_fails_here():
    assert False

def test_d_passes_here():
    pass
"""


@pytest.mark.parametrize("stop", [["--maxfail=2"], ["-x"]], ids=["maxfail2", "x"])
def test_in_process_tests_wait_for_a_spawned_test_before_them(pytester, stop):
    """``--maxfail=2`` printed "stopping after 3 failures": pytest went on past the spawned
    test while its child ran, and the in-process tests after it failed first. Now an
    in-process test waits for the spawned tests before it, and is not run at all when one
    of them stopped the session, as in-process."""
    pytester.makepyfile(test_mixed=MAXFAIL)
    args = ["-p", "no:cacheprovider", "-rA", "--spawn-jobs", "2", *stop]
    plain, spawned = _both(pytester, *args)
    assert spawned == plain


STEPWISE = """
import time
import pytest

pytestmark = pytest.mark.gpu(count=0)

def test_a_fails_late():
    time.sleep(1.5)
    assert False

def test_b_fails_early():
    assert False

def test_c_fails_early():
    assert False

def test_d_passes():
    pass
"""


@pytest.mark.parametrize(
    "sw, method",
    [("--sw", "spawn"), ("--sw-skip", "spawn"), ("--sw", "forkserver")],
)
def test_stepwise_records_what_plain_pytest_reaches(pytester, sw, method):
    """``--sw`` stopped at, and recorded, a later test that failed first in its child, and
    the earlier one reported too; the next ``--lf`` ran both. Now the tests end to pytest
    in its order, and nothing after the stopping test is reported or recorded; in fast
    mode too (a file template's forks)."""
    pytester.makepyfile(test_steps=STEPWISE)
    args = ["-rA", "--spawn-jobs", "3", "--spawn-method", method]
    runs = {}
    for mode in ([NO_SPAWN], []):
        first = pytester.runpytest_subprocess(*args, sw, "--cache-clear", *mode)
        then = pytester.runpytest_subprocess(*args, "--lf", *mode)
        runs[bool(mode)] = (_outcome(first), _outcome(then))
    assert runs[False] == runs[True]


BACKFILLED = """
import os
import time
import pytest

@pytest.mark.gpu
def test_1_long():
    time.sleep(3)

@pytest.mark.gpu(count=2)
def test_2_both_fails():
    assert False

@pytest.mark.gpu
def test_3_short_fails():
    time.sleep(0.1)
    assert os.environ.get("SHORT_PASSES")
"""


@pytest.mark.parametrize("short", ["fails", "passes"])
def test_a_backfilled_test_is_reported_in_its_order(pytester, monkeypatch, short):
    """With recorded durations, backfilling ran the short test while the two-device test
    waited for the long one; it failed first, and ``-x`` printed "stopping after 2
    failures" where plain pytest stops at the two-device test and never reaches it. Its
    failure counts only in its order now: after the test before it, which stops the run."""
    pytester.makepyfile(test_backfill=BACKFILLED)
    if short == "passes":
        monkeypatch.setenv("SHORT_PASSES", "1")
    args = ["-rA", "--spawn-gpus", "0,1", "--spawn-jobs", "2"]
    pytester.runpytest_subprocess(*args)  # records each test's duration
    assert (pytester.path / ".pytest_cache" / "v" / "spawnrun" / "durations").exists()
    plain, spawned = _both(pytester, *args, "-x")
    assert spawned == plain


ORDERED = """
import os
import time
import pytest

@pytest.mark.gpu(memory="2GiB")
def test_a():
    if os.path.exists("b.txt"):
        os.remove("b.txt")  # what an earlier run left
    time.sleep(1.5)

@pytest.mark.gpu(exclusive=True)
def test_b_exclusive_writes():
    open("b.txt", "w").write("b")

@pytest.mark.gpu(memory="2GiB")
def test_c_reads_what_b_wrote():
    assert os.path.exists("b.txt")
"""


def test_a_test_that_ran_out_of_order_and_failed_runs_again_in_its_order(pytester):
    """An order-dependent suite (a common bad practice): gathering passed over the
    exclusive test, and the test after it, which reads what it wrote, ran first and
    failed. It runs again after the tests before it, and that run counts; the summary
    names it and the guess."""
    pytester.makepyfile(test_ordered=ORDERED)
    args = ["-p", "no:cacheprovider", "-rA", "--spawn-gpus", "GPU-a"]
    args += ["--spawn-gpu-memory", "80GiB", "--spawn-jobs", "3"]
    plain = _outcome(pytester.runpytest_subprocess(*args, NO_SPAWN))
    # What the plain run wrote: the reader must not find it before the writer runs (the
    # first test removes it only once its own child runs it).
    (pytester.path / "b.txt").unlink()
    result = pytester.runpytest_subprocess(*args)
    counts, said = _outcome(result)
    # Its first run is shown (issue 56), and counts for nothing.
    assert counts.pop("rerun") == 1
    assert (counts, said) == plain
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([f"*1 test {OUT_OF_ORDER}*test_c_reads_what_b_wrote*"])


STOPPING = """
import time, pytest
def test_a():
    time.sleep(1.5)
def test_b_stops():
    time.sleep(0.5)
    {stop}
def test_c():
    pass
def test_d():
    pass
"""


@pytest.mark.parametrize(
    "stop", ["raise KeyboardInterrupt", "pytest.exit('stopped here')"], ids=["ctrl-c", "exit"]
)
@pytest.mark.parametrize(
    "mode",
    [
        (),
        ("--spawn-method", "forkserver"),
        ("--spawn-method", "forkserver", "--spawn-scope", "module"),
    ],
    ids=["spawned", "fast", "fast-module"],
)
def test_a_test_that_stops_the_session_is_the_last_reported(pytester, monkeypatch, stop, mode):
    """Issue 56: ``KeyboardInterrupt`` raised in a test, or ``pytest.exit()``, stops
    in-process pytest there: the tests after it are never run or reported. Spawned, the
    tests after it that ended first (beside the earlier ones) were reported PASSED, in the
    terminal and in junitxml; now nothing after the stopping test is told."""
    monkeypatch.setenv("SPAWNRUN_GPUS", "none")  # three at once: the later ones end first
    pytester.makepyfile(test_stop=STOPPING.format(stop=stop))
    plain = pytester.runpytest_subprocess("-p", "no:spawnrun", "--junitxml=plain.xml")
    spawned = pytester.runpytest_subprocess(
        "--spawn-gpu", "--spawn-jobs", "3", *mode, "--junitxml=spawned.xml"
    )
    spawned.stdout.no_fnmatch_line("*INTERNALERROR*")
    assert spawned.ret == plain.ret
    assert spawned.parseoutcomes().get("passed") == plain.parseoutcomes().get("passed") == 1
    for name in ("plain.xml", "spawned.xml"):
        cases = re.findall(
            r'<testcase classname="test_stop" name="(\w+)"', (pytester.path / name).read_text()
        )
        assert cases == ["test_a"], name
