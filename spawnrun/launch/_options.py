"""The parent's options for a child: what it inherits, what it must not, and where its
files go.

Runs in the parent. A child's pytest gets the parent's option values (decoded before
pytest starts where they are of plain types, late where a conftest defines them) with
the child's overrides applied, and a directory of its own below the parent's basetemp.
"""

from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path
from typing import Any

import pytest

#: Options a child must not inherit: output files, session-level selection and
#: scheduling belong to the parent; the child runs exactly one given test.
_CHILD_OVERRIDES: dict[str, Any] = {
    "usepdb": False,
    "trace": False,
    "exitfirst": False,
    "maxfail": 0,
    "lf": False,
    "failedfirst": False,
    "newfirst": False,
    "stepwise": False,
    "stepwise_skip": False,
    "cacheclear": False,
    "cacheshow": False,
    "collectonly": False,
    "continue_on_collection_errors": True,
    "xmlpath": None,
    "report_log": None,
    "htmlpath": None,
    "numprocesses": None,
    "maxprocesses": None,
    "dist": "no",
    "looponfail": False,
    # pytest-split: the parent picked this shard's tests; a child that split its own
    # collection (one file) again would miss tests of its shard and fall back to a
    # second boot, and each child would rewrite the durations file the parent writes.
    "splits": None,
    "group": None,
    "store_durations": False,
    "clean_durations": False,
    # pytest-cov's controller is the parent's: in a child it would erase, combine and
    # rewrite the parent's data file while the parent writes it. The child's measurement
    # is spawnrun's (_coverage).
    "no_cov": True,
}
#: Given to the child as arguments instead of through the option namespace.
_NOT_FORWARDED = ("file_or_dir", "plugins")


def forwarded_options(config: pytest.Config) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The parent's option values for the child, with the child's overrides applied.

    Values of built-in and standard-library types travel as they are (the child decodes
    them before pytest starts). Others (a type a conftest defines) travel pickled apart
    and are decoded only once the child's pytest has loaded its conftests, so nothing of
    the suite is imported before pytest imports it, and the classes are pytest's own.
    Values that do not pickle at all stay behind.
    """
    options: dict[str, Any] = {}
    late: dict[str, bytes] = {}
    for name, value in vars(config.option).items():
        if name in _NOT_FORWARDED:
            continue
        if _plain(value):
            options[name] = value
            continue
        try:
            late[name] = pickle.dumps(value)
        except Exception:  # noqa: BLE001 - a plugin's exotic value stays behind
            continue
    options.update(_CHILD_OVERRIDES)
    # Pin rootdir, ini file and conftest cut-off: collecting one file alone must give
    # the same node ids, settings and conftests. With no ini file, an empty one keeps
    # the child from adopting one found next to the test (a nested sub/pytest.ini).
    options["rootdir"] = str(config.rootpath)
    options["inifilename"] = str(config.inipath) if config.inipath else str(_empty_ini(config))
    confcutdir = config.getoption("confcutdir", None)
    if confcutdir is None:
        confcutdir = config.inipath.parent if config.inipath else config.rootpath
    options["confcutdir"] = str(confcutdir)
    return options, late


def _plain(value: Any) -> bool:
    """Whether unpickling ``value`` imports nothing but the standard library."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    top = type(value).__module__.partition(".")[0]
    return top == "builtins" or top in getattr(sys, "stdlib_module_names", ())


def _empty_ini(config: pytest.Config) -> Path:
    path = parent_basetemp(config) / "spawnrun" / "no-inifile" / "pytest.ini"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[pytest]\n")
    return path


def plugin_args(config: pytest.Config) -> list[str]:
    return [f"-p{name}" for name in config.option.plugins]


def parent_basetemp(config: pytest.Config) -> Path:
    # pytest offers no public accessor for the session's base temp dir outside a
    # fixture; children get their own --basetemp below it.
    factory = config._tmp_path_factory  # type: ignore[attr-defined]
    return Path(factory.getbasetemp())


def child_dir(config: pytest.Config, nodeid: str, serial: int) -> Path:
    name = re.sub(r"[^\w.-]+", "_", nodeid.rsplit("/", 1)[-1])[:48]
    return parent_basetemp(config) / "spawnrun" / f"{serial:04d}-{name}"
