"""Installing spawnrun next to a project's own names: options, the marker, pytest-forked's."""

from __future__ import annotations

import pytest

NO_INTERNAL = "*INTERNALERROR*"


def test_project_option_named_gpus_does_not_conflict(pytester):
    # A project that had its own --gpus before installing spawnrun keeps it.
    pytester.makeconftest(
        """
        def pytest_addoption(parser):
            parser.addoption("--gpus", action="store", default="none")
        """
    )
    pytester.makepyfile(
        """
        import pytest, spawnrun

        @pytest.mark.gpu
        def test_spawned(request):
            assert spawnrun.is_child()
            assert request.config.getoption("--gpus") == "a100"

        def test_in_process(request):
            assert request.config.getoption("--gpus") == "a100"
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--gpus", "a100", "--spawn-gpus", "0,1"
    )
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line(NO_INTERNAL)


def test_every_option_has_the_prefix(pytester):
    result = pytester.runpytest_subprocess("--help")
    text = result.stdout.str()
    section = text[text.index("run tests in fresh spawn children") :].split("\n\n")[0]
    options = [w.rstrip(",=") for w in section.split() if w.startswith("--")]
    assert options  # the section was found
    assert all(o.startswith(("--spawn-", "--no-spawn")) for o in options), options


PROJECT_GPU_MARKER = """
import pytest, spawnrun

@pytest.mark.gpu("a100", memory=80)
def test_project_marker(request):
    # The project's own marker, untouched: arguments as written, no child.
    mark = request.node.get_closest_marker("gpu")
    assert mark.args == ("a100",) and mark.kwargs == {"memory": 80}
    assert not spawnrun.is_child()

@pytest.mark.isolated
def test_spawn_marker():
    assert spawnrun.is_child()

@pytest.mark.isolated(count=0)
@pytest.mark.gpu("h100")
def test_both():
    assert spawnrun.is_child()
"""


def test_project_gpu_marker_with_another_spawn_marker(pytester):
    pytester.makeini(
        """
        [pytest]
        spawn_marker = isolated
        markers =
            gpu(kind, memory=None): the project's own GPU marker
        """
    )
    pytester.makepyfile(PROJECT_GPU_MARKER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers", "-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["spawnrun: tests marked isolated run in a fresh spawn child*"])
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    markers = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--markers").stdout
    markers.fnmatch_lines(
        [
            "@pytest.mark.isolated(count=1, memory=None, exclusive=False, timeout=None, "
            "scope='test', group=None): run*"
        ]
    )
    markers.no_fnmatch_line("*gpu(count=*")


@pytest.mark.parametrize("where", ["env", "cli"])
def test_spawn_marker_from_environment_or_command_line(pytester, monkeypatch, where):
    args = ["-p", "no:cacheprovider", "--strict-markers"]
    if where == "env":
        monkeypatch.setenv("SPAWNRUN_MARKER", "isolated")
    else:
        args += ["--spawn-marker", "isolated"]
    # --strict-markers: spawnrun's isolated must be registered, in the child too.
    pytester.makeconftest(
        """
        def pytest_configure(config):
            config.addinivalue_line("markers", "gpu(kind): the project's own")
        """
    )
    pytester.makepyfile(PROJECT_GPU_MARKER)
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=3)


def test_project_gpu_marker_with_default_name_hints_at_spawn_marker(pytester):
    pytester.makepyfile(PROJECT_GPU_MARKER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: *test_project_marker*keyword arguments only*set spawn_marker*"]
    )


@pytest.mark.parametrize(
    "where, value, expected",
    [
        ("ini", "not-a-name", "ini option 'spawn_marker': *'not-a-name'*"),
        ("env", "skipif", "environment variable SPAWNRUN_MARKER: *'skipif'*"),
    ],
)
def test_bad_spawn_marker_is_a_usage_error(pytester, monkeypatch, where, value, expected):
    if where == "ini":
        pytester.makeini(f"[pytest]\nspawn_marker = {value}\n")
    else:
        monkeypatch.setenv("SPAWNRUN_MARKER", value)
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {expected}"])


FORKED_SUITE = """
import os, pytest, spawnrun

@pytest.mark.forked
def test_forked():
    assert spawnrun.is_child() is ISOLATED
    if ISOLATED:  # as gpu(count=0): isolated, no device
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
"""


def test_forked_marker_spawns_without_pytest_forked(pytester):
    pytester.makepyfile(FORKED_SUITE.replace("ISOLATED", "True"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=1)
    markers = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--markers").stdout
    markers.fnmatch_lines(["@pytest.mark.forked: *spawnrun*"])


MIGRATING_SUITE = """
import os, pytest, spawnrun

@pytest.mark.forked
def test_was_forked():
    assert spawnrun.is_child()

def test_plain():
    assert spawnrun.is_child()
"""


def test_forked_marker_with_spawn_gpu_and_a_module_scope_is_no_usage_error(pytester):
    """The migration path from pytest-forked: under --spawn-gpu every test is spawned,
    so ``forked`` stands in for nothing and its tests share the module's child with the
    unmarked ones (it was a usage error: "0, alone against every GPU, alone", even with
    no GPU at all)."""
    pytester.makepyfile(MIGRATING_SUITE)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-gpu", "--spawn-scope", "module", "--spawn-gpus", "none"
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*2 tests isolated in 1 child*"])


def test_forked_marker_is_left_to_pytest_forked(pytester):
    # Stands in for pytest-forked (same plugin name): its marker stays its own.
    pytester.makepyfile(
        pytest_forked="""
        def pytest_configure(config):
            config.addinivalue_line("markers", "forked: the stand-in's own")
        """
    )
    pytester.makepyfile(FORKED_SUITE.replace("ISOLATED", "False"))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "pytest_forked", "--strict-markers"
    )
    result.assert_outcomes(passed=1)
