"""What a forkserver template imports: its base, the plugins' modules, what pytest
rewrites, and the packages earlier runs left out (pytest's cache).

Runs in the parent, for the holder (``_forkserver.ZygoteHolder``) and the head start
(``_headstart``): reads the parent's pytest configuration and cache, never the template.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Collection
from pathlib import Path
from typing import Any

from spawnrun.proc._libraries import is_library
from spawnrun.wire import _forking

#: Where pytest's cache keeps what made a template unsafe, so the next run leaves it out
#: from the start instead of building the template again without it.
EXCLUDED_KEY = "spawnrun/template-excluded"


def may_keep(
    config: Any, module: str, rewrite: _forking.Rewrite | None, excluded: Collection[str]
) -> bool:
    """Whether a template may import ``module`` beyond its base: not left out by an
    earlier run (``excluded``), and a module pytest rewrites only where the template
    rewrites it the same way (``rewrite``)."""
    if top(module) in excluded:
        return False
    return rewrite is not None or not rewritten(config, module)


def rewritten(config: Any, module: str) -> bool:
    """Whether pytest rewrites asserts in ``module`` (plugins' packages, ``-p`` modules).

    Such a module must be imported by the child's own pytest, which rewrites it on
    import: preloaded, it would keep plain asserts, and pytest warns "Module already
    imported so cannot be rewritten" (an error under ``filterwarnings = error``).
    pytest keeps those names on its import hook, privately; without them nothing is
    left out.
    """
    hook = getattr(config.pluginmanager, "rewrite_hook", None)
    names = getattr(hook, "_must_rewrite", ()) or ()
    return any(module == n or module.startswith(n + ".") for n in names)


def rewrite_of(config: Any) -> _forking.Rewrite | None:
    """How the parent's pytest rewrites asserts, for the template (None: it does not).

    The names marked for rewriting are kept on pytest's import hook, privately; without
    them (``--assert=plain``, another pytest) nothing that pytest rewrites is preloaded.
    """
    hook = getattr(config.pluginmanager, "rewrite_hook", None)
    names = getattr(hook, "_must_rewrite", None)
    if not isinstance(names, set):
        return None
    try:
        python_files = [str(p) for p in config.getini("python_files")]
        pass_hook = bool(config.getini("enable_assertion_pass_hook"))
    except (ValueError, KeyError):
        return None
    return _forking.Rewrite(sorted(str(n) for n in names), python_files, pass_hook)


def base_modules(config: Any, preload: list[str]) -> list[str]:
    """What every template imports, in order (unsafe to fork after any: fast mode off).

    spawnrun's own plugin too: each fork's pytest loads it (30 ms to import).
    """
    return dedupe(["pytest", *pytest_modules(config), "spawnrun.plugin", *preload])


def top(module: str) -> str:
    return module.partition(".")[0]


def dedupe(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


def remembered_exclusions(config: Any) -> dict[str, Any]:
    """What earlier runs found unsafe in a template, by top-level package ({}: nothing)."""
    cache = getattr(config, "cache", None)
    found = cache.get(EXCLUDED_KEY, {}) if cache is not None else {}
    return dict(found) if isinstance(found, dict) else {}


def remember(config: Any, tops: list[str], reason: str) -> None:
    """Keep ``tops`` among the remembered exclusions (``reason``: why each is left out)."""
    cache = getattr(config, "cache", None)
    if cache is None or not tops:
        return
    found = remembered_exclusions(config)
    found.update({top: reason for top in tops})
    with contextlib.suppress(Exception):  # a read-only cache: rebuild next time
        cache.set(EXCLUDED_KEY, found)


#: Imported by every child's pytest at configure time (its debugging plugin) and by the
#: child's guard against debuggers.
CONFIGURE_IMPORTS = ["pdb"]


def pytest_modules(config: Any) -> list[str]:
    """pytest's own plugin modules that the parent's pytest loaded, and what they import
    when a child configures.

    ``import pytest`` leaves most of its built-in plugins (junitxml, debugging, skipping,
    unittest...) to the configuration, which imported them in each fork again (~7 ms of
    CPU per fork). A plugin the parent's pytest blocked (``-p no:junitxml``) is not
    loaded by the child's either, and is left out.
    """
    names = [
        plugin.__name__
        for _, plugin in config.pluginmanager.list_name_plugin()
        if isinstance(plugin, types.ModuleType) and plugin.__name__.startswith("_pytest.")
    ]
    return [*names, *CONFIGURE_IMPORTS]


def plugin_modules(config: Any, rootdir: Path) -> list[str]:
    """Modules of the plugins the parent loaded, outside the suite's own folder."""
    names = []
    for _, plugin in config.pluginmanager.list_name_plugin():
        if isinstance(plugin, types.ModuleType) and is_library(plugin, rootdir):
            names.append(plugin.__name__)
    return names
