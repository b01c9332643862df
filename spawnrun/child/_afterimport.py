"""Run a function on a module right after it is imported, whoever imports it.

Runs in children only: a child's budget (``_budget``) and its share of JAX's compilation
cache (``_jaxcache``) must reach a framework before the test's first use of it, whether a
template imported the framework before the fork (then at once) or the suite imports it
later (then through this hook, which finds the module as the other finders would and
runs ``then`` once the module's own code has run; a failure of ``then`` is ignored).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """``then(module)`` now where ``name`` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        with contextlib.suppress(Exception):
            then(module)
        return
    sys.meta_path.insert(0, _Watch(name, then))


class _Watch(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _Watch) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _After(spec.loader, self)
                return spec
        return None


class _After(importlib.abc.Loader):
    def __init__(self, loader: Any, watch: _Watch) -> None:
        self.loader = loader
        self.watch = watch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        with contextlib.suppress(Exception):
            self.watch.then(module)
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self.watch)
