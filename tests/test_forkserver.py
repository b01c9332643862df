"""The zygote (--spawn-method forkserver): a library-only template that forks per test.

It never imports the suite's conftests or test modules, so a device initialized there at
import is initialized in each forked child for itself; it refuses to fork (and the run
spawns) when something in the template itself is unsafe to fork.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
import time

import pytest

from spawnrun.launch import _forkserver
from spawnrun.launch import _preloads
from spawnrun.wire import _reports

DEVICE_SUITE = """
import json, os
import pytest
import fakedevice

@pytest.mark.gpu
@pytest.mark.parametrize("x", [1, 2, 3])
def test_uses_device(x):
    assert fakedevice.compute(x) == 2 * x
    with open(f"where{x}.json", "w") as f:
        json.dump([os.getpid(), os.getppid()], f)
"""


RECORD_PARENT = (
    "import os, spawnrun\n"
    "if not spawnrun.is_child():\n"
    "    with open('parent.pid', 'w') as f:\n"
    "        f.write(str(os.getpid()))\n"
)


def _libraries(pytester, monkeypatch, **modules: str):
    """A folder outside the rootdir holding ``modules`` (name -> source), first on the
    children's ``PYTHONPATH``: libraries, not the suite's own code."""
    libs = pytester.path.parent / f"{pytester.path.name}-libs"
    libs.mkdir()
    for name, source in modules.items():
        (libs / f"{name}.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", str(libs), prepend=os.pathsep)
    return libs


def _run_fast(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """Run the inner suite in fast mode (the zygote)."""
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-method", "forkserver", *args
    )


def _where(pytester: pytest.Pytester, i: int) -> str:
    return (pytester.path / f"where{i}.json").read_text()


def _forked(pytester: pytest.Pytester, n: int) -> bool:
    """Whether the n tests ran in distinct forked children (else spawned): their parent is
    the zygote or one of its configured templates, never pytest."""
    rows = [json.loads((pytester.path / f"where{i}.json").read_text()) for i in range(1, n + 1)]
    assert len({pid for pid, _ in rows}) == n
    parents = {ppid for _, ppid in rows}
    pytest_pid = int((pytester.path / "parent.pid").read_text())
    assert parents == {pytest_pid} or pytest_pid not in parents
    return pytest_pid not in parents


@pytest.mark.parametrize("template", ["library", "file", "run"])
def test_device_initialized_by_the_conftest_at_import_keeps_forking(pytester, fakedevice, template):
    # The vLLM case: the conftest touches the device at import. The library template
    # never runs the conftest, so each forked child initializes the device for itself.
    # A file's template does run it: the device, declared through the hook, keeps it
    # from forking, and each test collects its file in a child forked from the library.
    hook = (
        "def pytest_spawnrun_device_state(config=None):\n"
        "    return 'fakedevice is initialized' if fakedevice.is_initialized() else None\n"
    )
    conftest = RECORD_PARENT + "import fakedevice\nfakedevice.init()  # at import\n"
    pytester.makeconftest(conftest + (hook if template != "library" else ""))
    pytester.makepyfile(test_device=DEVICE_SUITE)
    result = _run_fast(pytester, "-W", "default", "--spawn-template", template)
    result.assert_outcomes(passed=3)
    result.stdout.no_fnmatch_line("*forkserver is off*")
    assert _forked(pytester, 3)
    if template != "library":
        result.stdout.fnmatch_lines(
            [f"test_device.py: {_reports.NOT_A_TEMPLATE}: fakedevice is initialized"]
        )


RUN_FILE = """
import json, os, sys
import pytest

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(2))
def test_here(i):
    imported = sorted(m for m in sys.modules if m.startswith("test_run_"))
    with open(os.environ["SEEN"], "a") as f:
        f.write(json.dumps([__name__, i, os.getpid(), os.getppid(), imported]) + "\\n")
"""


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_run_template_forks_the_tests_of_several_files(pytester, monkeypatch, jobs):
    # --spawn-template run: one template collects several files and forks each of
    # their tests; split over the job limit, each template collects only its share.
    files = ["test_run_a", "test_run_b", "test_run_c", "test_run_d"]
    for name in files:
        pytester.makepyfile(**{name: RUN_FILE})
    seen = pytester.path / "seen.jsonl"
    monkeypatch.setenv("SEEN", str(seen))
    result = _run_fast(pytester, "--spawn-template", "run", "--spawn-jobs", str(jobs))
    result.assert_outcomes(passed=8)
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    rows = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len({pid for _, _, pid, _, _ in rows}) == 8  # a fresh process per test
    by_template: dict[int, set[str]] = {}
    for module, _, _, ppid, imported in rows:
        by_template.setdefault(ppid, set()).add(module)
        assert module in imported
    assert len(by_template) == jobs
    templates = "template" if jobs == 1 else "templates"
    result.stdout.fnmatch_lines(
        [f"*8 tests isolated in 8 children (8 forked from {jobs} {templates} that collected*"]
    )
    for ppid, modules in by_template.items():
        # What each fork had imported: the files of its template's share, no others.
        shares = {tuple(imp) for _, _, _, p, imp in rows if p == ppid}
        assert shares == {tuple(sorted(modules))}
    expected = [set(files)] if jobs == 1 else [set(files[:2]), set(files[2:])]
    assert sorted(by_template.values(), key=sorted) == expected


TEMPLATE_SUITE = """
import json, os, signal, time
import pytest

BUILDS = []

@pytest.fixture(scope="module")
def model():
    BUILDS.append(1)
    return len(BUILDS)

@pytest.mark.gpu(count=0, timeout=4)
@pytest.mark.parametrize("i", range(4))
def test_t(model, i, tmp_path_factory):
    left = tmp_path_factory.getbasetemp() / "left-by-a-test"
    assert not left.exists()
    left.touch()
    with open("seen.jsonl", "a") as f:
        f.write(json.dumps([i, os.getpid(), os.getppid(), model]) + "\\n")
    if i == 1:
        {death}
