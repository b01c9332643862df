"""Compiled bytecode kept for children where the environment forbids writing it.

Runs in both processes; imports nothing but the standard library (and ``_main`` and
``_fresh``, which import nothing else either), since a child runs it before anything else. Container
images commonly set ``PYTHONDONTWRITEBYTECODE=1`` over a site-packages that has no
``__pycache__``: a fresh interpreter then compiles the Python source of torch, pytest and
every plugin again, in every child (on the H200 image ``import torch`` takes 4.3 s that
way and 2.3 s from compiled bytecode). In-process pytest pays that once; a spawn child
pays it per test.

With ``spawn_pycache = auto`` (the default) and bytecode writing off in the parent
(``sys.dont_write_bytecode``, no ``sys.pycache_prefix``), a child boots with
``sys.pycache_prefix`` set to a directory of pytest's cache (as ``PYTHONPYCACHEPREFIX``
would), writes what it compiles while it boots, and reads what earlier children wrote.
Once its test is collected, the child is put back as the parent is
(``sys.dont_write_bytecode`` true, no prefix, nothing in ``os.environ``), so the test
itself sees no difference. CPython writes each
file atomically, so children booting at once never read a half-written one; a source
that changed is compiled again, as with ``__pycache__``.

A prefix alone would hide the bytecode that is already there: most installs compile
site-packages (pip does), and under ``sys.pycache_prefix`` CPython looks for bytecode
only below the prefix, so every import would compile its source again (measured here:
a collection importing torch went from 1.6 s to 4.4 s). While writing, a source whose
``__pycache__`` holds current bytecode is read from there; only the rest goes to the
prefix (``_prefer_current``).
"""

from __future__ import annotations

import importlib._bootstrap_external as _external
import os
import pickle
import sys
from importlib.util import MAGIC_NUMBER
from typing import Any

from spawnrun.proc import _fresh
from spawnrun.proc import _main

#: The directory, in a child's environment (spawnrun's own, removed at the start).
ENV = "SPAWNRUN_PYCACHE_DIR"
#: Whether this process turned writing on (and must turn it off before its test).
_writing = False
#: CPython's own: where a source's bytecode goes, under the prefix when one is set.
_cache_from_source = _external.cache_from_source


def wanted(mode: str) -> bool:
    """Whether children should keep their bytecode (in the parent)."""
    return mode == "auto" and bool(sys.dont_write_bytecode) and sys.pycache_prefix is None


def boot(payload: bytes, conn: Any, target: str, main: bytes = b"") -> None:
    """A spawned process's entry: write bytecode (if asked) before importing the rest.

    The parent pickles the real target's arguments, so that unpickling them, which
    imports pytest and spawnrun, happens here, after the switch. ``main``: the parent's
    ``__main__`` (``_main.describe``), in place before anything else is imported.
    """
    _fresh.as_fresh()  # multiprocessing's marks of the spawn gone before any import
    _main.install(main)
    start()
    module, _, name = target.partition(":")
    __import__(module)
    getattr(sys.modules[module], name)(*pickle.loads(payload), conn)


def start() -> None:
    directory = os.environ.pop(ENV, None)
    if directory is not None:
        write_into(directory)


def write_into(directory: str) -> None:
    """Write bytecode into ``directory`` (a child booting; the parent while it collects).

    The parent, for its collection: what it compiles is there for its children.

    The parent imports the suite's libraries while it collects (torch, transformers):
    written to the children's directory, the first children load them compiled instead
    of compiling them again, all at once. Put back (``stop``) when collection ends.
    """
    global _writing
    sys.pycache_prefix = directory
    sys.dont_write_bytecode = False
    _external.cache_from_source = _prefer_current  # type: ignore[assignment]
    _writing = True


def stop() -> None:
    """The test is collected: bytecode as the parent has it (a no-op if never started)."""
    global _writing
    if _writing:
        _writing = False
        sys.dont_write_bytecode = True
        sys.pycache_prefix = None
        _external.cache_from_source = _cache_from_source


def _prefer_current(path: str, debug_override: Any = None, *, optimization: Any = None) -> str:
    """Where the import system reads (and writes) the bytecode of the source ``path``.

    Its own ``__pycache__`` file when that is current, else the prefix's. CPython's
    source loader asks its module's ``cache_from_source`` for this path, with no public
    way to choose it per file: this function stands in for it while bytecode is written.
    """
    if debug_override is not None or optimization is not None or sys.pycache_prefix is None:
        return str(_cache_from_source(path, debug_override, optimization=optimization))
    head, tail = os.path.split(path)
    base, dot, _ = tail.rpartition(".")
    level = sys.flags.optimize
    name = f"{base if dot else tail}.{sys.implementation.cache_tag}"
    alongside = os.path.join(head, "__pycache__", f"{name}{f'.opt-{level}' if level else ''}.pyc")
    if sys.implementation.cache_tag and _current(alongside, path):
        return alongside
    return str(_cache_from_source(path))


def _current(pyc: str, source: str) -> bool:
    """Whether ``pyc`` holds bytecode that the import system would take for ``source``
    without compiling it (a timestamp-based file that matches, or an unchecked hash)."""
    try:
        with open(pyc, "rb") as f:
            header = f.read(16)
        stat = os.stat(source)
    except OSError:
        return False
    if len(header) < 16 or header[:4] != MAGIC_NUMBER:
        return False
    flags = int.from_bytes(header[4:8], "little")
    if flags:
        return flags == 0b01  # hash-based, never checked against its source
    mtime = int.from_bytes(header[8:12], "little")
    size = int.from_bytes(header[12:16], "little")
    return mtime == int(stat.st_mtime) & 0xFFFFFFFF and size == stat.st_size & 0xFFFFFFFF
