"""Which imported modules answer ``pytest_spawnrun_device_state`` (``_forksafe``).

A template and every fork ask before they fork or boot; only modules added since the
last look are looked at (each module looked at in a fork is a page copied: 3 ms per
fork with torch's ~1700 modules), so what was added after a look must still be found,
however ``sys.modules`` changed meanwhile.
"""

from __future__ import annotations

import sys
import types

import pytest

from spawnrun import _forksafe


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
        ([("jemalloc_bg_thd", False)], []),
        # A Python thread may take any name: only the native one is known.
        ([("jemalloc_bg_thd", True)], ["jemalloc_bg_thd"]),
        # An unnamed native thread (an OpenMP pool's, a driver's): nothing known of it.
        ([("jemalloc_bg_thd", False), ("python3", False)], ["python3"]),
    ],
)
def test_threads_are_judged_one_by_one(monkeypatch, threads, unsafe):
    """A thread whose library handles a fork itself leaves the process safe to fork;
    any other thread still makes it unsafe, and is named."""
    monkeypatch.setattr(_forksafe._probe, "threads", lambda: threads)
    monkeypatch.setattr(_forksafe._probe, "waiting_for_connections", lambda: [])
    monkeypatch.setattr(_forksafe, "_quiesce", lambda: None)
    assert _forksafe.unsafe_threads() == unsafe
