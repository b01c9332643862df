"""Isolation per class, module or group: one child runs the tests of its scope.

Every test of an inner suite writes a line (its name, its pid, how many times its
module's fixture was built in that process), from which who shared a child is read.
"""

from __future__ import annotations

import fnmatch
import json
import textwrap

import pytest

from spawnrun.driver import _poison
from spawnrun.wire._reports import REPLACED_TITLE

RECORD = """
import json, os

def record(name, builds=0):
    with open(os.environ["SEEN"], "a") as f:
        f.write(json.dumps({"name": name, "pid": os.getpid(), "builds": builds}) + "\\n")
"""

MODULE = """
import os, signal, time
import pytest
from record import record
{mark}
BUILDS = []

@pytest.fixture(scope="module")
def model():
    BUILDS.append(1)
    yield
    record("{name} teardown")

@pytest.mark.parametrize("i", range(4))
def test_{name}(model, i):
    record(f"{name}{{i}}", len(BUILDS))
    if i == 1:
        {second}
"""

DEATHS = {
    "passes": "pass",
    "segfault": "os.kill(os.getpid(), signal.SIGSEGV)",
    "exit": "os._exit(3)",
    "timeout": "time.sleep(60)",
    "poison": 'raise RuntimeError("CUDA error: an illegal memory access was encountered")',
    "own poison": 'raise RuntimeError("mylib: context is wedged")',
}


def seen(pytester: pytest.Pytester) -> dict[str, dict[str, int]]:
    path = pytester.path / "seen.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["name"]: r for r in map(json.loads, lines)}


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("SEEN", str(pytester.path / "seen.jsonl"))
    pytester.makepyfile(record=RECORD)
    return pytester


def write_module(pytester: pytest.Pytester, name: str, mark: str, second: str = "pass") -> None:
    text = MODULE.format(name=name, mark=mark, second=second)
    pytester.makepyfile(**{f"test_{name}": textwrap.dedent(text)})


@pytest.mark.parametrize(
    "method, how",
    [("spawn", "marker"), ("forkserver", "marker"), ("spawn", "option"), ("forkserver", "ini")],
)
def test_a_module_shares_one_child_and_one_fixture_build(suite, method, how):
    mark = 'pytestmark = pytest.mark.gpu(count=0, scope="module")'
    args = ["--spawn-method", method, "-p", "no:cacheprovider"]
    if how != "marker":
        mark = "pytestmark = pytest.mark.gpu(count=0)"
    if how == "option":
        args += ["--spawn-scope", "module"]
    if how == "ini":
        suite.makeini("[pytest]\nspawn_scope = module\n")
    write_module(suite, "a", mark)
    write_module(suite, "b", mark)
    # A module that says scope="test" keeps a child per test whatever the default.
    write_module(suite, "c", 'pytestmark = pytest.mark.gpu(count=0, scope="test")')
    result = suite.runpytest_subprocess(*args)
    result.assert_outcomes(passed=12)
    rows = seen(suite)
    for name in ("a", "b"):
        pids = {rows[f"{name}{i}"]["pid"] for i in range(4)}
        assert len(pids) == 1, rows
        assert [rows[f"{name}{i}"]["builds"] for i in range(4)] == [1, 1, 1, 1]
        # Torn down in that child, after its module's last test.
        assert rows[f"{name} teardown"]["pid"] in pids
    assert rows["a0"]["pid"] != rows["b0"]["pid"]
    assert len({rows[f"c{i}"]["pid"] for i in range(4)}) == 4
    result.stdout.fnmatch_lines(["*12 tests isolated in 6 children*"])


@pytest.mark.parametrize(
    "death, method",
    [
        ("segfault", "spawn"),
        ("exit", "forkserver"),
        ("timeout", "spawn"),
        ("poison", "forkserver"),
        ("own poison", "spawn"),
        ("passes", "spawn"),
    ],
)
def test_a_broken_child_fails_only_its_test_and_the_module_goes_on_fresh(suite, death, method):
    write_module(
        suite,
        "m",
        'pytestmark = pytest.mark.gpu(count=0, scope="module", timeout=4)',
        DEATHS[death],
    )
    if death == "own poison":
        suite.makeini("[pytest]\nspawn_poison =\n    wedged$\n    never matched\n")
    result = suite.runpytest_subprocess("--spawn-method", method, "-p", "no:cacheprovider")
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    rows = seen(suite)
    if death == "passes":
        result.assert_outcomes(passed=4)
        assert len({rows[f"m{i}"]["pid"] for i in range(4)}) == 1
        return
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_m.py::test_m[[]1[]]*"])
    # The test before it ran in the same child; the ones after in a fresh one, which
    # built the module's fixture once for them.
    assert rows["m0"]["pid"] == rows["m1"]["pid"] != rows["m2"]["pid"] == rows["m3"]["pid"]
    assert rows["m2"]["builds"] == rows["m3"]["builds"] == 1
    assert rows["m teardown"]["pid"] == rows["m3"]["pid"]
    result.stdout.fnmatch_lines(["*4 tests isolated in 2 children*"])
    if "poison" in death:
        result.stdout.fnmatch_lines(
            [f"*{REPLACED_TITLE}*", "child replaced: its call failed with*"]
        )
        result.stdout.fnmatch_lines(
            [f"*1 scope child was replaced after a test ({REPLACED_TITLE})*"]
        )
    else:
        result.stdout.no_fnmatch_line("*child replaced*")


