"""Other plugins and pytest features that act through a spawned test's child.

pytest-rerunfailures (a crash or timeout is a failure of its phase and is rerun), and
what the child's pytest writes straight to the terminal during a test (``--setup-show``,
live logging, ``capsys.disabled()``, ``--capture=tee-sys``), replayed in the test's place.
"""

from __future__ import annotations

import pytest

from spawnrun.wire import _reports

NO_INTERNAL = "*INTERNALERROR*"

# Each test counts its executions in a file beside the suite, then acts by the count:
# "c" crashes (SIGSEGV), "f" fails an assert, "p" passes, "h" hangs; "T" crashes in
# teardown. The last letter repeats.
RERUN_SUITE = """
import os, signal, time, pytest

def act(name, plan):
    path = os.path.join(os.path.dirname(__file__), f"count-{name}")
    n = int(open(path).read()) if os.path.exists(path) else 0
    with open(path, "w") as f:
        f.write(str(n + 1))
    step = plan[min(n, len(plan) - 1)]
    if step == "c":
        os.kill(os.getpid(), signal.SIGSEGV)
    if step == "h":
        time.sleep(60)
    assert step == "p", f"planned failure {n}"

@pytest.fixture
def crash_in_teardown():
    yield
    os.kill(os.getpid(), signal.SIGSEGV)

@pytest.mark.gpu(count=0, timeout=3)
def test_crash_then_pass():
    act("crash_then_pass", "cp")

@pytest.mark.gpu(count=0, timeout=3)
def test_fail_crash_pass():
    act("fail_crash_pass", "fcp")

@pytest.mark.gpu(count=0, timeout=3)
def test_hang_then_pass():
    act("hang_then_pass", "hp")

@pytest.mark.gpu(count=0, timeout=3)
def test_always_crashes():
    act("always_crashes", "c")

@pytest.mark.gpu(count=0, timeout=3)
def test_teardown_crashes(crash_in_teardown):
    pass
"""


def test_crash_and_timeout_are_failures_of_their_phase_and_are_rerun(pytester):
    pytest.importorskip("pytest_rerunfailures")
    pytester.makepyfile(test_r=RERUN_SUITE)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--reruns", "2", "-rA", "--spawn-jobs", "1"
    )
    outcomes = result.parseoutcomes()
    # Three flaky tests pass on a later attempt; the always-crashing one fails after
    # 2 reruns, in its call phase; the teardown crash errors after 2 reruns, its call
    # passing each time (counted 3 times, as pytest-rerunfailures counts in-process).
    assert outcomes.get("passed") == 3 + 3, outcomes
    assert outcomes.get("failed") == 1, outcomes
    assert outcomes.get("errors") == 1, outcomes
    assert outcomes.get("rerun") == 1 + 2 + 1 + 2 + 2, outcomes
    counts = {p.name: p.read_text() for p in pytester.path.glob("count-*")}
    assert counts == {
        "count-crash_then_pass": "2",
        "count-fail_crash_pass": "3",
        "count-hang_then_pass": "2",
        "count-always_crashes": "3",
    }
    text = result.stdout.str()
    assert f"{_reports.DIED} during call" in text
    assert f"{_reports.DIED} during setup" not in text
    assert f"{_reports.DIED} during teardown" in text
    for line in (
        "PASSED test_r.py::test_crash_then_pass",
        "FAILED test_r.py::test_always_crashes*",
        "ERROR test_r.py::test_teardown_crashes*",
    ):
        result.stdout.fnmatch_lines([line])
    result.stdout.no_fnmatch_line(NO_INTERNAL)


TERMINAL_SUITE = """
import logging, sys, pytest

@pytest.fixture
def fix():
    yield

@pytest.mark.gpu(count=0)
def test_talks(fix, capsys):
    logging.getLogger("t").warning("live-log-line")
    print("teed-line")
    with capsys.disabled():
        print("bypassed-capture-line")

@pytest.mark.gpu(count=0)
def test_quiet():
    pass
"""
MARKS = ("SETUP", "TEARDOWN", "live log", "live-log-line", "teed-line", "bypassed-capture")


@pytest.mark.parametrize(
    "args",
    [
        ["--setup-show", "-o", "log_cli=true", "-v"],
        ["--capture=tee-sys"],
        ["--setup-show", "-s"],
    ],
    ids=["setup-show-live-log", "tee-sys", "capture-no"],
)
def test_what_the_child_writes_to_the_terminal_is_replayed_in_its_place(pytester, args):
    # The same lines, in the same order and in the same test's place, as in-process.
    pytester.makepyfile(test_t=TERMINAL_SUITE)

    # With -s the test's own output streams live, not in place: compare pytest's lines.
    marks = ("SETUP", "TEARDOWN") if "-s" in args else MARKS + ("test_quiet",)

    def lines(*extra: str) -> list[str]:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, *extra)
        result.assert_outcomes(passed=2)
        text = result.stdout.str()
        start = text.index("test_t.py")  # what precedes (the header) differs
        body = text[start : text.index("passed in")].splitlines()
        return [ln.strip() for ln in body if any(m in ln for m in marks)]

    in_process = lines("--no-spawn")
    assert any("TEARDOWN" in ln or "teed-line" in ln for ln in in_process)
    # One child at a time: with several, tests reach the terminal in the order they end.
    assert lines("--spawn-jobs", "1") == in_process


