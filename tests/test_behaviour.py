"""End-to-end behaviour of the core: finding tests, guards, parent state, interrupts."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from spawnrun.wire import _reports

NO_INTERNAL = "*INTERNALERROR*"


def test_spawned_runs_in_another_pid_unmarked_in_parent(pytester, monkeypatch):
    monkeypatch.delenv("SPAWNRUN_CHILD", raising=False)
    pytester.makeconftest(
        """
        import os
        def pytest_configure(config):
            if os.environ.get("SPAWNRUN_CHILD") != "1":
                open("parent.pid", "w").write(str(os.getpid()))
        """
    )
    pytester.makepyfile(
        """
        import json, os
        import pytest
        import spawnrun

        def record(name):
            with open(name + ".json", "w") as f:
                json.dump([os.getpid(), os.environ.get("SPAWNRUN_CHILD"), spawnrun.is_child()], f)

        @pytest.mark.gpu
        def test_marked():
            record("marked")

        def test_unmarked():
            record("unmarked")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    parent = int((pytester.path / "parent.pid").read_text())
    marked = json.loads((pytester.path / "marked.json").read_text())
    unmarked = json.loads((pytester.path / "unmarked.json").read_text())
    assert marked[0] != parent and marked[1:] == ["1", True]
    assert unmarked == [parent, None, False]


def test_marker_on_class_module_and_param(pytester):
    pytester.makepyfile(
        test_module="""
        import pytest, spawnrun
        pytestmark = pytest.mark.gpu
        def test_in_module():
            assert spawnrun.is_child()
        """,
        test_other="""
        import pytest, spawnrun

        @pytest.mark.gpu
        class TestCls:
            def test_in_class(self):
                assert spawnrun.is_child()

        @pytest.mark.parametrize("spawned", [pytest.param(True, marks=pytest.mark.gpu), False])
        def test_param(spawned):
            assert spawnrun.is_child() == spawned
        """,
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=4)


def test_ini_spawn_gpu_spawns_everything(pytester):
    # filterwarnings = error: the child must not warn while it configures itself.
    pytester.makeini("[pytest]\nspawn_gpu = true\nfilterwarnings = error\n")
    pytester.makepyfile("import spawnrun\ndef test_x():\n    assert spawnrun.is_child()\n")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    # The command line wins over ini.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--no-spawn")
    result.assert_outcomes(failed=1)


MIXED = """
import os
import re
import sys
import pytest
import spawnrun

LOG = os.path.join(os.path.dirname(__file__), "events.log")

def log(event):
    with open(LOG, "a") as f:
        f.write(f"{{event}} {{'child' if spawnrun.is_child() else 'parent'}}\\n")

@pytest.fixture(scope="module")
def mod_res():
    log("module-setup")
    yield
    log("module-teardown")

class TestShared:
    @pytest.fixture(scope="class")
    def cls_res(self):
        log("class-setup")
        yield
        log("class-teardown")

    {first}
    def test_a(self, mod_res, cls_res):
        pass

    {second}
    def test_b(self, mod_res, cls_res):
        pass

{first}
def test_c(mod_res):
    pass

{second}
def test_d(mod_res):
    pass

def test_e_last_in_module():
    pass
"""


@pytest.mark.parametrize("order", ["spawned-first", "inprocess-first"])
def test_mixed_module_keeps_parent_fixture_stack(pytester, order):
    mark = "@pytest.mark.gpu"
    first, second = (mark, "") if order == "spawned-first" else ("", mark)
    pytester.makepyfile(test_mixed=MIXED.format(first=first, second=second))
    pytester.makepyfile(test_next="def test_next_module():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v")
    result.assert_outcomes(passed=6)
    result.stdout.no_fnmatch_line("*not torn down properly*")
    events = (pytester.path / "events.log").read_text().splitlines()
    parent = [e for e in events if e.endswith("parent")]
    # In-process tests share one module and one class fixture in the parent, each
    # set up once and torn down once, in order.
    assert parent == [
        "module-setup parent",
        "class-setup parent",
        "class-teardown parent",
        "module-teardown parent",
    ]
    # Each spawned test built and tore down its own copies.
    child = [e for e in events if e.endswith("child")]
    assert child.count("module-setup child") == 2
    assert child.count("module-teardown child") == 2


def test_parent_teardown_error_lands_on_spawned_test(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture(scope="module")
        def fragile():
            yield
            raise RuntimeError("parent module teardown failed")

        def test_inproc(fragile):
            pass

        @pytest.mark.gpu
        def test_spawned_last():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_spawned_last*", "*parent module teardown failed*"]
    )