def test_a_group_joins_tests_of_two_modules_into_one_child(suite):
    suite.makepyfile(
        test_g1="""
        import pytest
        from record import record

        @pytest.mark.gpu(count=0, group="llm")
        def test_first():
            record("first")

        @pytest.mark.gpu(count=0)
        def test_between():
            record("between")
        """,
        test_g2="""
        import pytest
        from record import record

        @pytest.mark.gpu(count=0, group="llm")
        def test_second():
            record("second")
        """,
    )
    # One test at a time: otherwise test_between, booted ahead, may well end first.
    result = suite.runpytest_subprocess("-v", "-p", "no:cacheprovider", "--spawn-jobs", "1")
    result.assert_outcomes(passed=3)
    rows = seen(suite)
    assert rows["first"]["pid"] == rows["second"]["pid"] != rows["between"]["pid"]
    # The group runs together, at its first test's place.
    result.stdout.fnmatch_lines(["*test_first PASSED*", "*test_second PASSED*", "*test_between*"])


def test_class_scope_shares_a_child_per_class(suite):
    suite.makepyfile(
        test_k="""
        import pytest
        from record import record

        pytestmark = pytest.mark.gpu(count=0, scope="class")

        class TestOne:
            def test_a(self):
                record("one a")
            def test_b(self):
                record("one b")

        class TestTwo:
            def test_a(self):
                record("two a")

        def test_free():
            record("free")
        """
    )
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    rows = seen(suite)
    assert rows["one a"]["pid"] == rows["one b"]["pid"]
    assert len({rows[n]["pid"] for n in ("one a", "two a", "free")}) == 3


@pytest.mark.parametrize(
    "text, message",
    [
        (
            'pytestmark = pytest.mark.gpu(scope="session")',
            "*test_bad.py::test_x: @pytest.mark.gpu(scope='session'): expected test, class "
            "or module, got 'session'*",
        ),
        ('pytestmark = pytest.mark.gpu(group="")', "*(group=''): expected a group name*"),
        (
            'pytestmark = pytest.mark.gpu(count=0, scope="module")\n@pytest.mark.gpu(count=1)',
            "*test_bad.py::test_x and test_bad.py::test_y share a child (module test_bad.py) "
            "but need different devices or budgets*",
        ),
    ],
)
@pytest.mark.parametrize("xdist", [False, True], ids=["", "n2"])
def test_bad_scopes_are_usage_errors_naming_their_source(pytester, text, message, xdist):
    """Under xdist too: a worker that raised the usage error ended its session while the
    controller waited for its tests, an INTERNALERROR (``assert not crashitem``); the
    error now reaches the controller as a collection error, shown once, and nothing
    runs."""
    body = "\ndef test_x():\n    pass\n\ndef test_y():\n    pass\n"
    pytester.makepyfile(test_bad=f"import pytest\n{text}{body}")
    args = ["-p", "no:cacheprovider", "--spawn-gpus", "0,", *(["-n", "2"] if xdist else [])]
    result = pytester.runpytest_subprocess(*args)
    if not xdist:
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([message])
        return
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    pattern = "spawnrun: usage error: *" + message.lstrip("*")
    shown = [line for line in result.stdout.lines if fnmatch.fnmatch(line, pattern)]
    assert len(shown) == 1, result.stdout.str()  # once, though each worker found it
    result.assert_outcomes(errors=1)


