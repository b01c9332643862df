"""Children keep compiled bytecode where the environment forbids writing it (``_bytecode``)."""

from __future__ import annotations

import json
import py_compile

import pytest

SUITE = """
import json, os, sys
import slowlib

import pytest

@pytest.mark.gpu(count=0)
@pytest.mark.parametrize("i", range(2))
def test_flags(i):
    seen = {
        "dont_write": sys.dont_write_bytecode,
        "prefix": sys.pycache_prefix,
        "env": sorted(k for k in os.environ if "PYCACHE" in k),
        "answer": slowlib.ANSWER,
    }
    with open(os.environ["SEEN"], "a") as f:
        f.write(json.dumps(seen) + "\\n")
"""


def _no_bytecode(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """A library on PYTHONPATH, bytecode writing off, and where the tests record."""
    libs = pytester.mkdir("libs")
    (libs / "slowlib.py").write_text("ANSWER = 42\n")
    monkeypatch.setenv("PYTHONPATH", str(libs), prepend=":")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    seen = pytester.path / "seen.jsonl"
    monkeypatch.setenv("SEEN", str(seen))
    return libs, seen


@pytest.mark.parametrize(
    "method, mode", [("spawn", "auto"), ("forkserver", "auto"), ("spawn", "off")]
)
def test_children_keep_bytecode_but_their_tests_see_the_parents_settings(
    pytester, monkeypatch, method, mode
):
    libs, seen = _no_bytecode(pytester, monkeypatch)
    pytester.makepyfile(test_suite=SUITE)
    args = ["--spawn-method", method, "--spawn-pycache", mode]

    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=2)
    # The test itself sees what the parent has: no writing, no prefix, no variable.
    rows = [json.loads(line) for line in seen.read_text().splitlines()]
    assert rows == [{"dont_write": True, "prefix": None, "env": [], "answer": 42}] * 2
    assert not (libs / "__pycache__").exists()
    kept = list((pytester.path / ".pytest_cache").rglob("slowlib*.pyc"))
    if mode == "off":
        assert kept == []
        return
    assert len(kept) == 1, kept
    # A later child loads it: valid, so nobody writes it again.
    written = kept[0].stat().st_mtime_ns
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=2)
    assert kept[0].stat().st_mtime_ns == written


def test_the_parents_collection_leaves_bytecode_for_its_children(pytester, monkeypatch):
    # What the parent compiles while it collects, children load: written there too, and
    # the settings are back as they were before any test runs.
    libs, seen = _no_bytecode(pytester, monkeypatch)
    pytester.makepyfile(test_suite=SUITE.replace("@pytest.mark.gpu(count=0)\n", ""))
    pytester.runpytest_subprocess().assert_outcomes(passed=2)  # in-process: no child
    rows = [json.loads(line) for line in seen.read_text().splitlines()]
    assert rows == [{"dont_write": True, "prefix": None, "env": [], "answer": 42}] * 2
    assert not (libs / "__pycache__").exists()
    assert len(list((pytester.path / ".pytest_cache").rglob("slowlib*.pyc"))) == 1


@pytest.mark.parametrize("where", ["spawn", "forkserver", "in-process"])
def test_bytecode_already_compiled_next_to_its_source_is_read_there(pytester, monkeypatch, where):
    # pip compiles site-packages at install: with bytecode writing off, spawnrun's own
    # directory must not hide that bytecode (every import would compile its source
    # again, in the parent's collection and in every child); only what has no current
    # bytecode of its own goes there.
    libs, seen = _no_bytecode(pytester, monkeypatch)
    (libs / "readylib.py").write_text("READY = True\n")
    py_compile.compile(str(libs / "readylib.py"), doraise=True)
    compiled = libs / "__pycache__"
    before = {p.name: p.stat().st_mtime_ns for p in compiled.iterdir()}
    suite = SUITE.replace("import slowlib\n", "import slowlib, readylib\n")
    if where == "in-process":
        suite = suite.replace("@pytest.mark.gpu(count=0)\n", "")
    pytester.makepyfile(test_suite=suite)
    method = "forkserver" if where == "forkserver" else "spawn"
    pytester.runpytest_subprocess("--spawn-method", method).assert_outcomes(passed=2)
    kept = pytester.path / ".pytest_cache"
    assert [p.name for p in kept.rglob("readylib*.pyc")] == []
    assert len(list(kept.rglob("slowlib*.pyc"))) == 1  # it had none: kept for children
    assert {p.name: p.stat().st_mtime_ns for p in compiled.iterdir()} == before


@pytest.mark.parametrize("planted", ["link", "writable"])
def test_a_bytecode_directory_others_could_plant_code_in_is_refused(pytester, monkeypatch, planted):
    """The cache's bytecode directory is code every child runs: a link to elsewhere, or
    a directory others may write, is not used (a warning says so); the children keep
    their bytecode in the run's own temporary directory."""
    libs, seen = _no_bytecode(pytester, monkeypatch)
    pytester.makepyfile(test_suite=SUITE)
    cache_dir = pytester.path / ".pytest_cache" / "d"
    cache_dir.mkdir(parents=True)
    elsewhere = pytester.mkdir("elsewhere")
    if planted == "link":
        (cache_dir / "spawnrun-pycache").symlink_to(elsewhere, target_is_directory=True)
    else:
        (cache_dir / "spawnrun-pycache").mkdir()
        (cache_dir / "spawnrun-pycache").chmod(0o777)
    result = pytester.runpytest_subprocess("-W", "default")
    result.assert_outcomes(passed=2, warnings=1)
    why = "is a symbolic link" if planted == "link" else "may be written by other users"
    result.stdout.fnmatch_lines([f"*not keeping children's bytecode in*: it {why}*"])
    assert list(elsewhere.rglob("*.pyc")) == []
    assert list((cache_dir / "spawnrun-pycache").rglob("*.pyc")) == []
