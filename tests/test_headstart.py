"""Fast mode's template starts before the conftests are loaded (``_headstart``).

A conftest that imports torch made the template wait for that import and then pay it
again itself. On a second run the template now starts from ``pytest_load_initial_conftests``
with what the last run's template imported, so its imports overlap the parent's; where
what the conftests did would make that template differ from one started at session
start (the environment, ``sys.path``, assertion rewriting), it is built again from
scratch and the tests see what they would have seen.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from patience import patient

SLOWLIB = """
import os, time
START = time.time()
with open({stamps!r} + ".started", "a") as f:
    f.write(f"{{os.getpid()}}\\n")
MODE = os.environ.get("SLOWLIB_MODE", {mode!r})
time.sleep(0.5)
with open({stamps!r}, "a") as f:
    f.write(f"{{os.getpid()}} {{START}} {{time.time()}}\\n")
IMPORTED_IN = os.getpid()


def check(x):
    assert x == 2
"""

SUITE = """
import json, os
import pytest
import slowlib

@pytest.mark.gpu
@pytest.mark.parametrize("x", [1, 2])
def test_x(x):
    with pytest.raises(AssertionError) as raised:
        slowlib.check(1)
    with open(f"where{x}.json", "w") as f:
        json.dump([slowlib.MODE, str(raised.value), slowlib.IMPORTED_IN == os.getpid()], f)