def test_fallback_collection_finds_ids_that_depend_on_the_whole_run(outcomes, pytester):
    # Ids numbered in collection order across files: collecting test_b.py alone gives
    # other ids than the parent saw, so the child must fall back to the parent's args.
    outcomes.conftest(
        """
import itertools
_counter = itertools.count()

def pytest_generate_tests(metafunc):
    if "n" in metafunc.fixturenames:
        n = next(_counter)
        metafunc.parametrize("n", [n], ids=[f"seq{n}"])
"""
    )
    pytester.makepyfile(
        test_a="def test_first(n):\n    pass\n",
        test_b="import pytest\n@pytest.mark.gpu\ndef test_second(n):\n    assert n == 1\n",
    )
    result, seen = outcomes.run("-v")
    result.assert_outcomes(passed=2)
    assert ("test_b.py::test_second[seq1]", "call", "passed", False) in seen


def test_a_child_collects_only_the_path_to_its_test(pytester, monkeypatch):
    """pytest lists every directory on the way to an argument and makes a collector of
    each file and folder there: each child of a folder of 400 test files paid for all
    of them (15 s against 9.4 s for 400 trivial tests in fast mode). A child now
    collects only its file and the folders above it; what lies below a folder argument
    (the parent's arguments, on fallback) is still collected, and subfolders' conftests
    still apply. pytest's own collectors of those folders do not even ask the ignore
    hooks about the rest (each asking is a call of every plugin's hook)."""
    seen = pytester.path / "seen.txt"
    monkeypatch.setenv("SEEN", str(seen))
    asked = pytester.path / "asked.txt"
    monkeypatch.setenv("ASKED", str(asked))
    pytester.makeconftest(
        """
        import os
        import pytest
        import spawnrun

        def pytest_collect_file(file_path, parent):
            if spawnrun.is_child():
                with open(os.environ["SEEN"], "a") as f:
                    f.write(file_path.name + "\\n")

        @pytest.hookimpl(tryfirst=True)
        def pytest_ignore_collect(collection_path):
            if spawnrun.is_child():
                with open(os.environ["ASKED"], "a") as f:
                    f.write(collection_path.name + "\\n")
        """
    )
    sub = pytester.mkpydir("sub")
    (sub / "conftest.py").write_text(
        "import pytest\n@pytest.fixture\ndef here():\n    return 'sub'\n"
    )
    (sub / "test_inner.py").write_text(
        "import pytest\n@pytest.mark.gpu\ndef test_inner(here):\n    assert here == 'sub'\n"
    )
    (sub / "test_other.py").write_text("def test_other():\n    pass\n")
    for name in ("test_a", "test_b", "test_c"):
        pytester.makepyfile(**{name: "def test_plain():\n    pass\n"})
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)
    # (A package's __init__.py is its own collector's in some pytest versions.)
    assert set(seen.read_text().split()) - {"__init__.py"} == {"test_inner.py"}
    others = {"test_a.py", "test_b.py", "test_c.py", "test_other.py", "seen.txt"}
    assert not set(asked.read_text().split() if asked.exists() else []) & others


