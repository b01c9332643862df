"""Learned preloads are an optimization, never a behaviour (``_learned``, ``_forkserver``).

Fast mode's template imports what pytest's cache names (``spawnrun/preloads``: what
earlier runs' tests imported; ``spawnrun/template-modules``: what the last template
imported). A name there is a guess: it is imported only if it is an installed library
found outside the rootdir, found without running any code; and an import that takes too
long is given up on, the template rebuilt without it, and the run says so.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from spawnrun.launch import _forkserver
from spawnrun.learn import _learned

NO_INTERNAL = "*INTERNALERROR*"

SUITE = """
import pytest

@pytest.mark.gpu(count=0)
@pytest.mark.parametrize("x", [1, 2])
def test_x(x):
    pass
"""


def _plant(pytester: pytest.Pytester, key: str, value: object) -> None:
    """Write ``value`` into the inner run's pytest cache under ``key``."""
    path = pytester.path / ".pytest_cache" / "v" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def _cached(pytester: pytest.Pytester, key: str) -> object:
    return json.loads((pytester.path / ".pytest_cache" / "v" / key).read_text())


def _library(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, name: str, source: str):
    """A module outside the rootdir, on the inner run's ``PYTHONPATH``: a library."""
    libs = pytester.path.parent / f"{pytester.path.name}-libs"
    libs.mkdir(exist_ok=True)
    (libs / f"{name}.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", str(libs), prepend=os.pathsep)


@pytest.mark.parametrize("key", [_learned.CACHE_PRELOADS, _learned.CACHE_TEMPLATE_MODULES])
def test_a_module_of_the_rootdir_named_only_by_the_cache_is_never_imported(pytester, key):
    """A project module named only in the cache had its top-level code run in the
    template; now a name that resolves into the rootdir is dropped, and the cache
    forgets it."""
    pytester.makepyfile(
        helpers="open('marker.txt', 'w').close()\n",
        test_mine=SUITE,
    )
    _plant(pytester, key, ["helpers"])
    result = pytester.runpytest_subprocess("--spawn-method", "forkserver", "-W", "default")
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    assert not (pytester.path / "marker.txt").exists()
    result.assert_outcomes(passed=2, warnings=1)
    dropped = _learned.DROPPED.format(dropped=f"{key}: helpers ({_learned.IN_ROOTDIR})")
    result.stdout.fnmatch_lines([f"*{dropped}*"])
    assert "helpers" not in _cached(pytester, key)  # type: ignore[operator]


def test_garbage_in_the_cache_is_dropped_and_named(pytester, monkeypatch):
    """Entries that are no module name, the wrong JSON shape, the standard library or
    nothing installed are dropped with one warning naming each and why; the cache keeps
    what is valid."""
    _library(pytester, monkeypatch, "goodlib", "")
    pytester.makepyfile(test_mine=SUITE)
    _plant(pytester, _learned.CACHE_PRELOADS, ["goodlib", "1bad", 42, "a..b", "json", "nosuchlib"])
    _plant(pytester, _learned.CACHE_TEMPLATE_MODULES, {"not": "a list"})
    result = pytester.runpytest_subprocess("--spawn-method", "forkserver", "-W", "default")
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.assert_outcomes(passed=2, warnings=1)
    preloads = _learned.listing(
        _learned.CACHE_PRELOADS,
        {
            "'1bad'": _learned.NOT_A_NAME,
            "42": _learned.NOT_A_NAME,
            "'a..b'": _learned.NOT_A_NAME,
            "json": _learned.NOT_A_LIBRARY,
            "nosuchlib": _learned.NOT_INSTALLED,
        },
    )
    template = _learned.listing(
        _learned.CACHE_TEMPLATE_MODULES, {"{'not': 'a list'}": _learned.NOT_A_LIST}
    )
    dropped = _learned.DROPPED.format(dropped=f"{preloads}; {template}")
    result.stdout.fnmatch_lines([f"*{dropped}*"])
    assert _cached(pytester, _learned.CACHE_PRELOADS) == ["goodlib"]
    # What this run's template imported, as a list again.
    assert isinstance(_cached(pytester, _learned.CACHE_TEMPLATE_MODULES), list)