"""


def _libs(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, name: str, mode: str) -> str:
    """A folder outside the rootdir holding ``slowlib`` (a library, as pytest sees it)."""
    folder = pytester.path.parent / f"{pytester.path.name}-{name}"
    folder.mkdir()
    stamps = str(pytester.path / "imports.txt")
    (folder / "slowlib.py").write_text(SLOWLIB.format(mode=mode, stamps=stamps))
    return str(folder)


def _run(pytester: pytest.Pytester, *args: str) -> list[list[object]]:
    result = pytester.runpytest_subprocess("--spawn-method", "forkserver", "-W", "default", *args)
    result.assert_outcomes(passed=2, warnings=0)
    return [json.loads((pytester.path / f"where{x}.json").read_text()) for x in (1, 2)]


def _imports(pytester: pytest.Pytester) -> list[tuple[int, float, float]]:
    rows = (pytester.path / "imports.txt").read_text().split("\n")
    (pytester.path / "imports.txt").unlink()
    (pytester.path / "imports.txt.started").unlink(missing_ok=True)
    return [(int(p), float(s), float(e)) for p, s, e in (r.split() for r in rows if r)]


@pytest.mark.parametrize(
    ("where", "args"),
    [(".", ()), ("tests", ()), (".", ("-p", "no:cacheprovider")), (".", ("--cache-clear",))],
    ids=["rootdir", "tests", "no-cache", "cache-clear"],
)
def test_the_template_imports_what_the_conftest_imports_meanwhile(
    pytester, monkeypatch, where, args
):
    """The template imports the conftest's library while the parent does: on the first
    run as the conftest reads (in the rootdir, or in the ``tests`` folder below it), on
    the second as the first run's template imported. Without pytest's cache, or with
    ``--cache-clear``, too: children then keep their bytecode in a directory of the run's
    own (here where the environment forbids writing it), which the early template and the
    session share."""
    monkeypatch.setenv("PYTHONPATH", _libs(pytester, monkeypatch, "libs", "site"), prepend=":")
    if args:
        monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    folder = pytester.path / where
    folder.mkdir(exist_ok=True)
    # The parent's conftest goes on importing a while: until the template imports slowlib
    # too, or for long (a fixed 2 s, as before, ended first when a loaded machine's
    # template had not started by then; issue 47).
    started = str(pytester.path / "imports.txt.started")
    (folder / "conftest.py").write_text(
        f"STARTED, WHILE = {started!r}, {patient(2.0)}\n"
        + textwrap.dedent(
            """
            import os, pathlib, time
            import slowlib
            import spawnrun
            if not spawnrun.is_child():
                end = time.time() + WHILE
                me = [str(os.getpid())]
                while time.time() < end and pathlib.Path(STARTED).read_text().split() == me:
                    time.sleep(0.02)
                with open("parent.json", "w") as f:
                    f.write(f"[{os.getpid()}, {time.time()}]")
            """
        )
    )
    (folder / "test_mine.py").write_text(SUITE)
    for run in range(2):
        seen = _run(pytester, *args)
        parent, conftest_end = json.loads((pytester.path / "parent.json").read_text())
        imports = {pid: start for pid, start, _ in _imports(pytester)}
        template = [pid for pid in imports if pid != parent]
        assert len(template) == 1, (run, imports)  # the forks had it from their template
        # The template was importing it before the parent's conftest was done.
        assert imports[template[0]] < conftest_end, run
        assert [row[0] for row in seen] == ["site", "site"]
        assert [row[2] for row in seen] == [False, False]


#: What a conftest does before importing slowlib that a template started before it
#: could not have seen, and what the tests must see then.
MISFITS = {
    "environment": ("os.environ['SLOWLIB_MODE'] = 'conftest'\n", "SLOWLIB_MODE"),
    "sys.path": ("sys.path.insert(0, {vendor!r})\n", "stale: slowlib is found"),
    "rewriting": ("pytest.register_assert_rewrite('slowlib')\n", "stale: slowlib was"),
}


@pytest.mark.parametrize("case", list(MISFITS))
def test_a_conftest_that_changes_what_the_template_imports_gets_a_fresh_one(
    pytester, monkeypatch, case
):
    """The environment a library reads at import (OpenMP's pool size), a folder put first
    on ``sys.path`` and a library marked for rewriting: a template that imported before
    the conftest ran would hand the tests another module. It is built again, the tests
    see what plain pytest shows them, and the next run does not start one early."""
    monkeypatch.setenv("PYTHONPATH", _libs(pytester, monkeypatch, "libs", "site"), prepend=":")
    vendor = _libs(pytester, monkeypatch, "vendor", "vendor")
    before, why = MISFITS[case]
    pytester.makeconftest(
        "import os, sys\nimport pytest\n" + before.format(vendor=vendor) + "import slowlib\n"
    )
    pytester.makepyfile(test_mine=SUITE)
    plain = [row[:2] for row in _run(pytester, "--no-spawn")]
    assert plain[0][0] != "site" or "assert 1 == 2" in plain[0][1]  # what the conftest did
    for run in range(3):
        seen = _run(pytester)
        assert [row[:2] for row in seen] == plain, run
        assert [row[2] for row in seen] == [False, False], run  # still forked with it
    off = json.loads((pytester.path / ".pytest_cache/v/spawnrun/head-start-off").read_text())
    assert why in off


def test_no_template_starts_early_where_no_test_runs(pytester, monkeypatch):
    """--collect-only and --no-spawn start no template, before the conftests or after
    (one used to start at session start all the same, importing what the last run's
    tests needed, for nothing)."""
    monkeypatch.setenv("PYTHONPATH", _libs(pytester, monkeypatch, "libs", "site"), prepend=":")
    pytester.makeconftest("import slowlib\n")
    pytester.makepyfile(test_mine=SUITE)
    _run(pytester)
    _imports(pytester)
    for args in (["--collect-only"], ["--no-spawn"]):
        result = pytester.runpytest_subprocess("--spawn-method", "forkserver", *args)
        assert result.ret == 0
        assert len(_imports(pytester)) == 1, args  # the parent's own import only


def test_the_template_modules_are_kept_for_the_next_run(pytester, monkeypatch):
    """What the template imported, outside the rootdir, is what the next one starts with."""
    monkeypatch.setenv("PYTHONPATH", _libs(pytester, monkeypatch, "libs", "site"), prepend=":")
    pkg = pytester.mkpydir("mypkg")
    (pkg / "core.py").write_text("")
    pytester.makeconftest("import slowlib\n")
    pytester.makepyfile(test_mine=textwrap.dedent(SUITE) + "\nimport mypkg.core\n")
    _run(pytester)
    kept = json.loads((pytester.path / ".pytest_cache/v/spawnrun/template-modules").read_text())
    assert "slowlib" in kept
    assert not [m for m in kept if m.startswith("mypkg")]  # the project's own comes later


def test_cache_clear_starts_from_nothing_learned(pytester, monkeypatch):
    """A library the last run's template imported is imported again early, before the
    conftests; with ``--cache-clear`` nothing learned is used, early or later."""
    monkeypatch.setenv("PYTHONPATH", _libs(pytester, monkeypatch, "libs", "site"), prepend=":")
    pytester.makepyfile(
        test_mine="import pytest\n\n@pytest.mark.gpu(count=0)\ndef test_x(): pass\n"
    )
    kept = pytester.path / ".pytest_cache/v/spawnrun/template-modules"
    for args, imported in (((), 1), (("--cache-clear",), 0)):
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(["slowlib"]))
        result = pytester.runpytest_subprocess("--spawn-method", "forkserver", *args)
        result.assert_outcomes(passed=1)
        stamps = pytester.path / "imports.txt"
        assert len(_imports(pytester) if stamps.exists() else []) == imported, args


@pytest.mark.parametrize("cache", ["cache", "no-cache", "testpaths"])
def test_the_template_imports_what_the_test_files_import_while_the_parent_collects(
    pytester, monkeypatch, cache
):
    """A first run has learned nothing, and no conftest names the library: the test
    files do. The template reads their imports and imports the library while the parent
    collects them (before, only once the parent's collection was over, so the first
    test waited for the same import a second time), with pytest's cache (the early
    template) or without it (the one started at session start). With no paths named,
    the early template reads the ``testpaths`` pytest collects, not whatever test files
    come first below the rootdir (more of them than it reads, here): it imports the
    library while the parent's conftest is still being imported."""
    monkeypatch.setenv("PYTHONPATH", _libs(pytester, monkeypatch, "libs", "site"), prepend=":")
    collecting = textwrap.dedent(
        """
        import time
        import spawnrun
        if not spawnrun.is_child():  # the parent's collection goes on a while
            time.sleep(2)
            with open("parent.json", "w") as f:
                f.write(f"[{os.getpid()}, {time.time()}]")
        """
    )
    suite = textwrap.dedent(SUITE) + collecting
    if cache == "testpaths":
        pytester.makeini("[pytest]\ntestpaths = tests\n")
        (pytester.path / "tests").mkdir()
        (pytester.path / "tests" / "test_mine.py").write_text(suite)
        decoys = pytester.path / "a_decoys"
        decoys.mkdir()
        for i in range(70):
            (decoys / f"test_decoy{i}.py").write_text("def test_x():\n    pass\n")
        pytester.makeconftest(
            "import time, spawnrun\n"
            "if not spawnrun.is_child():\n"
            "    time.sleep(2)\n"
            "    with open('conftest.json', 'w') as f:\n"
            "        f.write(str(time.time()))\n"
        )
    else:
        pytester.makepyfile(test_mine=suite)
    args = ["-p", "no:cacheprovider"] if cache == "no-cache" else []
    seen = _run(pytester, *args)
    parent, collected = json.loads((pytester.path / "parent.json").read_text())
    imports = {pid: start for pid, start, _ in _imports(pytester)}
    template = [pid for pid in imports if pid != parent]
    assert len(template) == 1, imports  # the forks had it from their template
    assert imports[template[0]] < collected
    if cache == "testpaths":
        assert imports[template[0]] < float((pytester.path / "conftest.json").read_text())
    assert [row[2] for row in seen] == [False, False]


def test_a_sigterm_while_the_conftests_load_leaves_no_template_directory(pytester, tmp_path):
    """The template starts before the conftests load, in a directory of its own under
    the temporary directory (without pytest's cache); a SIGTERM before the session
    turns it into an interrupt ended pytest there with no cleanup, and left the
    directory behind. The process still dies of the signal."""
    loading = tmp_path / "loading"
    pytester.makeconftest(
        f"import pathlib, time\npathlib.Path({str(loading)!r}).touch()\ntime.sleep(60)\n"
    )
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    private = tmp_path / "tmp"
    private.mkdir()
    env = {**os.environ, "TMPDIR": str(private)}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--spawn-method"]
    cmd += ["forkserver", "--spawn-gpu"]
    proc = subprocess.Popen(cmd, cwd=pytester.path, env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not loading.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loading.exists(), "the conftest never loaded"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert sorted(p.name for p in private.iterdir() if p.name.startswith("spawnrun")) == []