def test_pytest_timeout_thread_dump_reaches_the_report(pytester):
    pytest.importorskip("pytest_timeout")
    pytester.makepyfile(
        """
        import time, pytest

        def sleeping_in_the_test():
            time.sleep(30)

        @pytest.mark.gpu(count=0)
        @pytest.mark.timeout(1, method="thread")
        def test_hangs():
            sleeping_in_the_test()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [f"{_reports.DIED} during call: exited with status 1*", "*+ Timeout +*"]
    )
    result.stdout.fnmatch_lines(["*in sleeping_in_the_test*"])
    result.stdout.no_fnmatch_line(NO_INTERNAL)


@pytest.mark.parametrize("family", ["xunit2", "xunit1"])
def test_junitxml_fixtures_in_a_child_act_as_in_process(pytester, family):
    # record_xml_attribute reaches the test's element; the fixtures warn as in-process
    # (experimental; incompatible with xunit2), since the parent writes the junitxml.
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu
        def test_x(record_property, record_xml_attribute):
            record_property("k", "v")
            record_xml_attribute("owner", "team-a")
        """
    )
    import xml.etree.ElementTree as ET

    def run(*extra: str) -> tuple[dict[str, str], list[str], int]:
        xml = pytester.path / "out.xml"
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", f"--junitxml={xml}", "-o", f"junit_family={family}", *extra
        )
        result.assert_outcomes(passed=1)
        case = next(ET.parse(xml).getroot().iter("testcase"))
        attrs = {k: v for k, v in case.attrib.items() if k not in ("time",)}
        said = [ln.strip() for ln in result.stdout.lines if "Warning:" in ln]
        return attrs, said, result.parseoutcomes()["warnings"]

    in_process = run("--no-spawn")
    if family == "xunit1":  # xunit2 keeps only its own attributes
        assert in_process[0].get("owner") == "team-a"
    assert run() == in_process


def test_doctest_and_subtest_summaries_read_as_in_process(pytester):
    # The short summary's lines (a failing doctest's, subtests' with their kwargs) are
    # pytest's own rendering of replayed reports: the same as in-process.
    pytester.makepyfile(mod='def f():\n    """\n    >>> 1 + 1\n    3\n    """\n')
    has_subtests = hasattr(pytest, "Subtests")
    if has_subtests:  # built into pytest from 9.0
        pytester.makepyfile(
            test_sub="""
            def test_sub(subtests):
                for i in range(2):
                    with subtests.test(msg="m", i=i, name="x"):
                        assert i == 0
            """
        )

    def summary(*extra: str) -> list[str]:
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "--doctest-modules", "-rA", *extra
        )
        lines = result.stdout.lines
        return lines[lines.index(next(ln for ln in lines if "short test summary" in ln)) + 1 :]

    spawned = summary("--spawn-gpu")
    assert any(ln.startswith("FAILED mod.py::mod.f") for ln in spawned)
    assert not has_subtests or any("i=" in ln for ln in spawned)
    in_process = summary("--no-spawn")
    # The last line's time differs.
    assert spawned[:-1] == in_process[:-1]


def test_a_report_with_a_value_of_the_tests_is_reported_once_under_rerunfailures(pytester):
    # pytest-rerunfailures logs an execution's reports at its end: the child sends each
    # first as pending, then as logged. Every one is sent as it is (its value as text),
    # so none is replayed twice.
    pytest.importorskip("pytest_rerunfailures")
    pytester.makepyfile(
        """
        import threading, pytest

        @pytest.mark.gpu
        def test_odd_property(record_property):
            record_property("lock", threading.Lock())

        @pytest.mark.gpu
        def test_plain():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--reruns", "1", "-rA")
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize("order", [[], ["-p", "spawnrun"]], ids=["entry-points", "spawnrun-first"])
def test_forked_never_forks_a_spawned_test(pytester, order):
    # pytest-forked's --forked (and its marker) fork the process that runs a test: the
    # parent for what spawnrun runs in-process, never a spawned child, whichever plugin
    # pytest loaded first (-p spawnrun registers spawnrun before pytest-forked).
    pytest.importorskip("pytest_forked")
    pytester.makeconftest(
        """
        import os
        if os.environ.get("SPAWNRUN_CHILD") == "1":
            os.environ["BOOTED_IN"] = str(os.getpid())
        """
    )
    pytester.makepyfile(
        """
        import os
        import pytest

        @pytest.mark.gpu
        def test_spawned():
            assert os.environ["BOOTED_IN"] == str(os.getpid())

        @pytest.mark.gpu
        @pytest.mark.forked
        def test_spawned_and_marked_forked():
            assert os.environ["BOOTED_IN"] == str(os.getpid())
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *order, "--forked")
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_pytester_in_a_spawned_test_runs_its_inner_session_as_in_process(pytester, method):
    # A spawned test's own in-process pytest sessions (runpytest, inline_run) collect
    # and run their tests as in plain pytest: the child's collection shortcuts (its
    # listing of the paths it was given) and its being the child are its own session's,
    # not the process's. spawnrun is loaded in the inner session as in any pytest: it
    # spawns the inner marked test itself.
    pytester.makeconftest('pytest_plugins = ["pytester"]\n')
    pytester.makepyfile(
        test_outer='''
        INNER = """
        import pytest

        def test_passes():
            pass

        def test_fails():
            assert 0

        @pytest.mark.gpu
        def test_spawned():
            pass
        """

        def test_inner_session(pytester):
            pytester.makepyfile(test_inner=INNER)
            result = pytester.runpytest("-p", "no:cacheprovider")
            result.assert_outcomes(passed=2, failed=1)
            result.stdout.fnmatch_lines(["*1 test isolated in 1 child*"])
            pytester.inline_run("-p", "no:cacheprovider").assertoutcome(passed=2, failed=1)
            result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
            result.assert_outcomes(passed=2, failed=1)
        '''
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-gpu", "--spawn-method", method
    )
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.assert_outcomes(passed=1)
