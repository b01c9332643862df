"""Runs that never end (or lose reports), end to end: each inner run is bounded.

Every inner pytest runs with ``timeout=``: a hang raises pytester's timeout exception
and fails the test instead of stalling the suite. Each test asserts the outcomes a plain
in-process pytest run of the same files gives.
"""

from __future__ import annotations

import json
import time

import pytest

#: Seconds an inner run may take before it counts as a hang.
HANG = 60


def no_internal_error(result: pytest.RunResult) -> None:
    result.stdout.no_fnmatch_line("*INTERNALERROR*")


# 1. Fast mode, --spawn-pack auto, a second run: after the third exclusive test -------

PACKED = """
import time
import pytest

@pytest.mark.gpu(memory="1GiB")
@pytest.mark.parametrize("i", range(10))
def test_budget(i):
    time.sleep(0.1 + 0.02 * i)

@pytest.mark.gpu(exclusive=True)
@pytest.mark.parametrize("i", range(3))
def test_exclusive(i):
    pass

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(2))
def test_bare(i):
    pass

@pytest.mark.gpu(exclusive=True)
def test_last_exclusive():
    pass
"""

PACKED_IDS = [
    *(f"test_packed.py::test_budget[{i}]" for i in range(10)),
    *(f"test_packed.py::test_exclusive[{i}]" for i in range(3)),
    *(f"test_packed.py::test_bare[{i}]" for i in range(2)),
    "test_packed.py::test_last_exclusive",
]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_learned_budgets_after_exclusive_tests_do_not_stall_the_run(pytester, method):
    """The second run of a suite, from peaks recorded by the first (pytest's cache)."""
    pytester.makepyfile(test_packed=PACKED)
    # What a first run records for these tests (none uses torch: a peak of 0).
    peaks = pytester.path / ".pytest_cache" / "v" / "spawnrun" / "peaks"
    peaks.parent.mkdir(parents=True)
    peaks.write_text(json.dumps(dict.fromkeys(PACKED_IDS, 0)))
    args = ["--spawn-gpus", "1", "--spawn-gpu-memory", "140GiB", "--spawn-pack", "auto"]
    result = pytester.runpytest_subprocess(*args, "--spawn-method", method, "-v", timeout=HANG)
    result.assert_outcomes(passed=16)
    result.stdout.fnmatch_lines(["*test_last_exclusive PASSED*"])
    no_internal_error(result)


# 2. Scopes whose tests pytest runs out of their order ---------------------------------

INTERLEAVE = """
def pytest_collection_modifyitems(items):
    a = [i for i in items if i.module.__name__ == "test_a"]
    b = [i for i in items if i.module.__name__ == "test_b"]
    items[:] = [x for pair in zip(a, b) for x in pair]  # a0 b0 a1 b1 ...
"""

IN_MODULE = """
import pytest

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(2))
def test_{name}(i):
    pass
"""

IN_CLASS = """
import pytest

@pytest.mark.gpu
class TestIt:
    @pytest.mark.parametrize("i", range(2))
    def test_{name}(self, i):
        pass
"""


@pytest.mark.parametrize(
    "scope, text", [("module", IN_MODULE), ("class", IN_CLASS)], ids=["module", "class"]
)
def test_interleaved_scopes_on_one_gpu_finish(pytester, scope, text):
    pytester.makeconftest(INTERLEAVE)
    for name in ("a", "b"):
        pytester.makepyfile(**{f"test_{name}": text.format(name=name)})
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-gpus", "1", "--spawn-scope", scope, "-v",
        timeout=HANG,
    )  # fmt: skip
    result.assert_outcomes(passed=4)
    no_internal_error(result)


FAILS_ONCE = """
import os
import pytest

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(2))
def test_{name}(i):
    assert not (i == 1 and os.environ.get("FAIL_ONCE") == "1")
"""


