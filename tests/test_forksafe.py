"""Which imported modules answer ``pytest_spawnrun_device_state`` (``_forksafe``).

A template and every fork ask before they fork or boot; only modules added since the
last look are looked at (each module looked at in a fork is a page copied: 3 ms per
fork with torch's ~1700 modules), so what was added after a look must still be found,
however ``sys.modules`` changed meanwhile.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

from spawnrun.child import _forksafe


def _module(name: str, answer: str | None) -> types.ModuleType:
    module = types.ModuleType(name)
    if answer is not None:
        module.pytest_spawnrun_device_state = lambda config: answer  # type: ignore[attr-defined]
    return module


def test_a_module_added_after_a_look_is_asked(monkeypatch):
    monkeypatch.setitem(sys.modules, "spawnrun_t_plain", _module("spawnrun_t_plain", None))
    assert _forksafe.plugin_state() == ""
    monkeypatch.setitem(sys.modules, "spawnrun_t_device", _module("spawnrun_t_device", "on"))
    assert _forksafe.plugin_state() == "on"
    monkeypatch.delitem(sys.modules, "spawnrun_t_device")
    assert _forksafe.plugin_state() == ""


@pytest.mark.parametrize("how", ["last-removed-and-added-again", "earlier-removed"])
def test_a_module_added_after_removals_is_asked(monkeypatch, how):
    """The last name looked at left and came back after the new one (it is last again),
    or an earlier one left: the names after the last one looked at are not all that is
    new, and every name is looked at."""
    for name in ("spawnrun_t_a", "spawnrun_t_b"):
        monkeypatch.setitem(sys.modules, name, _module(name, None))
    assert _forksafe.plugin_state() == ""
    if how == "last-removed-and-added-again":
        last = sys.modules.pop("spawnrun_t_b")
        monkeypatch.setitem(sys.modules, "spawnrun_t_device", _module("spawnrun_t_device", "on"))
        sys.modules["spawnrun_t_b"] = last
    else:
        monkeypatch.delitem(sys.modules, "spawnrun_t_a")
        monkeypatch.setitem(sys.modules, "spawnrun_t_device", _module("spawnrun_t_device", "on"))
    assert _forksafe.plugin_state() == "on"


def test_a_hook_that_raises_counts_as_a_device_in_use(monkeypatch):
    module = types.ModuleType("spawnrun_t_broken")

    def broken(config: object) -> str:
        raise RuntimeError("no driver")

    module.pytest_spawnrun_device_state = broken  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "spawnrun_t_broken", module)
    assert "spawnrun_t_broken.pytest_spawnrun_device_state raised RuntimeError" in (
        _forksafe.plugin_state()
    )


@pytest.mark.parametrize(
    "threads, unsafe",
    [
        # pyarrow's jemalloc: its fork handlers take its locks; the child runs without it.
        ([("jemalloc_bg_thd", False, 11)], []),
        # A Python thread may take any name: only the native one is known.
        ([("jemalloc_bg_thd", True, 11)], ["jemalloc_bg_thd"]),
        # An unnamed native thread (an OpenMP pool's, a driver's): nothing known of it.
        ([("jemalloc_bg_thd", False, 11), ("python3", False, 12)], ["python3"]),
    ],
)
def test_threads_are_judged_one_by_one(monkeypatch, threads, unsafe):
    """A thread whose library handles a fork itself leaves the process safe to fork;
    any other thread still makes it unsafe, and is named."""
    monkeypatch.setattr(_forksafe._probe, "threads", lambda: threads)
    monkeypatch.setattr(_forksafe._probe, "waiting_for_connections", lambda: [])
    monkeypatch.setattr(_forksafe, "_quiesce", lambda: None)
    assert [name for name, _ in _forksafe.unsafe_threads()] == unsafe


#: A stand-in for onnxruntime 1.29+: its import starts a native thread (its telemetry
#: uploader's), unless ``ORT_DISABLE_TELEMETRY=1``, the setting it documents, is set.
NATIVE_THREAD_AT_IMPORT = """
import ctypes, os
if os.environ.get("ORT_DISABLE_TELEMETRY") != "1":
    libc = ctypes.CDLL(None)
    libc.pthread_create.argtypes = [ctypes.c_void_p] * 4
    thread = ctypes.c_ulong()
    libc.pthread_create(ctypes.byref(thread), None, ctypes.cast(libc.pause, ctypes.c_void_p), None)
"""

SUITE_IMPORTING_IT = """
import json, os
import pytest
import onnxruntime

@pytest.mark.parametrize("x", [1, 2])
def test_x(x):
    with open(f"{__name__}{x}.json", "w") as f:
        json.dump([os.getpid(), os.getppid()], f)
"""


@pytest.mark.parametrize("setting", ["unset", "set"])
def test_a_thread_is_named_by_the_import_that_started_it(pytester, monkeypatch, setting):
    """A native thread has no name of its own: the refusal names the import during which
    it started, and, for a library that documents a setting under which its threads do
    not start, that setting; with it set, each file's template forks its tests. The
    files refused for one reason share the summary's line."""
    libs = pytester.path.parent / f"{pytester.path.name}-libs"
    libs.mkdir()
    (libs / "onnxruntime.py").write_text(NATIVE_THREAD_AT_IMPORT)
    monkeypatch.setenv("PYTHONPATH", str(libs), prepend=os.pathsep)
    if setting == "set":
        monkeypatch.setenv("ORT_DISABLE_TELEMETRY", "1")
    pytester.makepyfile(test_t=SUITE_IMPORTING_IT, test_u=SUITE_IMPORTING_IT)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-method", "forkserver", "--spawn-gpu", "-W", "default"
    )
    result.assert_outcomes(passed=4, warnings=1 if setting == "unset" else 0)
    parents = {
        json.loads((pytester.path / f"{name}{x}.json").read_text())[1]
        for name in ("test_t", "test_u")
        for x in (1, 2)
    }
    if setting == "set":
        result.stdout.fnmatch_lines(["*4 tests isolated in 4 children (4 forked from 2 templates*"])
        result.stdout.no_fnmatch_line("*other thread(s)*")
        assert len(parents) == 2  # each file's template forked its two tests
        return
    named = (
        "*1 other thread(s) run in it (python*, started as onnxruntime was imported)*"
        "onnxruntime's telemetry uploader, which its import starts, does not start where "
        "ORT_DISABLE_TELEMETRY=1 is set*"
    )
    # Left out of the library template, with the warning saying why ...
    result.stdout.fnmatch_lines(["*forkserver leaves onnxruntime out of its template*" + named])
    # ... and the files' own templates refused: one line says why, for both.
    result.stdout.fnmatch_lines(
        ["test_t.py, test_u.py (2 files): not forked from a template that collected it*" + named]
    )
    result.stdout.fnmatch_lines(["4 tests isolated in 4 children; boot median*"])