def test_budgets_learned_for_a_scope_take_its_largest_or_run_alone(suite):
    # Peaks an earlier run recorded differ from test to test (the first one builds the
    # fixture): a scope's child gets the largest, or runs alone while one is missing.
    budget = 'record(f"{__name__} {i}", int(os.environ.get("SPAWNRUN_GPU_BUDGET", "0")))'
    for name in ("full", "partial"):
        text = MODULE.format(
            name=name, mark='pytestmark = pytest.mark.gpu(scope="module")', second="pass"
        )
        text = text.replace('record(f"' + name + '{i}", len(BUILDS))', budget)
        suite.makepyfile(**{f"test_{name}": textwrap.dedent(text)})
    gib = 2**30
    peaks = {f"test_full.py::test_full[{i}]": (i + 1) * gib for i in range(4)}
    peaks |= {f"test_partial.py::test_partial[{i}]": gib for i in range(3)}
    cache = suite.path / ".pytest_cache" / "v" / "spawnrun"
    cache.mkdir(parents=True)
    (cache / "peaks").write_text(json.dumps(peaks))
    args = ["--spawn-gpus", "GPU-a", "--spawn-gpu-memory", "80GiB", "--spawn-pack", "auto"]
    result = suite.runpytest_subprocess("--spawn-scope", "module", *args)
    result.assert_outcomes(passed=8)
    rows = seen(suite)
    full = {rows[f"test_full {i}"]["builds"] for i in range(4)}
    partial = {rows[f"test_partial {i}"]["builds"] for i in range(4)}
    assert len(full) == 1 and full.pop() > 4 * gib  # the largest peak, and a margin
    assert partial == {0}  # alone: its last test has no peak recorded yet


def test_the_next_scopes_child_boots_while_a_long_scope_runs(suite):
    # One child booted ahead: the next module's, not a test of the running module
    # (those run in its child), so it imports its module while the first one runs.
    body = """
        import time
        import pytest
        from record import record

        pytestmark = pytest.mark.gpu(count=0, scope="module")
        record("{name} imported", int(time.time() * 1000))

        @pytest.mark.parametrize("i", range(4))
        def test_it(i):
            record(f"{name}{{i}}", int(time.time() * 1000))
            time.sleep(0.3)
        """
    for name in ("a", "b"):
        suite.makepyfile(**{f"test_{name}": textwrap.dedent(body.format(name=name))})
    args = ["--spawn-jobs", "1", "--spawn-lookahead", "1", "-p", "no:cacheprovider"]
    suite.runpytest_subprocess(*args).assert_outcomes(passed=8)
    rows = seen(suite)
    assert rows["b imported"]["pid"] == rows["b0"]["pid"] != rows["a0"]["pid"]
    assert rows["b imported"]["builds"] < rows["a2"]["builds"]  # booted by a's third test


SIDE_BY_SIDE = """
import time
import pytest
from record import record

pytestmark = pytest.mark.gpu(count=0, scope="module")

@pytest.mark.parametrize("i", range(3))
def test_it(i):
    record(f"{name}{{i}} start", int(time.time() * 1000))
    time.sleep(0.4)
    record(f"{name}{{i}} end", int(time.time() * 1000))
    assert "{fail}" != f"{name}{{i}}"
"""


@pytest.mark.parametrize("fail", ["", "a0"])
def test_modules_run_side_by_side_in_their_children(suite, fail):
    # pytest walks the tests in order; a module's next test waits for its child, but
    # the other modules' children run meanwhile. -x still stops everything.
    for name in ("a", "b", "c"):
        text = SIDE_BY_SIDE.format(name=name, fail=fail)
        suite.makepyfile(**{f"test_{name}": textwrap.dedent(text)})
    args = ["--spawn-jobs", "3", "-p", "no:cacheprovider"] + (["-x"] if fail else [])
    result = suite.runpytest_subprocess(*args)
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    rows = seen(suite)
    if fail:
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.stdout.fnmatch_lines(["FAILED test_a.py::test_it[[]0[]]*"])
        assert "a1 start" not in rows and "a2 start" not in rows
        return
    result.assert_outcomes(passed=9)
    for name in ("a", "b", "c"):
        assert len({rows[f"{name}{i} start"]["pid"] for i in range(3)}) == 1
    # The next module's first test began before this module's second one ended.
    assert rows["b0 start"]["builds"] < rows["a1 end"]["builds"]
    assert rows["c0 start"]["builds"] < rows["b1 end"]["builds"]


def test_under_xdist_loadfile_a_module_shares_its_workers_child(suite):
    pytest.importorskip("xdist")
    mark = 'pytestmark = pytest.mark.gpu(count=0, scope="module")'
    write_module(suite, "a", mark)
    write_module(suite, "b", mark)
    result = suite.runpytest_subprocess("-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=8)
    rows = seen(suite)
    for name in ("a", "b"):
        assert len({rows[f"{name}{i}"]["pid"] for i in range(4)}) == 1
        assert [rows[f"{name}{i}"]["builds"] for i in range(4)] == [1, 1, 1, 1]


def test_default_scope_stays_one_child_per_test(suite):
    write_module(suite, "d", "pytestmark = pytest.mark.gpu(count=0)")
    suite.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=4)
    rows = seen(suite)
    assert len({rows[f"d{i}"]["pid"] for i in range(4)}) == 4
    assert [rows[f"d{i}"]["builds"] for i in range(4)] == [1, 1, 1, 1]


