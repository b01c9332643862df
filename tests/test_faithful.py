"""Fast mode is faithful: a forked test observes what a spawned one observes.

The differential oracle: generated suites (``faithful_suites``) record what each test
sees at configure, collection, import and run time; each runs plainly (outcomes only),
spawned, in fast mode twice (the second with the first's cache, after the spawned run
wrote its own), and with ``--spawn-scope module`` both ways. Every test's observations
in fast mode must equal the spawned run's, first and second run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import faithful_suites
import pytest

#: Suites run in CI; ``SPAWNRUN_ORACLE_SEEDS=0-40`` runs more (a range or a list).
SEEDS = os.environ.get("SPAWNRUN_ORACLE_SEEDS", "1,2,3")


def _seeds(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",") if s]


def _run(
    pytester: pytest.Pytester, out: Path, name: str, *args: str
) -> tuple[pytest.RunResult, dict[str, dict[str, object]]]:
    path = out / f"{name}.jsonl"
    os.environ["ORACLE_OUT"] = str(path)
    result = pytester.runpytest_subprocess("--spawn-gpus", "2", "-p", "no:randomly", *args)
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    return result, faithful_suites.observations(path)


def _outcomes(result: pytest.RunResult) -> dict[str, int]:
    kept = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")
    return {k: v for k, v in result.parseoutcomes().items() if k in kept}


@pytest.mark.parametrize("seed", _seeds(SEEDS))
def test_fast_mode_observes_what_a_spawned_child_observes(
    pytester: pytest.Pytester,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
) -> None:
    site = tmp_path_factory.mktemp("site")
    out = tmp_path_factory.mktemp("observed")
    shape = faithful_suites.write(pytester.path, site, seed)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site)])))
    monkeypatch.setenv("ORACLE_OUTER", "outer")
    monkeypatch.setenv("ORACLE_OUT", "")
    plain, _ = _run(pytester, out, "plain", "--no-spawn")
    reference = _plain_process(pytester, out)
    outcomes = _outcomes(plain)
    assert outcomes.get("passed") and set(outcomes) == {"passed"}, shape
    fast = ("--spawn-method", "forkserver")
    modes = {
        "spawned": (),
        "fast, first run": fast,
        "fast, second run": fast,
    }
    seen = {}
    for name, args in modes.items():
        result, seen[name] = _run(pytester, out, name.replace(" ", "_"), *args)
        assert _outcomes(result) == outcomes, (name, shape, result.stdout.str())
    module = ("--spawn-scope", "module")
    _, seen["spawned, module scope"] = _run(pytester, out, "module", *module)
    _, seen["fast, module scope"] = _run(pytester, out, "fast_module", *module, *fast)
    assert len(seen["spawned"]) == outcomes["passed"], shape
    for name in ("fast, first run", "fast, second run"):
        differ = _differences(seen["spawned"], seen[name])
        assert not differ, f"{name}: {shape}: {_short(differ)}"
    differ = _differences(seen["spawned, module scope"], seen["fast, module scope"])
    assert not differ, f"module scope: {shape}: {differ}"
    for name, observed in seen.items():
        forked = name.startswith("fast")
        differ = _process_differences(reference, observed, forked)
        assert not differ, f"{name}, against plain pytest's process: {shape}: {_short(differ)}"


def _forkless(seen: dict[str, object]) -> dict[str, object]:
    """What a test saw, less what a fork may see otherwise by design."""
    process = seen.get("process")
    if not isinstance(process, dict):
        return seen
    kept = {k: v for k, v in process.items() if k not in faithful_suites.FORK_DIFFERENCES}
    return {**seen, "process": kept}


def _short(differ: dict[str, object]) -> dict[str, object]:
    """Differences of the process observations, by key only where they differ."""
    out: dict[str, object] = {}
    for nodeid, seen in differ.items():
        if isinstance(seen, dict) and "process" in seen:
            before, after = seen["process"]
            seen = {
                **seen,
                "process": {
                    k: (before.get(k), after.get(k))
                    for k in before
                    if before.get(k) != after.get(k)
                },
            }
        out[nodeid] = seen
    return out


def _plain_process(pytester: pytest.Pytester, out: Path) -> dict[str, object]:
    """What plain pytest's process looks like to a test (spawnrun not loaded)."""
    path = out / "plain_process.jsonl"
    os.environ["ORACLE_OUT"] = str(path)
    result = pytester.runpytest_subprocess("-p", "no:spawnrun", "-p", "no:randomly")
    assert result.ret == 0, result.stdout.str()
    first = next(iter(faithful_suites.observations(path).values()))
    process = first["process"]
    assert isinstance(process, dict)
    return process