def test_not_found_is_a_failure_with_collection_errors(pytester):
    pytester.makepyfile(
        test_gone="""
        import os
        import pytest
        if os.environ.get("SPAWNRUN_CHILD") == "1":
            raise ImportError("this module refuses to import in the child")

        @pytest.mark.gpu
        def test_vanishes():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            f"*{_reports.NOT_FOUND}*",
            "*node id 'test_gone.py::test_vanishes' was not collected by the child*",
            "*ImportError: this module refuses to import in the child*",
        ]
    )
    result.stdout.no_fnmatch_line(NO_INTERNAL)


@pytest.mark.parametrize("hook", ["pytest_configure(config)", "pytest_sessionstart(session)"])
def test_a_hook_that_fails_in_the_child_shows_its_error_once(pytester, hook):
    # Not a question of the node id: the error and its traceback are the report, and no
    # second child collects again only to fail alike.
    pytester.makeconftest(
        f"""
        import os
        CHILD = os.environ.get("SPAWNRUN_CHILD") == "1"
        if CHILD:
            with open("boots.txt", "a") as f:
                f.write("boot\\n")

        def {hook}:
            if CHILD:
                raise RuntimeError("no driver in this child")
        """
    )
    pytester.makepyfile("import pytest\n@pytest.mark.gpu\ndef test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            _reports.BOOT_FAILED,
            "*Traceback (most recent call last):*",
            "*conftest.py*, line *, in pytest_*",
            "*RuntimeError: no driver in this child",
        ]
    )
    result.stdout.no_fnmatch_line(f"*{_reports.NOT_FOUND}*")
    assert (pytester.path / "boots.txt").read_text() == "boot\n"


def test_deselected_in_child_lists_what_was_collected(pytester):
    pytester.makeconftest(
        """
        import os
        def pytest_collection_modifyitems(config, items):
            if os.environ.get("SPAWNRUN_CHILD") == "1":
                items[:] = [i for i in items if "hidden" not in i.name]
        """
    )
    pytester.makepyfile(
        "import pytest\n@pytest.mark.gpu\ndef test_hidden():\n    pass\n"
        "def test_visible():\n    pass\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*the child collected 1 test(s):*", "*test_visible*"])


GUARD_CONFTEST = """
import os
import re
import sys
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if os.environ.get("SPAWNRUN_CHILD") != "1":
        return None
    if "setup_only" in item.name:
        # A harness that claims success without running the test.
        rep = pytest.TestReport(item.nodeid, item.location, {}, "passed", None, "setup")
        item.ihook.pytest_runtest_logreport(report=rep)
        return True
    if "nothing" in item.name:
        return True
    return None
"""


def test_silent_pass_guard(pytester):
    pytester.makeconftest(GUARD_CONFTEST)
    pytester.makepyfile(
        """
        import pytest
        pytestmark = pytest.mark.gpu
        def test_setup_only():
            pass
        def test_nothing():
            pass
        def test_honest():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_nothing*",
            f"{_reports.NO_CALL} (nor any other report)",
            "*_ test_setup_only _*",
            _reports.NO_CALL,
            "ERROR *test_nothing*",
            "FAILED *test_setup_only*",
        ]
    )
    result.stdout.no_fnmatch_line("PASSED *test_setup_only*")
    result.stdout.no_fnmatch_line("PASSED *test_nothing*")


def test_exitfirst_stops_dispatch_and_kills_running_children(pytester):
    """A test pytest reached after the failing one is killed; as in-process, where pytest
    never reached it, it reports nothing (it was reported skipped, "stopped while
    running": a count plain pytest does not give; issue 43)."""
    pytester.makepyfile(
        """
        import os, time
        import pytest
        pytestmark = pytest.mark.gpu
        def test_one():
            # Fails once the next test runs beside it (pytest reached it: -x then finds
            # a running child to stop), or after 10 s.
            end = time.time() + 10
            while not os.path.exists("two.txt") and time.time() < end:
                time.sleep(0.05)
            assert False
        def test_two_still_running():
            open("two.txt", "w").write("x")
            time.sleep(30)
        def test_three_never_starts():
            open("three.txt", "w").write("x")
        """
    )
    start = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-x", "-rs")
    assert time.monotonic() - start < 25
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*stopping after 1 failures*"])
    result.stdout.no_fnmatch_line("*stopped while running*")
    assert not (pytester.path / "three.txt").exists()


@pytest.mark.parametrize("mode", ["in-process", "spawned"])
def test_exitfirst_lets_a_test_reached_before_the_failure_finish(pytester, mode):
    """As in-process, a test pytest reached before the failing one ends and reports; the
    test after it never starts (the old scheduler killed the first as "stopped")."""
    pytester.makepyfile(
        """
        import time
        import pytest
        pytestmark = pytest.mark.gpu(count=0)
        def test_reached_first():
            time.sleep(2)  # still running when the next test fails
        def test_fails():
            assert False
        def test_never_starts():
            open("three.txt", "w").write("x")
        """
    )
    args = ["-p", "no:cacheprovider", "-x", "--spawn-jobs", "2"]
    result = pytester.runpytest_subprocess(*args, *(["--no-spawn"] if mode == "in-process" else []))
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*stopping after 1 failures*"])
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    assert not (pytester.path / "three.txt").exists()


def _session_end(result: pytest.RunResult) -> list[str]:
    """The run's lines after collection, without spawnrun's summary and timings."""
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "collected " in line)
    kept = []
    for line in lines[start:]:
        if "spawnrun" in line or " isolated in " in line or " started while collecting " in line:
            continue
        kept.append(re.sub(r" in [0-9.]+s ", " in Ts ", line))
    return kept