def _report(outcome: str, longrepr: str, when: str = "call") -> pytest.TestReport:
    return pytest.TestReport("t.py::t", ("t.py", 0, "t"), {}, outcome, longrepr, when)


@pytest.mark.parametrize(
    "reports, expected",
    [
        (
            [_report("failed", "RuntimeError: CUDA error: device-side assert triggered")],
            "device-side assert",
        ),
        ([_report("failed", "torch.OutOfMemoryError: CUDA out of memory")], ""),
        (
            [
                _report("passed", None),
                _report("failed", "x\nCUBLAS_STATUS_EXECUTION_FAILED when calling", "teardown"),
            ],
            "CUBLAS_STATUS_EXECUTION_FAILED",
        ),
        ([_report("skipped", ("f", 1, "illegal memory access"))], ""),  # only failures count
    ],
)
def test_which_failures_break_the_process(reports, expected):
    why = _poison.verdict(reports, _poison.patterns([]))
    assert (expected in why) if expected else why == ""


POISON_SOURCES = """
import pytest

def test_assertion_names_it():
    # an illegal memory access would show here; this is a plain failure
    assert 1 == 2

def test_raises_it():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

def test_chained():
    try:
        raise RuntimeError("CUDA error: device-side assert triggered")
    except RuntimeError as exc:
        raise ValueError("the model failed") from exc
"""


def test_only_the_exceptions_words_break_the_process(pytester):
    """Real reports: an assertion whose source (a comment) names a poison does not count
    (it replaced a scope's child, so the next test lost the scope's state); the raised
    error does, chained under another one too."""
    pytester.makepyfile(test_poison=POISON_SOURCES)
    reports = pytester.inline_run("-p", "no:spawnrun").getreports("pytest_runtest_logreport")
    found = _poison.patterns([])
    by_name = {r.nodeid.split("::")[-1]: r for r in reports if r.when == "call"}
    assert by_name["test_assertion_names_it"].failed
    poisoned = {name: bool(_poison.verdict([r], found)) for name, r in by_name.items()}
    assert poisoned == {
        "test_assertion_names_it": False,
        "test_raises_it": True,
        "test_chained": True,
    }


def test_own_patterns_match_per_line():
    found = _poison.patterns(["^wedged$"])
    assert _poison.verdict([_report("failed", "E  x\nwedged\ntail")], found)
    assert not _poison.verdict([_report("failed", "not wedged here")], found)


@pytest.mark.parametrize("held, replaced", [("3221225472", True), ("1024", False)])
def test_a_child_that_keeps_too_much_device_memory_is_replaced(suite, fake_torch, held, replaced):
    # torch (a stand-in) still has memory allocated after the first test: past
    # --spawn-scope-memory, the scope's next test gets a fresh child.
    suite.makepyfile(
        test_held=f"""
        import os
        import pytest
        import torch
        from record import record

        pytestmark = pytest.mark.gpu(count=0, scope="module")

        def test_keeps():
            torch.cuda.zeros(1)
            os.environ["FAKE_HELD"] = "{held}"
            record("keeps")

        def test_next():
            record("next")
        """
    )
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "--spawn-scope-memory", "1GiB")
    result.assert_outcomes(passed=2)
    rows = seen(suite)
    assert (rows["keeps"]["pid"] != rows["next"]["pid"]) is replaced
    if replaced:
        result.stdout.fnmatch_lines(
            [f"*1 scope child was replaced after a test ({REPLACED_TITLE})*"]
        )
    else:
        result.stdout.no_fnmatch_line(f"*{REPLACED_TITLE}*")


STOPPED_SCOPE = """
import os, pytest

@pytest.fixture(scope="module")
def resource():
    yield 1
    with open(os.environ["TORN_DOWN"], "w") as f:
        f.write(str(os.getpid()))

pytestmark = pytest.mark.gpu(count=0)

def test_a(resource):
    pass

def test_b(resource):
    assert False

def test_c(resource):
    pass
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_stopped_run_still_tears_down_its_scope(pytester, monkeypatch, method):
    """-x stops the run after test_b: the module's child, idle between tests, is let go
    (not killed), so the module fixture's teardown runs, as in-process."""
    marker = pytester.path / "torn-down"
    monkeypatch.setenv("TORN_DOWN", str(marker))
    pytester.makepyfile(test_stop=STOPPED_SCOPE)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-x", "--spawn-scope", "module", "--spawn-method", method
    )
    result.assert_outcomes(passed=1, failed=1)
    assert marker.exists() and marker.read_text().isdigit()