"""

DEATHS = {
    "passes": "pass",
    "segfault": "os.kill(os.getpid(), signal.SIGSEGV)",
    "exit": "os._exit(3)",
    "timeout": "time.sleep(60)",
}


@pytest.mark.parametrize("death", list(DEATHS))
def test_a_files_template_forks_each_test_fresh_and_a_death_ends_it(pytester, death):
    pytester.makeconftest(RECORD_PARENT)
    pytester.makepyfile(test_t=TEMPLATE_SUITE.format(death=DEATHS[death]))
    result = _run_fast(pytester, "-v", "--spawn-jobs", "1")
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    seen = [json.loads(line) for line in (pytester.path / "seen.jsonl").read_text().splitlines()]
    pytest_pid = int((pytester.path / "parent.pid").read_text())
    # A death in a fork is evidence against the fork (issue 56): that test ran again,
    # once, in a spawned child of its own (pytest's), and died there too.
    again = [i for i, _, ppid, _ in seen if ppid == pytest_pid]
    assert again == ([] if death == "passes" else [1])
    rows = {i: (pid, ppid, builds) for i, pid, ppid, builds in seen if ppid != pytest_pid}
    # A process of its own per test, the module's fixture built in each, none by pytest.
    assert len({pid for pid, _, _ in rows.values()}) == 4
    assert {builds for _, _, builds in rows.values()} == {1}
    templates = [ppid for _, ppid, _ in rows.values()]
    assert pytest_pid not in templates
    if death == "passes":
        result.assert_outcomes(passed=4)
        assert len(set(templates)) == 1
        result.stdout.fnmatch_lines(
            ["*4 tests isolated in 4 children (4 forked from 1 template that collected*"]
        )
        return
    result.assert_outcomes(passed=3, failed=1)
    assert result.parseoutcomes().get("rerun") == 1
    result.stdout.fnmatch_lines(["FAILED test_t.py::test_t[[]1[]]*"])
    # The fork's death ended its template; the next tests came from a fresh one.
    assert templates[0] == templates[1] != templates[2] == templates[3]
    result.stdout.fnmatch_lines(["*4 tests isolated in 5 children (4 forked from 2 templates*"])
    result.stdout.fnmatch_lines(
        [
            "*first runs of tests that ran again (spawnrun)*",
            "*test_t.py::test_t[[]1[]] (first run, call)*",
            f"ran again: it {'timed out' if death == 'timeout' else 'crashed'} in a fork*",
        ]
    )
    if death == "timeout":
        # The stacks are the fork's, where the test sleeps, not its template's (in its
        # first run's section), and its spawned child's.
        stacks = [
            line for line in result.stdout.lines if re.search(r"test_t.py.*line.*in test_t", line)
        ]
        assert len(stacks) >= 2, result.stdout.str()


UNSAFE = {
    "device": (
        "import fakedevice\nfakedevice.init()\n"
        "def pytest_spawnrun_device_state(config=None):\n"
        "    return 'fakedevice is initialized' if fakedevice.is_initialized() else None\n",
        "fakedevice is initialized",
    ),
    "thread": (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(300,), daemon=True, name='pool').start()\n",
        "1 other thread(s) run in it (pool, started as unsafe was imported)",
    ),
}


@pytest.mark.parametrize("kind", list(UNSAFE))
def test_unsafe_preload_turns_the_zygote_off(pytester, fakedevice, kind):
    source, reason = UNSAFE[kind]
    pytester.makepyfile(unsafe=source)
    pytester.makeconftest(RECORD_PARENT)
    pytester.makepyfile(test_device=DEVICE_SUITE)
    result = _run_fast(pytester, "--spawn-preload", "unsafe", "-W", "default")
    # The template refuses to fork; every test spawns and passes; one warning says why.
    result.assert_outcomes(passed=3, warnings=1)
    result.stdout.fnmatch_lines([f"*{_forkserver.OFF.format(reason='')}*{reason}*unsafe*"])
    assert not _forked(pytester, 3)


@pytest.mark.parametrize(
    "how, source",
    [
        (("--spawn-preload", "nonexistent_mod"), "command line option --spawn-preload"),
        (("-o", "spawn_preload=json nonexistent_mod"), "ini option 'spawn_preload'"),
    ],
)
def test_a_preload_module_that_cannot_be_imported_is_named(pytester, how, source):
    # A warning, and fast mode goes on: preloading only saves the children an import.
    pytester.makeconftest(RECORD_PARENT)
    pytester.makepyfile(
        test_x="""
        import json, os, pytest

        @pytest.mark.gpu(count=0)
        @pytest.mark.parametrize("x", [1, 2])
        def test_x(x):
            with open(f"where{x}.json", "w") as f:
                json.dump([os.getpid(), os.getppid()], f)
        """
    )
    result = _run_fast(pytester, *how, "-W", "default")
    result.assert_outcomes(passed=2, warnings=1)
    text = _forkserver.NOT_IMPORTED.format(
        module="nonexistent_mod", source=source, error="ModuleNotFoundError(*nonexistent_mod*)"
    )
    result.stdout.fnmatch_lines([f"*{text}*"])
    result.stdout.no_fnmatch_line("*forkserver is off*")
    assert _forked(pytester, 2)


@pytest.mark.parametrize("how", ["collection", "plugin"])
def test_template_leaves_out_a_library_that_starts_a_thread(pytester, monkeypatch, how):
    # Libraries outside the rootdir, imported by the collection or loaded as plugins, are
    # preloaded; one that starts a thread at import is left to the children (so is a
    # plugin module that does), and forking goes on.
    _libraries(
        pytester,
        monkeypatch,
        quietlib="VALUE = 1\n",
        threadlib="import threading, time\n"
        "threading.Thread(target=time.sleep, args=(300,), daemon=True).start()\n",
    )
    pytester.makeconftest(RECORD_PARENT)
    pytester.makepyfile(
        test_libs=f"""
        import json, os, sys
        import pytest
        import quietlib{", threadlib" if how == "collection" else ""}

        @pytest.mark.gpu
        @pytest.mark.parametrize("x", [1, 2])
        def test_x(x):
            with open(f"where{{x}}.json", "w") as f:
                json.dump([os.getpid(), os.getppid()], f)
        """
    )
    plugin = ["-p", "threadlib"] if how == "plugin" else []
    result = _run_fast(pytester, *plugin, "-W", "default")
    if how == "collection":
        result.assert_outcomes(passed=2, warnings=1)
        result.stdout.fnmatch_lines(["*forkserver leaves threadlib out of its template*thread*"])
        # A real location (spawnrun's code, as pytest's own warnings show), never ":0".
        result.stdout.fnmatch_lines(["*spawnrun/launch/_forkserver.py:*: SpawnrunWarning*"])
    else:  # a -p module is rewritten by pytest: never preloaded, so nothing to leave out
        result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*forkserver is off*")
    assert _forked(pytester, 2)


def test_plugins_are_imported_once_rewritten_in_the_template(pytester, monkeypatch):
    # A plugin module outside the rootdir is rewritten by pytest on import. The
    # template imports it rewritten as the parent's pytest marked it, once for all
    # forks: no fork imports it again, its asserts still explain themselves, and no
    # "already imported, cannot be rewritten" warning fails a child under
    # filterwarnings = error.
    libs = pytester.path.parent / f"{pytester.path.name}-plugins"
    libs.mkdir()
    (libs / "myplugin.py").write_text(
        "import os\n"
        "import pytest\n"
        "with open(os.environ['PLUGIN_IMPORTS'], 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        "@pytest.fixture\ndef answer():\n    return 42\n"
        "def check(x):\n    assert x == 42\n"
    )
    imports = pytester.path / "imports.txt"
    monkeypatch.setenv("PLUGIN_IMPORTS", str(imports))
    monkeypatch.setenv("PYTHONPATH", str(libs), prepend=":")
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makeconftest(RECORD_PARENT)
    pytester.makepyfile(
        test_p="""
        import json, os
        import pytest

        @pytest.mark.gpu
        @pytest.mark.parametrize("x", [1, 2])
        def test_x(x, answer):
            assert answer == 42
            with open(f"where{x}.json", "w") as f:
                json.dump([os.getpid(), os.getppid()], f)

        @pytest.mark.gpu
        def test_plugin_assert():
            import myplugin
            myplugin.check(41)
        """
    )
    result = _run_fast(pytester, "-p", "myplugin", "--spawn-template", "library")
    result.assert_outcomes(passed=2, failed=1)
    assert _forked(pytester, 2)
    result.stdout.fnmatch_lines(["E       assert 41 == 42"])  # rewritten
    pids = set(imports.read_text().split())
    parent = (pytester.path / "parent.pid").read_text()
    children = {str(pid) for i in (1, 2) for pid, _ in [json.loads(_where(pytester, i))]}
    assert not pids & children  # no fork imported it
    assert pids - {parent}  # the template did


def test_numpys_blas_pool_does_not_stop_forking(pytester):
    # numpy's OpenBLAS starts a thread per core at import, and parks them when the
    # process forks: a template that preloaded numpy still forks.
    pytester.makeconftest(RECORD_PARENT)
    pytester.makepyfile(
        test_np="""
        import json, os
        import numpy as np
        import pytest

        @pytest.mark.gpu
        @pytest.mark.parametrize("x", [1, 2])
        def test_x(x):
            assert (np.ones((64, 64)) @ np.ones((64, 64)))[0, 0] == 64
            with open(f"where{x}.json", "w") as f:
                json.dump([os.getpid(), os.getppid()], f)
        """
    )
    result = _run_fast(pytester, "--spawn-preload", "numpy", "-W", "default")
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*forkserver is off*")
    assert _forked(pytester, 2)


def test_openmp_at_import_and_executors_in_forked_children(pytester):
    # A test module that runs OpenMP-parallel torch math at import (as e3nn's do) and a
    # test that uses a ProcessPoolExecutor: forked children neither hang on a thread
    # pool that does not exist in them nor leave leaked-semaphore warnings.
    pytester.makepyfile(
        test_omp="""
        import concurrent.futures
        import pytest
        import torch

        A = torch.randn(512, 512)
        A @ A

        @pytest.mark.gpu(timeout=60)
        @pytest.mark.parametrize("i", range(2))
        def test_matmul(i):
            assert (A @ A).shape == (512, 512)

        def square(x):
            return x * x

        @pytest.mark.gpu(timeout=60)
        def test_executor():
            with concurrent.futures.ProcessPoolExecutor(2) as pool:
                assert list(pool.map(square, range(4))) == [0, 1, 4, 9]
        """
    )
    start = time.monotonic()
    result = _run_fast(pytester, "-W", "default")
    result.assert_outcomes(passed=3)
    result.stdout.no_fnmatch_line("*forkserver is off*")
    assert "leaked" not in result.stdout.str() + result.stderr.str()
    assert time.monotonic() - start < 120


@pytest.mark.parametrize("template", ["library", "file"])
def test_forked_children_are_separate_processes_with_own_tmp_path(pytester, template):
    pytester.makepyfile(
        """
        import json, os
        import pytest
        import spawnrun

        @pytest.mark.gpu
        @pytest.mark.parametrize("i", range(3))
        def test_where(i, tmp_path):
            assert spawnrun.is_child()
            assert not (tmp_path / "mark").exists()
            (tmp_path / "mark").write_text(str(i))
            with open(f"where{i}.json", "w") as f:
                json.dump([os.getpid(), os.getppid(), str(tmp_path)], f)
        """
    )
    # One test at a time: all three from one template (the library's, or the file's).
    result = _run_fast(pytester, "--spawn-template", template, "--spawn-jobs", "1")
    result.assert_outcomes(passed=3)
    rows = [json.loads((pytester.path / f"where{i}.json").read_text()) for i in range(3)]
    pids, parents, tmps = zip(*rows, strict=True)
    assert len(set(pids)) == 3 and len(set(tmps)) == 3
    assert len(set(parents)) == 1  # all forked from the one template


def test_s_streams_a_forked_childs_output_live(pytester):
    pytester.makepyfile(
        "import pytest\n@pytest.mark.gpu\ndef test_x():\n    print('LIVE-FROM-THE-CHILD')\n"
    )
    result = _run_fast(pytester, "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*LIVE-FROM-THE-CHILD*"])


def test_what_made_a_template_unsafe_is_left_out_from_the_start_next_time(pytester, monkeypatch):
    # The first run builds the template, finds threadlib unsafe and builds it again
    # without it; pytest's cache keeps that, so the next run's template never imports it.
    _libraries(
        pytester,
        monkeypatch,
        threadlib="import os, threading, time\n"
        "with open(os.environ['IMPORTERS'], 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        "threading.Thread(target=time.sleep, args=(300,), daemon=True).start()\n",
    )
    importers = pytester.path / "importers.txt"
    monkeypatch.setenv("IMPORTERS", str(importers))
    pytester.makepyfile(
        test_libs="""
        import threadlib
        import pytest

        @pytest.mark.gpu
        @pytest.mark.parametrize("x", [1, 2])
        def test_x(x):
            pass
        """
    )
    args = ["--spawn-method", "forkserver", "-W", "default"]
    counts = []
    for run in (1, 2):
        importers.write_text("")
        result = pytester.runpytest_subprocess(*args)
        result.assert_outcomes(passed=2, warnings=1)
        result.stdout.fnmatch_lines(["*forkserver leaves threadlib out of its template*"])
        if run == 2:
            result.stdout.fnmatch_lines(["*an earlier run found this*--cache-clear*"])
        counts.append(len(set(importers.read_text().split())))
    # The parent and both children each time; the first run's first template too.
    assert counts == [4, 3]


def test_libraries_tests_imported_are_preloaded_on_the_next_run(pytester, monkeypatch):
    """A module fixture or test body that imports a library (transformers) paid for that
    import in every child, on every run: the template preloads only what collection
    imported. Now what the tests imported last time is preloaded; one that makes the
    template unsafe is left out as before, and the tests pass either way."""
    record = "import os\nIMPORTED_IN = os.getpid()\n"
    _libraries(
        pytester,
        monkeypatch,
        heavylib=record,
        threadlib=record + "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(300,), daemon=True).start()\n",
    )
    pytester.makepyfile(
        test_libs="""
        import json, os
        import pytest

        @pytest.fixture(scope="module")
        def lib():
            import heavylib, threadlib
            return heavylib, threadlib

        @pytest.mark.gpu
        @pytest.mark.parametrize("x", [1, 2])
        def test_x(x, lib):
            with open(f"where{x}.json", "w") as f:
                json.dump([m.IMPORTED_IN == os.getpid() for m in lib], f)
        """
    )
    seen = []
    for _ in range(2):
        result = pytester.runpytest_subprocess("--spawn-method", "forkserver", "-W", "default")
        result.assert_outcomes(passed=2, warnings=len(seen))  # threadlib left out: a warning
        seen.append([json.loads((pytester.path / f"where{x}.json").read_text()) for x in (1, 2)])
    assert seen[0] == [[True, True], [True, True]]  # each test's own process imported both
    assert seen[1] == [[False, True], [False, True]]  # heavylib came with the template
    preloads = json.loads((pytester.path / ".pytest_cache/v/spawnrun/preloads").read_text())
    assert preloads == ["heavylib", "threadlib"]


@pytest.mark.parametrize("cov", [[], ["--cov=mypkg", "--cov-report="]], ids=["plain", "cov"])
def test_the_projects_own_package_below_the_rootdir_is_preloaded(pytester, cov):
    """timm's, kornia's and vLLM's suites run from their checkout: the package under test
    lies below the rootdir, beside ``tests/``, and the template never preloaded it, so
    each fork imported it again (timm's layer tests on the H200: over 0.5 s per test,
    one after another). Now the project's folders that hold no test file and no conftest
    are preloaded like a library; the suite's own modules (a helper beside the tests)
    still are not, nor is the project where coverage measures children (a fork's
    measurement would miss what ran at import in the template)."""
    record = "import os\nIMPORTED_IN = os.getpid()\n"
    pkg = pytester.mkpydir("mypkg")
    (pkg / "core.py").write_text(record)
    tests = pytester.mkpydir("tests")
    (tests / "helper.py").write_text(record)
    (tests / "conftest.py").write_text("")
    (tests / "test_mine.py").write_text(
        textwrap.dedent(
            """
            import json, os
            import pytest
            import mypkg.core
            from tests import helper

            @pytest.mark.gpu
            @pytest.mark.parametrize("x", [1, 2])
            def test_x(x):
                mine = [m.IMPORTED_IN == os.getpid() for m in (mypkg.core, helper)]
                with open(f"where{x}.json", "w") as f:
                    json.dump(mine, f)
            """
        )
    )
    args = ["-p", "no:cacheprovider", "--spawn-method", "forkserver", "--spawn-template"]
    result = pytester.runpytest_subprocess(*args, "library", *cov)
    result.assert_outcomes(passed=2)
    seen = [json.loads((pytester.path / f"where{x}.json").read_text()) for x in (1, 2)]
    # Each fork imported the helper itself; the package came with the template.
    assert seen == ([[True, True]] * 2 if cov else [[False, True]] * 2)


EXIT_LIB = """
import atexit, os