@pytest.mark.parametrize(
    "body, code",
    [
        ("pytest.exit('stop the run', returncode=3)", 3),
        ("pytest.exit('stop the run')", 2),
        ("raise KeyboardInterrupt", 2),
    ],
    ids=["pytest.exit-code", "pytest.exit", "KeyboardInterrupt"],
)
def test_interrupt_in_child_stops_session_like_in_process(pytester, body, code):
    pytester.makepyfile(
        f"""
        import pytest
        pytestmark = pytest.mark.gpu
        def test_stops():
            {body}
        def test_never_runs():
            open("ran.txt", "w").write("x")
        def test_booted_ahead():
            pass
        """
    )
    # One child at a time: with more, a test already running when the session stops is
    # stopped too (and may have started), which in-process pytest cannot show. Children
    # booted ahead for the tests after it are killed at once.
    ends = []
    for extra in (["--no-spawn"], ["--spawn-jobs", "1", "--spawn-lookahead", "2"]):
        start = time.monotonic()
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *extra)
        assert time.monotonic() - start < 15
        assert result.ret == code
        result.stdout.no_fnmatch_line(NO_INTERNAL)
        assert not (pytester.path / "ran.txt").exists()
        ends.append(_session_end(result))
    # The same lines: one banner, one "no tests ran", the interrupt's place in the test.
    assert ends[1] == ends[0]
    if "KeyboardInterrupt" in body:
        test_file = pytester.path / "test_interrupt_in_child_stops_session_like_in_process.py"
        assert f"{test_file}:4: KeyboardInterrupt" in ends[1]


@pytest.mark.parametrize("option", ["--setup-plan", "--setup-only"])
def test_setup_plan_and_setup_only_read_as_in_process(pytester, option):
    # No test is called: the children show their fixtures' setup and teardown, as
    # pytest does, and no "call report" is missing. (Module- and session-scoped fixtures
    # would show once per spawned test: each child builds its own.)
    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture
        def fix():
            yield 1

        @pytest.mark.gpu
        def test_spawned(fix):
            assert False

        def test_in_process(fix):
            assert False

        @pytest.mark.gpu
        @pytest.mark.parametrize("x", [1, 2])
        def test_param(x, fix):
            assert False
        """
    )
    ends = []
    for extra in (["--no-spawn"], ["--spawn-jobs", "1"]):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", option, "-v", *extra)
        result.stdout.no_fnmatch_line(NO_INTERNAL)
        result.assert_outcomes()
        ends.append(_session_end(result))
    assert ends[1] == ends[0]
    assert "        SETUP    F fix" in ends[1]


def test_fork_unsafe_device_initialized_in_parent(pytester, fakedevice):
    pytester.makeconftest(
        """
        import fakedevice
        fakedevice.init()  # like a conftest that touches CUDA at import
        """
    )
    pytester.makepyfile(
        """
        import os
        import pytest
        import fakedevice

        @pytest.mark.gpu
        @pytest.mark.parametrize("x", [1, 2, 3])
        def test_spawned_can_use_device(x):
            assert fakedevice.compute(x) == 2 * x

        def test_forking_would_break():
            # The control: a child *forked* from a process that initialized the
            # device cannot use it, exactly like CUDA.
            pid = os.fork()
            if pid == 0:
                try:
                    fakedevice.compute(1)
                except RuntimeError as exc:
                    os._exit(7 if fakedevice.FORK_ERROR in str(exc) else 1)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 7
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"
    )
    result.assert_outcomes(passed=4)


def test_pdb_runs_in_process_with_one_notice(pytester):
    pytester.makepyfile(
        "import pytest, spawnrun\n"
        "@pytest.mark.gpu\n"
        "def test_x():\n"
        "    assert not spawnrun.is_child()\n"
    )
    for flag in ("--pdb", "--trace"):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", flag)
        result.assert_outcomes(passed=1)
        notices = [line for line in result.outlines if line.startswith("spawnrun:")]
        assert notices == [
            f"spawnrun: {flag} given, so every test runs in-process: "
            "a debugger can only stop a test that runs in this process"
        ]


def test_parent_never_imports_torch(pytester):
    pytest.importorskip("torch")
    pytester.makeconftest(
        """
        import sys
        def pytest_sessionfinish(session):
            import os
            if os.environ.get("SPAWNRUN_CHILD") != "1":
                open("parent_torch.txt", "w").write(str("torch" in sys.modules))
        """
    )
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.gpu
        def test_uses_torch():
            import torch
            assert torch.ones(2).sum().item() == 2.0
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert (pytester.path / "parent_torch.txt").read_text() == "False"


