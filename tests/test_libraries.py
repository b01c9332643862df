"""Which imported modules are libraries, and which folders below the rootdir are the
project's own code (``_libraries``): path prefixes compared as strings."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from spawnrun.proc import _libraries


def _module(name: str, filename: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = filename
    return module


@pytest.mark.parametrize(
    ("path", "top"),
    [
        ("/work/proj/timm/models/vit.py", "/work/proj/timm"),
        ("/work/proj/setup.py", None),  # right in the rootdir: no folder
        ("/work/project2/timm/vit.py", None),  # a sibling whose name starts alike
        ("/work/pro/timm/vit.py", None),
        ("/elsewhere/timm/vit.py", None),
    ],
)
def test_the_folder_below_the_rootdir_holding_a_file(path, top):
    assert _libraries._top_below(path, "/work/proj") == top
    assert _libraries._top_below(path, "/work/proj/") == top


def test_a_file_below_the_filesystem_root():
    assert _libraries._top_below("/work/proj/x.py", "/") == "/work"


def test_a_library_is_outside_the_rootdir_or_in_the_projects_own_folders(tmp_path):
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (tmp_path / "proj2").mkdir()
    inside = _module("pkg.mod", str(root / "pkg" / "mod.py"))
    suite = _module("helpers", str(root / "tests" / "helpers.py"))
    sibling = _module("other", str(tmp_path / "proj2" / "other.py"))
    conftest = _module("conftest_thing", str(tmp_path / "proj2" / "conftest.py"))
    real = root.resolve()
    assert _libraries.is_library(sibling, real)
    assert not _libraries.is_library(conftest, real)
    assert not _libraries.is_library(inside, real)
    assert _libraries.is_library(inside, real, (real / "pkg",))
    assert not _libraries.is_library(suite, real, (real / "pkg",))


def test_a_linked_module_file_counts_where_it_really_lies(tmp_path):
    root = tmp_path / "proj"
    root.mkdir()
    real_file = tmp_path / "site" / "lib.py"
    real_file.parent.mkdir()
    real_file.write_text("")
    link = root / "lib.py"
    os.symlink(real_file, link)
    assert _libraries.real_path(str(link)) == real_file.resolve()
    assert _libraries.is_library(_module("lib", str(link)), root.resolve())


def test_the_projects_own_folders_leave_out_the_suites(tmp_path, monkeypatch):
    root = tmp_path / "proj"
    for folder in ("timm", "tests", "helpers"):
        (root / folder).mkdir(parents=True)
    modules = {
        "timm": _module("timm", str(root / "timm" / "__init__.py")),
        "helpers.util": _module("helpers.util", str(root / "helpers" / "util.py")),
        "helpers.conftest": _module("helpers.conftest", str(root / "helpers" / "conftest.py")),
        "tests.test_x": _module("tests.test_x", str(root / "tests" / "test_x.py")),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, f"_spawnrun_test_{name}", module)
    found = _libraries.project_dirs(root.resolve(), {root / "tests" / "test_x.py"})
    assert found == (root.resolve() / "timm",)
    assert all(isinstance(p, Path) for p in found)