def _process_differences(
    reference: dict[str, object], observed: dict[str, dict[str, object]], forked: bool
) -> dict[str, object]:
    """Per node id, what a test saw of its process otherwise than plain pytest's test."""
    out: dict[str, object] = {}
    ignored = faithful_suites.PROCESS_DIFFERENCES
    if forked:
        ignored |= faithful_suites.FORK_DIFFERENCES
    for nodeid, seen in sorted(observed.items()):
        process = seen["process"]
        assert isinstance(process, dict)
        differ = {
            k: (reference.get(k), process.get(k))
            for k in sorted(reference.keys() | process.keys())
            if k not in ignored and reference.get(k) != process.get(k)
        }
        if differ:
            out[nodeid] = differ
    return out


def _differences(
    spawned: dict[str, dict[str, object]], fast: dict[str, dict[str, object]]
) -> dict[str, object]:
    """Per node id, what fast mode saw otherwise: {key: (spawned, fast)}."""
    out: dict[str, object] = {}
    for nodeid in sorted(spawned.keys() | fast.keys()):
        if nodeid not in spawned or nodeid not in fast:
            out[nodeid] = "recorded in one run only"
            continue
        before, after = _forkless(spawned[nodeid]), _forkless(fast[nodeid])
        differ = {
            k: (before.get(k), after.get(k))
            for k in sorted(before.keys() | after.keys())
            if before.get(k) != after.get(k)
        }
        if differ:
            out[nodeid] = differ
    return out


FAST = ("--spawn-method", "forkserver", "-p", "no:randomly")