@pytest.mark.parametrize(
    "marker, expected",
    [
        ("gpu(timeout='soon')", "*test_bad*timeout='soon'*expected seconds*"),
        ("gpu(timeout=-1)", "*test_bad*seconds must be >= 0*"),
        ("gpu(count=-2)", "*test_bad*count=-2*whole number >= 0*"),
        ("gpu(gpus=2)", "*test_bad*unknown keyword argument(s) gpus*"),
        ("gpu(2)", "*test_bad*keyword arguments only*"),
    ],
)
def test_bad_marker_arguments_are_usage_errors(pytester, marker, expected):
    pytester.makepyfile(f"import pytest\n@pytest.mark.{marker}\ndef test_bad():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {expected}"])


def test_conflicting_flags_are_a_usage_error(pytester):
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("--spawn-gpu", "--no-spawn")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--spawn-gpu and --no-spawn cannot be used together*"])


def test_capture_no_streams_child_output_live(pytester):
    pytester.makepyfile(
        "import pytest\n@pytest.mark.gpu\ndef test_x():\n    print('LIVE-FROM-CHILD')\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*LIVE-FROM-CHILD*"])


LIVE_ORDER = """
import pytest

@pytest.mark.gpu(count=0)
def test_spawned():
    print("from the first spawned test")

def test_in_process():
    print("from the test in-process")

@pytest.mark.gpu(count=0)
def test_spawned_again():
    print("from the second", end=" ")
    print("spawned test")
"""


@pytest.mark.parametrize("verbosity", [["-v"], []])
def test_capture_no_output_comes_where_in_process_puts_it(pytester, verbosity):
    # In-process, what a test prints follows pytest's line for it (its node id with -v,
    # its file's name by default); a spawned test's live output, running alone, too.
    pytester.makepyfile(test_live=LIVE_ORDER)

    def tests_part(*args: str) -> list[str]:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", *verbosity, *args)
        result.assert_outcomes(passed=3)
        lines = result.stdout.lines
        # From the line after "collected 3 items" (the header differs) to the summary.
        start = next((i + 1 for i, line in enumerate(lines) if "collected" in line), 0)
        ends = ("===", "---")
        end = next(i for i in range(start, len(lines)) if lines[i].startswith(ends))
        assert end - start >= 3  # what the tests printed, at least
        return lines[start:end]

    assert tests_part("--spawn-jobs", "1") == tests_part("--no-spawn")


