"""A run's children share JAX's persistent compilation cache (the ``jax_cache`` setting).

Runs in children only. A function jit-compiled in one test's process is compiled again
in the next one's: plain pytest compiles it once per session, and on a GPU the compile
(with its autotuning) costs a test's process more than JAX's start. The parent names a
directory (in pytest's cache, or the run's own: ``_starting._jax_cache``) in
``SPAWNRUN_JAX_CACHE_DIR`` where the run's environment names no cache of JAX's
(``JAX_COMPILATION_CACHE_DIR``); the child points JAX's cache
there, with no minimum compile time unless the environment sets one, as JAX is imported
(at once where a template imported it before the fork), before any function is compiled.
JAX's cache is keyed by the program, the compile options, the versions and the devices:
what a test loads from it is what it would have compiled. A conftest or test that sets a
cache of its own keeps it (the setting is made before any of the suite's code runs).
"""

from __future__ import annotations

import os
from types import ModuleType

from spawnrun.child._afterimport import after_import

JAX_CACHE_ENV = "SPAWNRUN_JAX_CACHE_DIR"
#: JAX's own variables, which the run's environment may set (then they are left alone).
JAX_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
JAX_MIN_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def install() -> None:
    if os.environ.get(JAX_CACHE_ENV) and not os.environ.get(JAX_DIR_ENV):
        after_import("jax", _point)


def _point(jax: ModuleType) -> None:
    config = jax.config
    if getattr(config, "jax_compilation_cache_dir", None):
        return  # set by a conftest that a configured template loaded
    config.update("jax_compilation_cache_dir", os.environ[JAX_CACHE_ENV])
    if JAX_MIN_TIME_ENV not in os.environ:
        config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