def test_failed_first_across_two_scopes_on_one_gpu_finishes(pytester, monkeypatch):
    """``--ff`` after a failure in each of two modules: a1 b1 a0 b0."""
    for name in ("a", "b"):
        pytester.makepyfile(**{f"test_{name}": FAILS_ONCE.format(name=name)})
    args = ["--spawn-gpus", "1", "--spawn-scope", "module"]
    monkeypatch.setenv("FAIL_ONCE", "1")
    first = pytester.runpytest_subprocess(*args, timeout=HANG)
    first.assert_outcomes(passed=2, failed=2)
    monkeypatch.delenv("FAIL_ONCE")
    second = pytester.runpytest_subprocess(*args, "--ff", "-v", timeout=HANG)
    second.assert_outcomes(passed=4)
    second.stdout.fnmatch_lines(["*test_a?1? PASSED*", "*test_b?1? PASSED*"])  # first
    no_internal_error(first)
    no_internal_error(second)


# 3. A test whose process ends badly after "done" holds or takes down its file's next test

STUCK = """
import atexit, os, threading, time
import pytest

@pytest.mark.gpu(count=0)
def test_guilty():
    {body}

@pytest.mark.gpu(count=0)
def test_next():
    pass
"""

LEAVES_A_THREAD = "threading.Thread(target=time.sleep, args=(300,)).start()"
EXITS_3 = "atexit.register(os._exit, 3)"


def test_a_fork_that_does_not_exit_does_not_hold_the_next_test(pytester):
    """The template kills it 20 s after its test, as the default start method does."""
    pytester.makepyfile(test_stuck=STUCK.format(body=LEAVES_A_THREAD))
    result = pytester.runpytest_subprocess(
        # One job: the file's two tests fork from one template, one after the other.
        "-p", "no:cacheprovider", "--spawn-method", "forkserver", "--spawn-jobs", "1", "-v",
        timeout=75,
    )  # fmt: skip
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*test_stuck.py::test_guilty PASSED*",
            "*test_stuck.py::test_next PASSED*",
            "*test_stuck.py::test_guilty*",  # the warning names the guilty test
            "*SpawnrunWarning*did not exit within 20 s*",
        ]
    )
    no_internal_error(result)


#: The guilty test stops the parent for a second: its "done" and its template's word that
#: the fork exited with 3 then reach the parent in one read.
STOPS_THE_PARENT = (
    "atexit.register(os._exit, 3); import signal, subprocess; "
    "parent = int(os.environ['PARENT_PID']); "
    "subprocess.Popen(['sh', '-c', f'sleep 1; kill -CONT {parent}'], start_new_session=True); "
    "os.kill(parent, signal.SIGSTOP)"
)


@pytest.mark.parametrize(
    ("method", "body"),
    [("forkserver", EXITS_3), ("spawn", EXITS_3), ("forkserver", STOPS_THE_PARENT)],
    ids=["forkserver", "spawn", "forkserver-read-with-the-done"],
)
def test_an_exit_status_after_done_is_a_warning_on_its_test(pytester, method, body):
    """An atexit handler's exit status: the next test is not to blame, the guilty warned.
    Also where a fork's status reaches the parent in the same read as its test's "done"
    (a loaded parent): it was handed to the test's ending, which dropped it, so the
    warning came once in a while only (seen under load in a full run)."""
    pytester.makepyfile(test_stuck=STUCK.format(body=body))
    pytester.makeconftest(
        "import os, spawnrun\n"
        "if not spawnrun.is_child():\n"
        "    os.environ['PARENT_PID'] = str(os.getpid())\n"
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-method", method, "--spawn-jobs", "1", "-v",
        timeout=HANG,
    )  # fmt: skip
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(
        ["*test_stuck.py::test_guilty*", "*SpawnrunWarning*exited with status 3 after*"]
    )
    no_internal_error(result)