def test_a_learned_preload_whose_import_blocks_is_given_up_on(pytester, monkeypatch):
    """A library named in the cache whose import blocks stalled the whole session,
    silently, for up to the template's 600 s boot limit. Now learned preloads have a
    bound: past it the template is rebuilt without them, the run says which import it
    gave up on, and the next run leaves that library out from the start."""
    _library(pytester, monkeypatch, "stuck", "import time\ntime.sleep(30)\n")
    pytester.makeconftest(
        "import spawnrun.launch._zygoteproc\n"
        "spawnrun.launch._zygoteproc.LEARNED_LIMIT = 1.0  # in the parent; 60 s really\n"
    )
    pytester.makepyfile(test_mine=SUITE)
    _plant(pytester, _learned.CACHE_PRELOADS, ["stuck"])
    args = ("--spawn-method", "forkserver", "-W", "default")
    start = time.monotonic()
    result = pytester.runpytest_subprocess(*args, timeout=60)
    took = time.monotonic() - start
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    assert took < 15, took
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines([f"*{_forkserver.SLOW.format(module='stuck', limit=1.0)}*"])
    assert "stuck" not in _cached(pytester, _learned.CACHE_PRELOADS)  # type: ignore[operator]
    # The next run knows: it leaves the library out from the start.
    _plant(pytester, _learned.CACHE_PRELOADS, ["stuck"])
    result = pytester.runpytest_subprocess(*args, timeout=60)
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(["*stuck*an earlier run found this*"])


def test_a_slow_library_the_parent_imports_too_is_not_given_up_on(pytester, monkeypatch):
    """The bound is for what only the cache names: a library the parent imports too
    (torch, slow on a cold disk; here from a conftest's hook, which the template that
    started before the conftests could not know) is waited for as the parent's own
    import is, never left out for being slow."""
    _library(pytester, monkeypatch, "slowish", "import time\ntime.sleep(2)\n")
    pytester.makeconftest(
        "import spawnrun.launch._zygoteproc\n"
        "spawnrun.launch._zygoteproc.LEARNED_LIMIT = 0.5  # in the parent; 60 s really\n"
        "def pytest_configure(config):\n"
        "    import slowish  # no import line at the top: only the parent knows\n"
    )
    pytester.makepyfile(test_mine=SUITE)
    _plant(pytester, _learned.CACHE_TEMPLATE_MODULES, ["slowish"])
    result = pytester.runpytest_subprocess("--spawn-method", "forkserver", "-W", "default")
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.assert_outcomes(passed=2, warnings=0)
    assert "slowish" in _cached(pytester, _learned.CACHE_TEMPLATE_MODULES)  # type: ignore[operator]


def test_check_modules_keeps_installed_libraries_only(tmp_path, monkeypatch):
    """The checks alone, without processes: shape, names, count, and where a name's
    top-level package is found (without importing it)."""
    root = tmp_path / "root"
    (root / "mine").mkdir(parents=True)
    (root / "mine" / "__init__.py").write_text("raise SystemExit('imported')\n")
    site = tmp_path / "site"
    (site / "nspkg" / "sub").mkdir(parents=True)  # a namespace package: no __init__.py
    (site / "lib.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(root))
    stored = ["lib", "lib.sub", "nspkg.sub", "mine", "mine.x", "pytest", "spawnrun.fork._zygote"]
    kept, dropped = _learned.check_modules([*stored, "", None, "a b"], root.resolve())
    assert kept == ["lib", "lib.sub", "nspkg.sub"]
    assert dropped == {
        "mine": _learned.IN_ROOTDIR,
        "mine.x": _learned.IN_ROOTDIR,
        "pytest": _learned.NOT_A_LIBRARY,
        "spawnrun.fork._zygote": _learned.NOT_A_LIBRARY,
        "''": _learned.NOT_A_NAME,
        "None": _learned.NOT_A_NAME,
        "'a b'": _learned.NOT_A_NAME,
    }
    kept, dropped = _learned.check_modules(["lib", "lib.sub", "nspkg"], root.resolve(), limit=2)
    assert kept == ["lib", "lib.sub"]
    assert dropped == {"nspkg": _learned.TOO_MANY}
    assert _learned.check_modules("lib", root.resolve()) == ([], {"'lib'": _learned.NOT_A_LIST})


def test_a_module_no_import_statement_can_name_is_not_learned(pytester):
    """``sysconfig`` imports ``_sysconfigdata__x86_64-linux-gnu`` by name: a child that
    reports it must not make the next run warn that the cache names no module (and the
    run after it learn the name again)."""
    config = pytester.parseconfig()
    _learned.saw_imports(config, ["numpy", "_sysconfigdata__x86_64-linux-gnu", "a.b"])
    assert list(config.stash[_learned.IMPORTED_KEY]) == ["numpy", "a.b"]


def test_a_module_imported_by_a_name_with_hyphens_never_makes_a_run_warn(pytester):
    """What a run's template imported is kept for the next head start; sysconfig's
    data module (``_sysconfigdata__linux_x86_64-linux-gnu``) was kept too, and the next
    run refused it with a warning (an error under ``-W error``), every other run."""
    pytester.makepyfile(
        test_conf="""
        import sysconfig
        sysconfig.get_config_vars()  # imports its data module by name

        def test_x():
            pass
        """
    )
    for _ in range(3):
        result = pytester.runpytest_subprocess(
            "-W", "error", "--spawn-gpu", "--spawn-method", "forkserver"
        )
        result.assert_outcomes(passed=1)
        result.stdout.no_fnmatch_line("*not a module name*")