@pytest.mark.parametrize("scope", ["test", "module"])
def test_ids_drawn_from_a_stream_seeded_at_configure_are_found_in_forks(
    pytester: pytest.Pytester, scope: str
) -> None:
    """Each fork sees ``random`` as seeded at configure and drawn by collection, as a
    spawned child does (CPython reseeds it in every fork)."""
    pytester.makeconftest("import random\ndef pytest_configure(config):\n    random.seed(1234)\n")
    test = (
        "import random, pytest\n"
        "VALUES = [random.randint(0, 10**6) for _ in range(3)]\n"
        "@pytest.mark.gpu(count=0)\n"
        "@pytest.mark.parametrize('v', VALUES)\n"
        "def test_x(v):\n"
        "    assert v >= 0\n"
    )
    pytester.makepyfile(test_f1=test, test_f2=test, test_f3=test)
    for _ in range(2):
        result = pytester.runpytest_subprocess(*FAST, "--spawn-scope", scope)
        result.assert_outcomes(passed=9)
        result.stdout.no_fnmatch_line("*could not find*")
        result.stdout.no_fnmatch_line("*INTERNALERROR*")


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded-at-configure"])
def test_numpy_and_torch_draw_in_each_fork_what_a_spawned_child_would(
    pytester: pytest.Pytester, seeded: bool
) -> None:
    """numpy's global generator, and torch's default one where its build seeds it from
    entropy, draw other values in every fresh process: each fork draws its own too
    (before, every fork of a template drew the template's). Seeded at configure, each
    fork draws exactly what a spawned child draws."""
    # Not imported here: pytester forgets what a test imported, and numpy's extension
    # cannot load twice in one process.
    probe = subprocess.run(
        [sys.executable, "-c", "import numpy, torch; print(torch.initial_seed())"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode:
        pytest.skip("needs numpy and torch")
    if not seeded and int(probe.stdout) == 67280421310721:
        pytest.skip("this torch build starts every process from one fixed seed")
    if seeded:
        pytester.makeconftest(
            "import numpy, torch\n"
            "def pytest_configure(config):\n"
            "    numpy.random.seed(7)\n    torch.manual_seed(7)\n"
        )
    pytester.makepyfile(
        test_draws=(
            "import json, os, numpy, pytest, torch\n"
            "@pytest.mark.gpu(count=0)\n"
            "@pytest.mark.parametrize('i', range(4))\n"
            "def test_draw(i):\n"
            "    with open(os.environ['DRAWS'], 'a') as f:\n"
            "        f.write(json.dumps([i, numpy.random.rand(), torch.rand(1).item()]) + '\\n')\n"
        )
    )
    draws = {}
    for how in ("spawn", "forkserver"):
        path = pytester.path / f"{how}.jsonl"
        os.environ["DRAWS"] = str(path)
        try:
            result = pytester.runpytest_subprocess("--spawn-method", how, "-p", "no:randomly")
        finally:
            del os.environ["DRAWS"]
        result.assert_outcomes(passed=4)
        if how == "forkserver":
            result.stdout.fnmatch_lines(["*4 forked from*"])
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        draws[how] = {i: (a, b) for i, a, b in rows}
    for how, seen in draws.items():
        numpy_values = {a for a, _ in seen.values()}
        torch_values = {b for _, b in seen.values()}
        if seeded:  # every process starts from the same seeded state
            assert len(numpy_values) == len(torch_values) == 1, (how, seen)
        else:
            assert len(numpy_values) == len(torch_values) == 4, (how, seen)
    if seeded:
        assert draws["forkserver"] == draws["spawn"]


@pytest.mark.parametrize("where", ["project-package", "library-under-outer-mask"])
def test_a_package_that_reads_the_device_mask_at_import_sees_the_tests_own(
    pytester: pytest.Pytester,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """A package the template imported (the project's own, preloaded; a library the
    test file imports, under an outer ``CUDA_VISIBLE_DEVICES=0,1``) read another mask
    there than its test has: its tests are spawned, and the next run's template leaves it
    out (its forks import it)."""
    reader = "import os\nMASK = os.environ.get('CUDA_VISIBLE_DEVICES')\n"
    args: tuple[str, ...] = FAST
    if where == "project-package":
        pytester.makeini("[pytest]\npythonpath = .\n")
        pytester.mkpydir("proj").joinpath("__init__.py").write_text(reader)
        tests = pytester.mkdir("tests")
        args += ("--spawn-gpus", "2")
    else:
        site = tmp_path_factory.mktemp("site")
        (site / "proj").mkdir()
        (site / "proj" / "__init__.py").write_text(reader)
        monkeypatch.setenv("PYTHONPATH", str(site))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
        tests = pytester.path
    tests.joinpath("test_mask.py").write_text(
        "import os, pytest\nimport proj\n"
        "@pytest.mark.gpu\n@pytest.mark.parametrize('i', range(4))\n"
        "def test_mask(i):\n    assert proj.MASK == os.environ['CUDA_VISIBLE_DEVICES']\n"
    )
    first = pytester.runpytest_subprocess(*args)
    first.assert_outcomes(passed=4)
    first.stdout.fnmatch_lines(["*spawned, not forked: proj read CUDA_VISIBLE_DEVICES at import*"])
    second = pytester.runpytest_subprocess(*args)
    second.assert_outcomes(passed=4, warnings=1)
    second.stdout.fnmatch_lines(["*forkserver leaves proj out of its template*"])
    second.stdout.no_fnmatch_line("*spawned, not forked*")


def test_a_learned_preload_that_reads_what_a_fixture_sets_runs_again_spawned(
    pytester: pytest.Pytester,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A library a test imports after its fixture set a variable is preloaded from the
    second run on, without the variable: the fork's outcome is in doubt, the test runs
    again spawned (that outcome counts) and is not forked on the next run."""
    site = tmp_path_factory.mktemp("site")
    (site / "readsflag").mkdir()
    (site / "readsflag" / "__init__.py").write_text(
        "import os\nFLAG = os.environ.get('READS_FLAG')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(site))
    pytester.makepyfile(
        "import pytest\n"
        "@pytest.fixture\n"
        "def flag(monkeypatch):\n    monkeypatch.setenv('READS_FLAG', 'on')\n"
        "@pytest.mark.gpu(count=0)\n"
        "def test_flag(flag):\n"
        "    import readsflag\n    assert readsflag.FLAG == 'on'\n"
    )
    pytester.runpytest_subprocess(*FAST).assert_outcomes(passed=1)
    second = pytester.runpytest_subprocess(*FAST)
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines(
        [
            "*1 test ran again in a fresh spawned child after a fork*",
            "*the fork changed the outcome of 1: *test_flag",
            "*test_flag: READS_FLAG was set to 'on' in its process*; first run: call: "
            "AssertionError*; then passed",
        ]
    )
    third = pytester.runpytest_subprocess(*FAST)
    third.assert_outcomes(passed=1)
    third.stdout.no_fnmatch_line("*ran again*")


@pytest.mark.parametrize("case", ["sets-its-default", "read-before-the-fixture"])
def test_what_a_spawned_child_reads_alike_keeps_the_test_forked(
    pytester: pytest.Pytester,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    """Reads that a spawned child makes alike do not unfork a test: a library that sets
    a variable it read unset to its default at import (torch's inductor does it with
    ``TORCHINDUCTOR_CACHE_DIR``, and the parent's own import of it set it too), and a
    library the test file imports, read before the fixture sets the variable (its
    spawned child imports it while collecting, before the fixture, too)."""
    site = tmp_path_factory.mktemp("site")
    (site / "envlib").mkdir()
    (site / "envlib" / "__init__.py").write_text(
        "import os\n"
        "SEEN = os.environ.get('ENVLIB_DIR')\n"
        "if SEEN is None:\n    os.environ['ENVLIB_DIR'] = '/default'\n"
        "FLAG = os.environ.get('ENVLIB_FLAG')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.delenv("ENVLIB_DIR", raising=False)
    monkeypatch.delenv("ENVLIB_FLAG", raising=False)
    if case == "sets-its-default":
        # The parent's collection imports it too and so has '/default', which each
        # test's child inherits, where the template read it unset.
        test = "def test_reads():\n    assert os.environ['ENVLIB_DIR'] == '/default'\n"
    else:
        test = "def test_reads(flag):\n    assert envlib.FLAG is None\n"
    pytester.makepyfile(
        "import os\nimport pytest\nimport envlib\n"
        "@pytest.fixture\n"
        "def flag(monkeypatch):\n    monkeypatch.setenv('ENVLIB_FLAG', 'on')\n"
        "@pytest.mark.gpu(count=0)\n" + test
    )
    result = pytester.runpytest_subprocess(*FAST)
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*spawned, not forked*")
    result.stdout.no_fnmatch_line("*ran again*")


def test_a_failure_a_spawned_child_had_too_is_not_confirmed_again(
    pytester: pytest.Pytester,
) -> None:
    """A forked test's failure with no sign the fork was to blame counts once (issue 56:
    no second run); the next run spawns it. Where it fails spawned as it failed forked,
    the fork was not to blame: the run after forks it again and trusts that failure.
    Another failure (a message that changed) keeps it spawned; a changed file forgets
    every record."""
    tests = (
        "import pathlib, pytest\n"
        "pytestmark = pytest.mark.gpu(count=0)\n"
        "def test_passes():\n    pass\n"
        "def test_always():\n    assert 0, 'always'\n"
        "def test_varies():\n"
        "    assert 0, pathlib.Path(__file__).with_name('word').read_text()\n"
    )
    pytester.makepyfile(test_known=tests)
    word = pytester.path / "word"
    word.write_text("one")
    first = pytester.runpytest_subprocess(*FAST)
    first.assert_outcomes(passed=1, failed=2)
    first.stdout.fnmatch_lines(
        ["*test_always: it failed in a fork of a template (failed forked, counted)"]
    )
    first.stdout.no_fnmatch_line("*ran again*")
    word.write_text("two")
    second = pytester.runpytest_subprocess(*FAST)  # both spawned
    second.assert_outcomes(passed=1, failed=2)
    second.stdout.no_fnmatch_line("*in a fork*")
    third = pytester.runpytest_subprocess(*FAST)
    third.assert_outcomes(passed=1, failed=2)
    third.stdout.fnmatch_lines(
        [
            "*1 test failed in a fork as it failed spawned in an earlier run*"
            "(the fork's report counts, not run again): test_known.py::test_always",
        ]
    )
    third.stdout.no_fnmatch_line("*ran again*")
    pytester.makepyfile(test_known=tests.replace("'always'", "'changed'"))
    fourth = pytester.runpytest_subprocess(*FAST)
    fourth.assert_outcomes(passed=1, failed=2)
    fourth.stdout.no_fnmatch_line("*failed spawned in an earlier run*")
    fourth.stdout.fnmatch_lines(["*2 forked tests ended where the fork may have changed*"])


def test_a_forked_test_that_fails_counts_once_and_the_next_run_spawns_it(
    pytester: pytest.Pytester,
) -> None:
    """Its failure counts once, from its fork (an assertion of its own points at no
    guess); the summary says so, and the next run spawns it."""
    pytester.makepyfile(
        "import pytest\n@pytest.mark.gpu(count=0)\ndef test_fails():\n    assert 0\n"
    )
    result = pytester.runpytest_subprocess(*FAST)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*test_fails: it failed in a fork of a template (failed forked, counted)"]
    )
    result.stdout.no_fnmatch_line("*RERUN*")
    again = pytester.runpytest_subprocess(*FAST)
    again.assert_outcomes(failed=1)
    again.stdout.fnmatch_lines(["*1 test isolated in 1 child;*"])  # spawned, not forked


@pytest.mark.parametrize(
    "mode",
    [("--spawn-gpu",), ("--spawn-gpu", *FAST), ("--spawn-gpu", "--spawn-scope", "module", *FAST)],
    ids=["spawned", "fast", "fast-module"],
)
def test_a_child_is_a_fresh_interpreter_to_multiprocessing_and_random(
    pytester: pytest.Pytester, mode: tuple[str, ...]
) -> None:
    """Below pytest, a child is what ``python -m pytest`` is: a conftest may choose the
    start method (the spawn had forced one: "context has already been set"); a test's
    default-method child may run a closure (it failed to pickle); a conftest that
    reseeds ``random`` from the system's entropy gives each fork draws of its own (every
    fork drew the template's)."""
    pytester.makeconftest(
        "import multiprocessing, random\n"
        "random.seed()\n"
        "def pytest_configure(config):\n"
        "    config.chose = multiprocessing.get_start_method(allow_none=True)\n"
    )
    pytester.makepyfile(
        test_mp=(
            "import multiprocessing, os, random, pytest\n"
            "def test_nothing_chosen(pytestconfig):\n"
            "    assert pytestconfig.chose is None\n"
            "    assert multiprocessing.current_process().name == 'MainProcess'\n"
            "    assert multiprocessing.parent_process() is None\n"
            "def test_a_closure_in_a_default_child():\n"
            "    queue = multiprocessing.Queue()\n"
            "    child = multiprocessing.Process(target=lambda: queue.put(os.getpid()))\n"
            "    child.start()\n"
            "    assert queue.get(timeout=30) == child.pid\n"
            "    child.join()\n"
            "@pytest.mark.parametrize('i', range(4))\n"
            "def test_draw(i):\n"
            "    with open('draws.txt', 'a') as out:\n"
            "        out.write(f'{random.random()}\\n')\n"
        )
    )
    result = pytester.runpytest_subprocess(*mode, "-p", "no:randomly")
    result.assert_outcomes(passed=6)
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    draws = (pytester.path / "draws.txt").read_text().split()
    assert len(set(draws)) == 4, draws


@pytest.mark.parametrize("exported", [False, True], ids=["unset", "exported"])
def test_a_library_default_put_back_by_patch_dict_is_no_change(
    pytester: pytest.Pytester,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    exported: bool,
) -> None:
    """peft (issue 56): scikit-learn's import does ``os.environ.setdefault(
    "KMP_DUPLICATE_LIB_OK", "True")``; learned as a preload, the template's import read it
    and set it. A test wrapped in ``mock.patch.dict(os.environ, ...)`` puts every variable
    back on exit (it empties the environment, then writes each again): each such fork was
    in doubt and every second run ran each test twice. Putting a value back is no change,
    nor is the library's own default; the tests run forked, once, in three runs."""
    site = tmp_path_factory.mktemp("site")
    (site / "setdefaultlib").mkdir()
    (site / "setdefaultlib" / "__init__.py").write_text(
        "import os\nos.environ.setdefault('SDL_DUPLICATE_OK', 'True')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(site))
    if exported:
        monkeypatch.setenv("SDL_DUPLICATE_OK", "True")
    else:
        monkeypatch.delenv("SDL_DUPLICATE_OK", raising=False)
    body = "    import setdefaultlib\n    assert os.environ['SDL_DUPLICATE_OK'] == 'True'\n"
    pytester.makepyfile(
        test_plain="import os\n\ndef test_plain():\n" + body,
        test_patched=(
            "import os\nfrom unittest import mock\n\n"
            "def test_patched():\n"
            "    with mock.patch.dict(os.environ, {'OTHER_VAR': '1'}):\n"
            "    " + body.replace("\n    ", "\n        ")
        ),
    )
    for _ in range(3):
        result = pytester.runpytest_subprocess("--spawn-gpu", *FAST)
        result.assert_outcomes(passed=2)
        result.stdout.no_fnmatch_line("*ran again*")
        result.stdout.no_fnmatch_line("*in doubt*")
        result.stdout.no_fnmatch_line("*RERUN*")
        result.stdout.fnmatch_lines(["*2 tests isolated in 2 children*"])