def test_an_exit_status_told_after_the_next_test_warns_its_own_test(pytester, monkeypatch):
    """Where the run has no devices, the template forks the next test before the
    previous fork's end is known, and tells that end once the next test said "done":
    the warning still lands on the guilty test, not on the one the parent hears then."""
    monkeypatch.delenv("SPAWNRUN_GPUS")  # no devices (the others here declare two)
    # Its exit takes a while: the next Go comes first.
    slow_exit = "atexit.register(lambda: (time.sleep(0.5), os._exit(3)))"
    pytester.makepyfile(
        test_stuck=STUCK.format(body=slow_exit)
        + "\n@pytest.mark.gpu(count=0)\ndef test_last():\n    pass\n"
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-method", "forkserver", "--spawn-jobs", "1", "-v",
        timeout=HANG,
    )  # fmt: skip
    result.assert_outcomes(passed=3, warnings=1)
    summary = result.stdout.lines[result.stdout.lines.index(
        next(line for line in result.stdout.lines if "warnings summary" in line)
    ):]  # fmt: skip
    assert "test_stuck.py::test_guilty" in summary
    assert "test_stuck.py::test_next" not in summary
    result.stdout.fnmatch_lines(["*SpawnrunWarning*exited with status 3 after*"])
    no_internal_error(result)


# 4. pytest.exit() at the moment another test passes: its reports are kept ----------

AT_ONCE = """
import os, time
import pytest

def until(name):
    time.sleep(max(0.0, float(os.environ[name]) - time.time()))

@pytest.mark.gpu(count=0)
def test_passes():
    until("PASS_AT")

@pytest.mark.gpu(count=0)
def test_stops():
    until("STOP_AT")
    pytest.exit("stop")
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("passes_after", [0.0, 0.5], ids=["same-instant", "after-the-stop"])
def test_a_test_before_another_tests_exit_keeps_its_report(
    pytester, monkeypatch, method, passes_after
):
    """In-process, ``test_passes`` runs first and passes; then the session stops.

    Both run at once (two jobs). Whether its child ends in the same instant as the
    other's ``pytest.exit()`` or later, it runs to its end and is reported.
    """
    pytester.makepyfile(test_at_once=AT_ONCE)
    instant = time.time() + 3.0
    monkeypatch.setenv("STOP_AT", str(instant))
    monkeypatch.setenv("PASS_AT", str(instant + passes_after))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-jobs", "2", "--spawn-method", method, timeout=HANG
    )
    result.stdout.fnmatch_lines(["*Exit: stop*"])
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    no_internal_error(result)


def test_plain_pytest_gives_the_outcomes_asserted_above(pytester, monkeypatch):
    """The reference: the same files in-process (``--no-spawn``)."""
    pytester.makepyfile(test_at_once=AT_ONCE)
    monkeypatch.setenv("STOP_AT", str(time.time()))
    monkeypatch.setenv("PASS_AT", str(time.time() + 0.5))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--no-spawn", timeout=HANG)
    result.stdout.fnmatch_lines(["*Exit: stop*"])
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.INTERRUPTED


# The driver's last resort: a claim nothing holds ----------------------------------


def test_a_test_nothing_can_start_fails_saying_why_instead_of_waiting(pytester):
    """The last resort end to end: devices that never come (a stand-in bug) fail the
    test with the reason, and the run goes on."""
    pytester.makeconftest(
        """
        import os
        from spawnrun.dispatch.queries import Queries

        if os.environ.get("SPAWNRUN_CHILD") != "1":
            choose = Queries.choose

            def never_for_one(self, test, *args, **kwargs):
                return None if "never" in test.id else choose(self, test, *args, **kwargs)

            Queries.choose = never_for_one
        """
    )
    pytester.makepyfile(
        """
        import pytest
        pytestmark = pytest.mark.gpu

        def test_first():
            pass

        def test_never_gets_its_device():
            pass

        def test_last():
            pass
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-gpus", "0,", "--spawn-lookahead", "0", timeout=HANG
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        ["*spawnrun: nothing could start this test: it waited for 1 device(s) alone*"]
    )
    no_internal_error(result)