MARKS = os.environ["EXIT_MARKS"]
atexit.register(lambda: open(os.path.join(MARKS, f"atexit-{os.getpid()}"), "w").close())
"""


def test_the_template_runs_its_exit_work_as_it_leaves(pytester, monkeypatch):
    # The parent's session end waits for the template to exit: like a child, it leaves
    # without the interpreter's teardown of what it imported (~75 ms with torch), but
    # its exit work still runs (atexit: coverage's save, a library's cleanup).
    _libraries(pytester, monkeypatch, exitlib=EXIT_LIB)
    marks = pytester.path / "marks"
    marks.mkdir()
    monkeypatch.setenv("EXIT_MARKS", str(marks))
    pytester.makepyfile(
        "import os, pytest\n"
        "@pytest.mark.gpu\n"
        "def test_x():\n"
        "    open('template.pid', 'w').write(str(os.getppid()))\n"
    )
    result = _run_fast(pytester, "--spawn-preload", "exitlib", "--spawn-template", "library")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*forkserver is off*")
    template = (pytester.path / "template.pid").read_text()
    assert (marks / f"atexit-{template}").exists()


IMPORT_WATCH = """
import os, sys

LOG = os.environ["IMPORT_LOG"]
WATCHED = {"_pytest.junitxml", "_pytest.skipping", "_pytest.debugging", "pdb"}