def test_child_module_does_not_import_parent_side(pytester):
    # The module map's rule: the child's entry point needs only the wire and pytest.
    import subprocess

    code = (
        "import sys, spawnrun.child._child; "
        "bad = [m for m in ('spawnrun.plugin', 'spawnrun.launch._runner', "
        "'spawnrun.driver._replay', 'spawnrun.config._settings', 'torch') "
        "if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    # A real child loads the whole plugin (its entry point); it still never imports a
    # device library the suite did not ask for.
    pytester.makepyfile(
        """
        import sys, pytest, spawnrun

        @pytest.mark.gpu
        def test_x():
            assert spawnrun.is_child()
            assert [m for m in ("torch", "numpy", "cupy", "jax") if m in sys.modules] == []
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_readme_demo_shows_isolation():
    """The demo suite the README's "Try the demo" command runs: passes, and fails without
    isolation (docs/guide/debugging.md says so of --no-spawn)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    base = [sys.executable, "-m", "pytest", "examples", "-p", "no:cacheprovider"]
    base += ["--spawn-gpus", "2"]
    env = {k: v for k, v in os.environ.items() if k != "SPAWNRUN_GPUS"}
    isolated = subprocess.run([*base, "-v"], cwd=root, env=env, capture_output=True, text=True)
    assert isolated.returncode == 0, isolated.stdout
    assert "5 passed" in isolated.stdout
    assert "PASSED [gpu" in isolated.stdout
    shared = subprocess.run(
        [*base, "--no-spawn"], cwd=root, env=env, capture_output=True, text=True
    )
    assert "2 failed, 3 passed" in shared.stdout, shared.stdout


def test_last_failed_sees_replayed_reports(pytester):
    pytester.makepyfile(
        """
        import os, pytest
        @pytest.mark.gpu
        def test_flaky():
            assert os.path.exists("fixed")
        @pytest.mark.gpu
        def test_fine():
            pass
        """
    )
    pytester.runpytest_subprocess().assert_outcomes(failed=1, passed=1)
    (pytester.path / "fixed").write_text("")
    result = pytester.runpytest_subprocess("--lf", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*rerun previous 1 failure*", "*test_flaky PASSED*"])
    result.stdout.no_fnmatch_line("*test_fine*")


def test_same_id_other_values_runs_the_parents_or_is_refused(pytester):
    # Parameters drawn at import (random, as torch.rand tensors or a set's hash order
    # would be) bind other values in a child: same node id, different test. The child
    # runs the parent's values; one that cannot travel (it does not pickle) is refused
    # with the cause, never run as the wrong test. A value whose repr holds a memory
    # address, or a set, is the same test and runs with the child's own object.
    pytester.makepyfile(
        test_b="""
        import os
        import random
        import threading
        import pytest
        import spawnrun

        DRAWN = random.random()
        if not spawnrun.is_child():
            os.environ["PARENTS_DRAWN"] = repr(DRAWN)

        class Locked:  # drawn at import too, and a lock does not pickle
            def __init__(self):
                self.n = random.random()
                self.lock = threading.Lock()

            def __repr__(self):
                return f"Locked({self.n})"

        @pytest.mark.gpu
        @pytest.mark.parametrize("n", [[DRAWN]], ids=["drawn"])
        def test_b(n):
            assert repr(n[0]) == os.environ["PARENTS_DRAWN"]

        @pytest.mark.gpu
        @pytest.mark.parametrize("value", [Locked()], ids=["locked"])
        def test_locked(value):
            pass
        """,
        test_c="""
        import pytest

        class Opaque:  # its repr holds a memory address, different in every process
            pass

        OPAQUE = Opaque()

        @pytest.mark.gpu
        @pytest.mark.parametrize("value", [OPAQUE, {"b", "a", "c"}], ids=["obj", "set"])
        def test_stable_values(value):
            assert value is OPAQUE or isinstance(value, set)
        """,
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*node id 'test_b.py::test_locked[[]locked[]]' names another test*"
            "the parent's value cannot travel: it does not pickle (TypeError:*lock*"
        ]
    )
    result.stdout.no_fnmatch_line("*INTERNALERROR*")


def test_script_without_main_guard_is_not_rerun_in_children(pytester):
    # multiprocessing's spawn would import the parent's script in every child: a
    # pytest.main() without a __main__ guard would then start nested sessions.
    pytester.makepyfile(
        test_x="import pytest\n@pytest.mark.gpu\ndef test_x():\n    pass\n",
        run=(
            "import pytest\n"
            "print('SCRIPT RAN')\n"
            "pytest.main(['-p', 'no:cacheprovider', 'test_x.py'])\n"
        ),
    )
    result = pytester.run(sys.executable, "run.py", timeout=120)
    assert result.stdout.str().count("SCRIPT RAN") == 1
    result.stdout.fnmatch_lines(["*1 passed*"])
    result.stdout.no_fnmatch_line("*INTERNALERROR*")


MAIN_SUITE = """
import doctest, json, sys, warnings
import pytest

def observe(name):
    main = sys.modules["__main__"]
    spec = main.__spec__
    # doctest.testmod() with no module tests __main__ (einops' test file collects it as
    # a test): on Python 3.11 a bare __main__ gave a DeprecationWarning of importlib's.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        doctest.testmod()
    seen = {
        "repr": repr(main),
        "name": main.__name__,
        "file": getattr(main, "__file__", None),
        "doc": main.__doc__,
        "spec": None if spec is None else [spec.name, spec.origin, spec.cached],
        "loader": [type(main.__loader__).__name__, getattr(main.__loader__, "path", None)],
        "vars": {k: type(v).__name__ for k, v in vars(main).items()},
        "dir": dir(main),
        "warnings": [str(w.message) for w in caught],
    }
    with open(name + ".json", "w") as f:
        json.dump(seen, f)

def test_in_process():
    observe("in_process")

@pytest.mark.gpu
def test_spawned():
    observe("spawned")
"""


@pytest.mark.parametrize("how", ["spawn", "forkserver", "script"])
def test_a_child_sees_the_parents_main_module(pytester, how):
    # A spawned child's __main__ is the parent's as a test sees it (name, file, spec,
    # docstring, what it binds), without the parent's script running again in it:
    # under `python -m pytest` pytest's __main__, under a script the script.
    pytester.makepyfile(test_main=MAIN_SUITE)
    args = ["-p", "no:cacheprovider", "--spawn-method", "spawn" if how == "script" else how]
    if how == "script":
        pytester.makepyfile(
            run=f'''
            """Runs the suite."""
            import sys
            import pytest
            LIMIT = 3
            NAMES = ("a", "b")
            if __name__ == "__main__":
                sys.exit(pytest.main({args!r}))
            '''
        )
        result = pytester.run(sys.executable, "run.py", timeout=120)
    else:
        result = pytester.runpytest_subprocess(*args)
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.assert_outcomes(passed=2)
    spawned = json.loads((pytester.path / "spawned.json").read_text())
    assert spawned == json.loads((pytester.path / "in_process.json").read_text())
    assert spawned["warnings"] == []


def test_warning_class_is_never_imported_in_the_parent(pytester):
    # A warning raised in a child from a module the parent never imported (torch's, say)
    # is shown under its own name without the parent importing that module.
    pytester.makepyfile(
        mywarnlib="class LibWarning(UserWarning):\n    pass\n",
        conftest="""
        import os, sys, spawnrun

        def pytest_sessionfinish(session):
            if not spawnrun.is_child():
                with open("imported.txt", "w") as f:
                    f.write(str("mywarnlib" in sys.modules))
        """,
        test_w="""
        import warnings
        import pytest

        @pytest.mark.gpu
        def test_warns():
            import mywarnlib
            warnings.warn(mywarnlib.LibWarning("from the library"))
        """,
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*LibWarning: from the library*"])
    assert (pytester.path / "imported.txt").read_text() == "False"


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_child_skips_its_terminal_summary_after_its_test(pytester, method):
    # Nobody reads a child's summary once its test is reported, and a plugin's summary
    # hook may be costly (hypothesis's imports hypothesis): the child skips it. Its
    # session's end still runs, as in-process.
    pytester.makeconftest(
        """
        import os, spawnrun

        def _mark(what):
            who = "child" if spawnrun.is_child() else "parent"
            open(f"{what}-{who}-{os.getpid()}", "w").close()

        def pytest_terminal_summary(terminalreporter):
            _mark("summary")

        def pytest_sessionfinish(session):
            _mark("sessionfinish")

        def pytest_unconfigure(config):
            _mark("unconfigure")
        """
    )
    pytester.makepyfile(
        "import pytest\n@pytest.mark.gpu\ndef test_x():\n    pass\n"
        "@pytest.mark.gpu\ndef test_y():\n    assert False\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--spawn-method", method)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*short test summary info*", "FAILED *::test_y*"])
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    kinds = ("summary-", "sessionfinish-", "unconfigure-")
    marks = sorted(
        p.name.rsplit("-", 1)[0] for p in pytester.path.iterdir() if p.name.startswith(kinds)
    )
    # One child per test, in both methods: a failure of the test's own runs once
    # (issue 56), in fast mode too.
    children = 2
    assert marks == [
        *["sessionfinish-child"] * children,
        "sessionfinish-parent",
        "summary-parent",
        *["unconfigure-child"] * children,
        "unconfigure-parent",
    ]


def test_error_in_a_childs_collection_hook_shows_its_traceback(pytester):
    # An exception in a hook at collection time ends the child's pytest with an
    # INTERNALERROR before the test is looked for: the report must carry it.
    pytester.makeconftest(
        """
        import spawnrun

        def pytest_collection_modifyitems(items):
            if spawnrun.is_child():
                raise RuntimeError("boom in the child's hook")
        """
    )
    pytester.makepyfile("import pytest\n@pytest.mark.gpu\ndef test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)  # the test could not be set up in its child
    result.stdout.fnmatch_lines(
        ["*pytest ended in the child before it reached the test*", "*boom in the child's hook*"]
    )


@pytest.mark.parametrize("call", ["breakpoint()", "import pdb; pdb.set_trace()"])
def test_debugger_in_a_spawned_test_says_what_to_do(pytester, call):
    pytester.makepyfile(f"import pytest\n@pytest.mark.gpu\ndef test_x():\n    {call}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*a debugger cannot stop a test that runs in a spawned*"])


def test_faulthandler_timeout_dumps_the_child_not_the_parent(pytester):
    pytester.makeini("[pytest]\nfaulthandler_timeout = 1\n")
    pytester.makepyfile(
        "import time, pytest\n@pytest.mark.gpu\ndef test_slow():\n    time.sleep(2.5)\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", "--spawn-jobs", "1")
    result.assert_outcomes(passed=1)
    dumps = result.stdout.str() + result.stderr.str()
    assert "test_slow" in dumps  # the child's own dump, streamed live with -s
    assert "_scheduler.py" not in dumps  # never the parent's wait loop


def test_testsuite_property_recorded_in_a_child_reaches_junitxml(pytester):
    """Under ``filterwarnings = error`` too: the child's own fixture was a session-scoped
    instance method, which pytest 9.2 warns of (the test errored, where in-process it
    passes)."""
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu
        def test_x(record_testsuite_property):
            record_testsuite_property("gpu_model", "H200")
        """
    )
    xml = pytester.path / "out.xml"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--junitxml={xml}")
    result.assert_outcomes(passed=1)
    import xml.etree.ElementTree as ET

    props = {p.get("name"): p.get("value") for p in ET.parse(xml).getroot().iter("property")}
    assert props.get("gpu_model") == "H200"


def test_child_keeps_the_parents_ini_and_conftests_with_a_nested_ini(pytester):
    # No ini file at the rootdir, a nested sub/pytest.ini: the parent uses none, so the
    # child must not adopt the nested one (and cut the root conftest off with it).
    pytester.makeconftest("import pytest\n@pytest.fixture\ndef rootfix():\n    return 1\n")
    sub = pytester.mkdir("sub")
    (sub / "pytest.ini").write_text("[pytest]\naddopts = --this-option-does-not-exist\n")
    (sub / "test_x.py").write_text(
        "import pytest\n@pytest.mark.gpu\ndef test_x(rootfix):\n    assert rootfix == 1\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--rootdir", ".")
    result.assert_outcomes(passed=1)


ENUM_CONFTEST = """
import enum, os, spawnrun

if spawnrun.is_child():
    with open("imports.txt", "a") as f:
        f.write(f"{os.getpid()}\\n")

class Backend(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"

def pytest_addoption(parser):
    parser.addoption("--backend", type=Backend, default=Backend.CPU)
"""


@pytest.mark.parametrize("mode", ["prepend", "importlib"])
def test_option_of_a_conftest_type_reaches_the_child_intact(pytester, mode):
    # The value's class is the conftest's own, and the conftest is imported once per
    # child, by pytest: never decoded before pytest starts.
    pytester.makeconftest(ENUM_CONFTEST)
    pytester.makepyfile(
        """
        import sys
        import pytest

        @pytest.mark.gpu
        def test_backend(request):
            value = request.config.getoption("backend")
            assert value.value == "cuda"
            assert type(value).__module__ in sys.modules
            assert type(value) is getattr(sys.modules[type(value).__module__], "Backend")
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--backend", "cuda", f"--import-mode={mode}"
    )
    result.assert_outcomes(passed=1)
    pids = (pytester.path / "imports.txt").read_text().split()
    assert len(pids) == len(set(pids))  # once per child


#: A conftest whose parent leaves cyclic garbage as its session ends, and says at the
#: end whether the parent's objects were frozen for pytest's final collections.
END_OF_SESSION_CONFTEST = """
import gc
import os
import pytest
import spawnrun

FINALIZED = os.path.abspath("finalized.txt")

class Cycle:
    def __init__(self):
        self.me = self
    def __del__(self):
        with open(FINALIZED, "w") as f:
            f.write("finalized at the session's end")

@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    if not spawnrun.is_child():
        Cycle()  # the parent's own garbage, made last: its finalizer must still run

def pytest_configure(config):
    if not spawnrun.is_child():
        config.add_cleanup(lambda: print(f"parent frozen: {gc.get_freeze_count() > 0}"))
"""


@pytest.mark.parametrize(
    ("args", "frozen"),
    [
        pytest.param(["--spawn-gpu"], True, id="every-test-spawned"),
        pytest.param([], False, id="one-test-in-process"),
        pytest.param(["--no-spawn"], False, id="no-spawn"),
    ],
)
def test_the_parent_freezes_its_objects_at_the_end_only_where_no_test_ran_in_it(
    pytester, args, frozen
):
    """A process that imported torch walks its ~250,000 objects at its end, more than
    once (pytest's final collections, then the interpreter's). Where every test ran in
    a child, the parent collects once and freezes the rest: its garbage is still
    finalized. Where a test ran in the parent, nothing changes."""
    pytester.makeconftest(END_OF_SESSION_CONFTEST)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu
        def test_spawned():
            pass

        def test_unmarked():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"parent frozen: {frozen}"])
    finalized = pytester.path / "finalized.txt"
    assert finalized.read_text() == "finalized at the session's end"
    result.stdout.no_fnmatch_line(NO_INTERNAL)


def test_a_session_that_the_process_outlives_leaves_its_objects_unfrozen(pytester):
    """``pytest.main`` called in a process that goes on (here a test's, through pytester):
    frozen objects are never collected, so the parent freezes nothing."""
    import gc

    pytester.makeconftest(END_OF_SESSION_CONFTEST)
    pytester.makepyfile("import pytest\n@pytest.mark.gpu(count=0)\ndef test_x():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["parent frozen: False"])
    assert gc.get_freeze_count() == 0
