"""Compiled bytecode kept for children where the environment forbids writing it.

Runs in both processes; imports nothing but the standard library, since a child runs it
before anything else. Container images commonly set ``PYTHONDONTWRITEBYTECODE=1`` over a
site-packages that has no ``__pycache__``: a fresh interpreter then compiles the Python
source of torch, pytest and every plugin again, in every child (on the H200 image
``import torch`` takes 4.3 s that way and 2.3 s from compiled bytecode). In-process pytest pays
that once; a spawn child pays it per test.

With ``spawn_pycache = auto`` (the default) and bytecode writing off in the parent
(``sys.dont_write_bytecode``, no ``sys.pycache_prefix``), a child boots with
``sys.pycache_prefix`` set to a directory of pytest's cache (as ``PYTHONPYCACHEPREFIX``
would), writes what it compiles while it boots, and reads what earlier children wrote.
Once its test is collected, the child is put back as the parent is
(``sys.dont_write_bytecode`` true, no prefix, nothing in ``os.environ``), so the test
itself sees no difference. CPython writes each
file atomically, so children booting at once never read a half-written one; a source
that changed is compiled again, as with ``__pycache__``.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any

#: The directory, in a child's environment (spawnrun's own, removed at the start).
ENV = "SPAWNRUN_PYCACHE_DIR"
#: Whether this process turned writing on (and must turn it off before its test).
_writing = False


def wanted(mode: str) -> bool:
    """Whether children should keep their bytecode (in the parent)."""
    return mode == "auto" and bool(sys.dont_write_bytecode) and sys.pycache_prefix is None


def boot(payload: bytes, conn: Any, target: str) -> None:
    """A spawned process's entry: write bytecode (if asked) before importing the rest.

    The parent pickles the real target's arguments, so that unpickling them, which
    imports pytest and spawnrun, happens here, after the switch.
    """
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
    _writing = True


def stop() -> None:
    """The test is collected: bytecode as the parent has it (a no-op if never started)."""
    global _writing
    if _writing:
        _writing = False
        sys.dont_write_bytecode = True
        sys.pycache_prefix = None