def _audit(event, args, _open=open, _pid=os.getpid):
    # Raised as the import system loads a module (not for one already imported).
    if event == "import" and args[0] in WATCHED:
        with _open(LOG, "a") as f:
            f.write(f"{_pid()} {args[0]}\\n")


sys.addaudithook(_audit)
"""


def test_forks_find_pytests_own_plugins_imported(pytester, monkeypatch):
    # ``import pytest`` leaves most of its built-in plugins to the configuration: the
    # template imports those the parent's pytest loaded, so no fork's pytest imports
    # them again as it configures.
    _libraries(pytester, monkeypatch, importwatch=IMPORT_WATCH)
    log = pytester.path / "imports.log"
    monkeypatch.setenv("IMPORT_LOG", str(log))
    pytester.makepyfile(
        "import pytest\n@pytest.mark.gpu\n@pytest.mark.parametrize('i', [1, 2])\n"
        "def test_x(i):\n    pass\n"
    )
    result = _run_fast(pytester, "--spawn-preload", "importwatch", "--spawn-template", "library")
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*forkserver is off*")
    assert not log.exists(), log.read_text()


def test_pytests_own_plugins_for_the_template_are_those_the_parent_loaded(pytester):
    config = pytester.parseconfigure("-p", "no:junitxml")
    names = _preloads.pytest_modules(config)
    assert {"_pytest.python", "_pytest.skipping", "_pytest.debugging", "pdb"} <= set(names)
    assert "_pytest.junitxml" not in names


@pytest.mark.parametrize("found", [True, False], ids=["parent-found-cuda", "parent-did-not"])
def test_a_child_answers_is_available_from_the_parents_finding_while_it_collects(pytester, found):
    """A conftest or test module that asks ``torch.cuda.is_available()`` (or
    ``torch.__config__.show()``) while pytest collects initializes the CUDA driver in
    the file's template, which can then fork
    none of its tests (timm's test_layers.py, kornia's conftest). Where the parent's own
    collection found CUDA, a forked child answers it from that finding while it
    collects, for the devices it sees, and torch answers again before any test runs.
    So with the installed packages' metadata, which the library template read once.
    (CI has no CUDA: the parent's finding is set by the inner conftest, and torch's own
    answer is False.)"""
    pytester.makeconftest(
        RECORD_PARENT
        + "from spawnrun.child import _availability\n"
        + f"_availability.in_parent = lambda: {found}\n"
        + "_availability.config_in_parent = lambda: 'the parent says'\n"
    )
    pytester.makepyfile(
        test_x="""
        import json, os
        import pytest
        import importlib.metadata
        import torch
        from torch.cuda import is_available

        AT_COLLECTION = torch.cuda.is_available()
        SHOWN = torch.__config__.show()
        READ_AT_COLLECTION = type(next(iter(importlib.metadata.distributions()))).__name__

        @pytest.mark.gpu
        @pytest.mark.parametrize("x", [1, 2])
        def test_x(x):
            with open(f"where{x}.json", "w") as f:
                json.dump([os.getpid(), os.getppid()], f)
            with open(f"answers{x}.json", "w") as f:
                json.dump([AT_COLLECTION, torch.cuda.is_available(), is_available()], f)
            with open(f"metadata{x}.json", "w") as f:
                read = importlib.metadata.distributions
                json.dump([READ_AT_COLLECTION, read.__module__, read.__qualname__], f)
            with open(f"shown{x}.json", "w") as f:
                json.dump([SHOWN, torch.__config__.show()], f)
        """
    )
    result = _run_fast(pytester, "--spawn-jobs", "1", "--spawn-preload", "torch")
    result.assert_outcomes(passed=2)
    answers = [json.loads((pytester.path / f"answers{x}.json").read_text()) for x in (1, 2)]
    # Then torch's own (no CUDA on this machine), also where held by name.
    assert answers == [[found, False, False]] * 2
    # torch.__config__.show() asks CUDA for a device (PyG reads it at import): the
    # parent's text while collecting, where the parent found CUDA; torch's own after.
    shown = [json.loads((pytester.path / f"shown{x}.json").read_text()) for x in (1, 2)]
    for at_collection, in_test in shown:
        assert in_test != "the parent says" and "PyTorch built with" in in_test
        assert at_collection == ("the parent says" if found else in_test)
    # The installed packages as the template read them once, while configuring and
    # collecting; importlib's own in the test.
    metadata = [json.loads((pytester.path / f"metadata{x}.json").read_text()) for x in (1, 2)]
    assert metadata == [["_Read", "importlib.metadata", "distributions"]] * 2
    assert _forked(pytester, 2)


def test_the_library_template_answers_is_available_as_a_collecting_child_does(
    pytester, monkeypatch
):
    """A library that asks ``torch.cuda.is_available()`` as it is imported (torch's own
    inductor does, torch 2.11) initialized the driver in the library template, and its
    whole package (torch, there) was left out: every test imported it itself. The
    template answers from the parent's finding while it imports, as a collecting child
    does; a test whose devices answer otherwise (none) is spawned, and says why. (CI has
    no CUDA: the parent's finding is set by the inner conftest.)"""
    _libraries(
        pytester,
        monkeypatch,
        seeslib="import torch\nAT_IMPORT = torch.cuda.is_available()\n",
    )
    pytester.makeconftest(
        RECORD_PARENT
        + "from spawnrun.child import _availability\n"
        + "_availability.in_parent = lambda: True\n"
        + "_availability.config_in_parent = lambda: 'the parent says'\n"
    )
    pytester.makepyfile(
        test_x="""
        import importlib, json, os
        import pytest
        import torch

        seeslib = importlib.import_module("seeslib")  # no import line names it

        def _record(name):
            with open(f"{name}.json", "w") as f:
                json.dump([seeslib.AT_IMPORT, torch.cuda.is_available()], f)

        @pytest.mark.gpu
        @pytest.mark.parametrize("x", [1, 2])
        def test_x(x):
            with open(f"where{x}.json", "w") as f:
                json.dump([os.getpid(), os.getppid()], f)
            _record(f"answers{x}")

        @pytest.mark.gpu(count=0)
        def test_sees_none():
            _record("answers0")
        """
    )
    result = _run_fast(
        pytester, "--spawn-jobs", "1", "--spawn-template", "library", "-W", "default"
    )
    result.assert_outcomes(passed=3)
    result.stdout.no_fnmatch_line("*leaves*out of its template*")
    answers = {x: json.loads((pytester.path / f"answers{x}.json").read_text()) for x in (0, 1, 2)}
    # The parent's finding at import, where a device is seen; torch's own in the test.
    assert answers == {0: [False, False], 1: [True, False], 2: [True, False]}
    assert _forked(pytester, 2)
    result.stdout.fnmatch_lines(
        [
            "*1 test spawned, not forked: a module imported in the template asked "
            "torch.cuda.is_available() there*test_x.py::test_sees_none*"
        ]
    )


@pytest.mark.parametrize(
    "visible, sees",
    [(None, True), ("0", True), ("1,0", True), ("GPU-5b1e", True), ("MIG-1a", True),
     ("", False), ("-1", False), ("none", False), ("-1,0", False)],
)  # fmt: skip
def test_is_available_while_collecting_is_the_parents_for_the_devices_seen(visible, sees):
    from spawnrun.child import _availability

    assert _availability.sees_a_device(visible) is sees


@pytest.mark.parametrize(
    "touched, available, expected",
    [
        ("", True, False),  # nobody asked: asking would initialize the driver
        ("driver", True, True),
        ("driver", False, False),
    ],
)
def test_the_parents_finding_is_asked_only_once_the_driver_is_initialized(
    monkeypatch, touched, available, expected
):
    import sys
    import types

    from spawnrun.child import _availability
    from spawnrun.proc import _probe

    asked = []

    def is_available():
        asked.append(1)
        return available

    torch = types.SimpleNamespace(
        cuda=types.SimpleNamespace(is_available=is_available),
        version=types.SimpleNamespace(cuda="12.8"),
    )
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(_availability, "_parent", None)
    monkeypatch.setattr(_probe, "boot_touch", lambda: touched)
    assert _availability.in_parent() is expected
    assert len(asked) == (1 if touched else 0)
    _availability.in_parent()  # known once asked: asked once
    assert len(asked) == (1 if touched else 0)


CONFIGURED_CONFTEST = """
import os, threading, time
import spawnrun

SEEN = os.environ.get("CUDA_VISIBLE_DEVICES")
if spawnrun.is_child() and os.environ.get("START_A_THREAD"):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()


def pytest_configure(config):
    if spawnrun.is_child():
        with open(os.path.join(os.environ["RECORDS"], f"configured-{os.getpid()}"), "w") as f:
            f.write(str(SEEN))
"""

CONFIGURED_TEST = """
import os, time
import pytest
import conftest

@pytest.mark.gpu
def test_{i}(tmp_path):
    time.sleep(0.3)
    print("printed by {i}")
    visible = os.environ["CUDA_VISIBLE_DEVICES"]
    with open(os.path.join(os.environ["RECORDS"], "ran-{i}"), "w") as f:
        f.write(f"{{os.getpid()}} {{tmp_path}} {{conftest.SEEN}} {{visible}}")
    assert {i} != 3, "fails, to show its own output"
"""


@pytest.mark.parametrize("conftest", ["safe", "starts-a-thread"])
def test_a_configured_template_configures_pytest_once_for_tests_of_many_files(
    pytester, monkeypatch, conftest
):
    """Fast mode configures pytest (and imports the conftests) in a template, once per
    environment, and forks each test from it, which collects its own file: each test
    still has its own process, base temp and captured output, and its conftest was
    imported with its own devices. A conftest that leaves the template unsafe to fork
    (a thread) leaves every test to configure pytest for itself, as before."""
    records = pytester.path / "records"
    records.mkdir()
    monkeypatch.setenv("RECORDS", str(records))
    if conftest != "safe":
        monkeypatch.setenv("START_A_THREAD", "1")
    pytester.makeconftest(CONFIGURED_CONFTEST)
    n = 8
    pytester.makepyfile(**{f"test_{i}": CONFIGURED_TEST.format(i=i) for i in range(n)})
    result = _run_fast(pytester, "--spawn-gpus", "0,1", "--spawn-jobs", "2")
    result.assert_outcomes(passed=n - 1, failed=1)
    ran = [(records / f"ran-{i}").read_text().split() for i in range(n)]
    pids, tmps, seen, visible = zip(*ran, strict=True)
    assert len(set(pids)) == n and len(set(tmps)) == n
    assert seen == visible and set(visible) == {"0", "1"}  # its conftest saw its devices
    configured = {int(p.name.split("-")[1]): p.read_text() for p in records.glob("configured-*")}
    assert set(configured.values()) <= {"0", "1"}
    own = {int(p) for p in pids} - set(configured)  # tests that did not configure pytest
    if conftest == "safe":
        assert own and len(configured) < n, configured
    else:
        assert not own, configured
    failure = result.stdout.str().split("Captured stdout call")[1].split("short test summary")[0]
    assert "printed by 3" in failure
    assert not any(f"printed by {i}" in failure for i in range(n) if i != 3)


PRIMED_CONFTEST = """
import os
# Two cores at most, as pytest configures (the CI machine's): the first tests wait for
# the template rather than configuring pytest beside it.
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
"""

PRIMED_TEST = """
import os
import pytest
import a_library

@pytest.mark.gpu(count=0)
def test_{i}():
    with open(os.path.join(os.environ["RECORDS"], "ran-{i}"), "w") as f:
        f.write(str(os.getpid()))
"""


def test_the_first_tests_fork_from_a_template_configured_while_collecting(pytester, monkeypatch):
    """The zygote configures pytest in a template while the parent still collects, for
    tests like the first spawned file's; on few cores the first tests wait for it rather
    than each configuring pytest beside it. Collection's preload of what the zygote has
    imported already (a library the test files import) leaves that template serving."""
    records = pytester.path / "records"
    records.mkdir()
    monkeypatch.setenv("RECORDS", str(records))
    _libraries(pytester, monkeypatch, a_library="VALUE = 1\n")
    pytester.makeconftest(CONFIGURED_CONFTEST + PRIMED_CONFTEST)
    n = 6
    pytester.makepyfile(**{f"test_{i}": PRIMED_TEST.format(i=i) for i in range(n)})
    result = _run_fast(pytester, "--spawn-jobs", "2")
    result.assert_outcomes(passed=n)
    tests = {int((records / f"ran-{i}").read_text()) for i in range(n)}
    configured = {int(p.name.split("-")[1]) for p in records.glob("configured-*")}
    assert len(tests) == n
    assert len(configured) == 1 and not configured & tests, configured


@pytest.mark.parametrize("users", ["", "ACTIVE"], ids=["unset", "the-users"])
def test_the_templates_openmp_waits_passively_unseen_by_tests(pytester, monkeypatch, users):
    """timm's model tests on the H200 (runs 55 and 58): each runs torch's 16 threads, and
    side by side their idle OpenMP threads spun, a second run slower than plain pytest;
    with libgomp's passive waiting it took 0.60x. What the template imports sees
    ``OMP_WAIT_POLICY=PASSIVE`` (libgomp reads it once, as it loads); the tests' own
    environment is as it was. A policy the user set is left as it is."""
    _libraries(
        pytester, monkeypatch, omplib="import os\nSEEN = os.environ.get('OMP_WAIT_POLICY')\n"
    )
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    if users:
        monkeypatch.setenv("OMP_WAIT_POLICY", users)
    else:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    pytester.makepyfile(
        test_omp=f"""
        import os, omplib, pytest

        @pytest.mark.gpu(count=0)
        def test_it():
            assert omplib.SEEN == {users or "PASSIVE"!r}
            assert os.environ.get("OMP_WAIT_POLICY") == {users or None!r}
        """
    )
    result = pytester.runpytest_subprocess(
        "--spawn-method", "forkserver", "--spawn-preload", "omplib", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1)


def test_the_templates_imports_run_without_garbage_collection(pytester, monkeypatch):
    """Each full collection during an import walks every object imported so far (about
    85 ms of the 0.77 s of ``import torch``), on a core the parent's own collection wants
    at that moment. The template imports with the collector off, collects the garbage
    the imports left once (its finalizers run), and freezes the rest; the test's own
    process collects as usual."""
    _libraries(
        pytester,
        monkeypatch,
        gclib="import gc\n"
        "SEEN = []\n"
        "def _seen(phase, info):\n"
        "    if phase == 'start':\n"
        "        SEEN.append(info['generation'])\n"
        "gc.callbacks.append(_seen)\n"
        "FINALIZED = []\n"
        "class Node:\n"
        "    def __init__(self):\n"
        "        self.me = self\n"
        "class Held(Node):\n"
        "    def __del__(self):\n"
        "        FINALIZED.append(True)\n"
        "for _ in range(20000):\n"
        "    Node()\n"
        "Held()\n"
        "gc.callbacks.remove(_seen)\n"
        "ENABLED = gc.isenabled()\n",
    )
    pytester.makepyfile(
        test_gc="""
        import gc, gclib, pytest

        @pytest.mark.gpu(count=0)
        def test_it():
            assert gclib.SEEN == [] and not gclib.ENABLED
            assert gclib.FINALIZED == [True]  # the garbage it left was collected, once
            assert gc.isenabled()
            before = gc.get_count()[0]
            garbage = [[] for _ in range(2000)]
            assert gc.get_count()[0] != before + 2000  # a collection ran meanwhile
        """
    )
    result = pytester.runpytest_subprocess(
        "--spawn-method", "forkserver", "--spawn-preload", "gclib", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1)


#: Each child records how pytest was configured in it.
CONFIGURED_AS = """
import json, os, pytest

def test_{i}(request):
    config = request.config
    names = sorted(
        name for name, _ in config.pluginmanager.list_name_plugin()
        if name and not any(c.isdigit() for c in name)
    )
    seen = {{
        "args": list(config.invocation_params.args),
        "dir": str(config.invocation_params.dir),
        "plugins": config.invocation_params.plugins,
        "blocked": config.pluginmanager.is_blocked("doctest"),
        "registered": names,
        "verbose": config.option.verbose,
    }}
    with open(os.path.join({where!r}, "configured{i}.json"), "w") as f:
        json.dump(seen, f)
"""


def test_a_fork_that_configures_pytest_configures_it_as_a_spawned_child_does(pytester):
    """A fork of the library template configures pytest itself, from the part the
    template made ahead (``_child.prebuild``): it must read as a spawned child's own
    ``Config.fromdictargs``: its invocation arguments and directory, ``-p no:`` plugins
    blocked, the same plugins registered."""
    where = str(pytester.path)
    for i in range(2):
        pytester.makepyfile(**{f"test_c{i}": CONFIGURED_AS.format(i=i, where=where)})
    runs = {}
    for method in ("spawn", "forkserver"):
        args = ["-p", "no:doctest", "-v", "--spawn-gpu", "--spawn-method", method]
        if method == "forkserver":
            args += ["--spawn-template", "library"]
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
        result.assert_outcomes(passed=2)
        runs[method] = [
            json.loads((pytester.path / f"configured{i}.json").read_text()) for i in range(2)
        ]
    assert runs["forkserver"] == runs["spawn"]
    first = runs["spawn"][0]
    assert first["blocked"] and first["verbose"] == 1
    assert first["args"][-1].endswith("test_c0.py")


def test_a_file_split_over_templates_that_refuse_is_named_once(pytester, fakedevice):
    """Budgeted tests of a file fork from as many templates as run at once; where each
    of them refuses, the summary names the file once (it said it once per template)."""
    hook = (
        "def pytest_spawnrun_device_state(config=None):\n"
        "    return 'fakedevice is initialized' if fakedevice.is_initialized() else None\n"
    )
    pytester.makeconftest("import fakedevice\nfakedevice.init()\n" + hook)
    pytester.makepyfile(
        test_many="import pytest\n"
        "@pytest.mark.parametrize('x', range(6))\n"
        "def test_budgeted(x):\n    pass\n"
    )
    result = _run_fast(
        pytester, "--spawn-gpu", "--spawn-memory", "1GiB", "--spawn-gpu-memory", "80GiB",
        "--spawn-jobs", "3",
    )  # fmt: skip
    result.assert_outcomes(passed=6)
    said = [line for line in result.stdout.lines if _reports.NOT_A_TEMPLATE in line]
    assert said == [f"test_many.py: {_reports.NOT_A_TEMPLATE}: fakedevice is initialized"]


TURNS_FILE = """
import json, os, pytest

def test_0_sets_the_turn():
    os.environ["TURN"] = "first"

@pytest.mark.gpu(count=0)
@pytest.mark.parametrize("i", range(3))
def test_1_forked(request, i):
    group = "a" if request.node.name.startswith("test_1") else "b"
    with open(os.environ["SEEN"], "a") as f:
        f.write(json.dumps([group, i, os.environ.get("TURN"), os.getpid(), os.getppid()]) + "\\n")

def test_2_changes_it():
    os.environ["TURN"] = "second"

test_3_forked = test_1_forked  # the same test, after the turn changed
"""


def test_a_test_forked_ahead_sees_the_environment_at_its_turn(pytester, monkeypatch):
    # Each test after a template's first is forked while the one before runs (a spare):
    # the parent's environment as it is at the test's turn still reaches it.
    pytester.makepyfile(test_turns=TURNS_FILE)
    seen = pytester.path / "seen.jsonl"
    monkeypatch.setenv("SEEN", str(seen))
    result = _run_fast(pytester, "--spawn-jobs", "1")
    result.assert_outcomes(passed=8)
    result.stdout.fnmatch_lines(["*6 forked from 1 template that collected their file*"])
    rows = [json.loads(line) for line in seen.read_text().splitlines()]
    assert (
        sorted((group, turn) for group, _, turn, _, _ in rows)
        == [("a", "first")] * 3 + [("b", "second")] * 3
    )
    assert len({pid for *_, pid, _ in rows}) == 6
    assert len({ppid for *_, ppid in rows}) == 1
    # Nothing is left of a spare forked for a test that never came.
    result.stdout.no_fnmatch_line("*leaked*")


SPARE_KILLER = """
import os, signal, time, pytest

def _siblings():
    parent = os.getppid()
    with open(f"/proc/{parent}/task/{parent}/children") as f:
        return [int(p) for p in f.read().split() if int(p) != os.getpid()]

@pytest.mark.gpu(count=0)
@pytest.mark.parametrize("i", range(3))
def test_x(i):
    if i == 0:
        deadline = time.monotonic() + 10
        while not _siblings() and time.monotonic() < deadline:
            time.sleep(0.01)  # the next test's spare is being forked
        assert _siblings(), "no process was forked ahead"
        for pid in _siblings():
            os.kill(pid, signal.SIGKILL)
"""


def test_a_spare_that_ends_before_its_test_comes_is_replaced(pytester):
    # The process forked ahead for the next test is killed: that test forks afresh.
    pytester.makepyfile(test_spare=SPARE_KILLER)
    result = _run_fast(pytester, "--spawn-jobs", "1")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*3 forked from 1 template that collected their file*"])
    result.stdout.no_fnmatch_line("*crash*")


SHARE_FILE = """
import json, os, pytest

@pytest.mark.gpu(count=0)
@pytest.mark.parametrize("i", range({n}))
def test_share(i):
    with open(os.environ["SEEN"], "a") as f:
        f.write(json.dumps([__name__, os.getppid()]) + "\\n")
"""


@pytest.mark.parametrize("files", [1, 2])
def test_a_files_template_is_split_only_beyond_a_jobs_share(pytester, monkeypatch, files):
    # Two jobs: one file of eight tests is split over two templates (each collects it);
    # two files of four each keep a template each, which run side by side.
    for k in range(files):
        pytester.makepyfile(**{f"test_share{k}": SHARE_FILE.format(n=8 // files)})
    seen = pytester.path / "seen.jsonl"
    monkeypatch.setenv("SEEN", str(seen))
    result = _run_fast(pytester, "--spawn-jobs", "2")
    result.assert_outcomes(passed=8)
    result.stdout.fnmatch_lines(["*8 forked from 2 templates that collected their file*"])
    templates: dict[str, set[int]] = {}
    for module, ppid in (json.loads(line) for line in seen.read_text().splitlines()):
        templates.setdefault(module, set()).add(ppid)
    assert {module: len(ppids) for module, ppids in templates.items()} == (
        {"test_share0": 2} if files == 1 else {"test_share0": 1, "test_share1": 1}
    )
