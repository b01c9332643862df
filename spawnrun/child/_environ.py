"""What the template's imports read of the environment, and whether a fork may rely on it.

Runs in the zygote (``observing`` while it imports) and in the processes forked from it
(``watch_writes``, ``doubt``); imports only the standard library. A module imported in
the template read the template's environment at import: a package that keeps
``os.environ.get("CUDA_VISIBLE_DEVICES")`` in a global, a library that reads a variable a
conftest or a fixture sets. A fork of the template has its test's environment, but the
module's global stays what the template saw; a spawned child imports the module itself
and sees its own. So the template notes every variable read while it imports (its
value then, and the package that read it), and:

* before a fork, compares them with the test's final environment (``conflict``): where
  one differs (the test's device mask, a variable the parent's conftest set), the test
  is not forked (the zygote declines it, the parent spawns it and says why, and the
  package is left out of the next run's template);
* in the fork, notices a write of one of them to another value (``watch_writes``: a
  fixture's ``monkeypatch.setenv`` before the test imports the library): the test's
  outcome is then doubtful (``doubt``), and it runs again in a fresh spawned child.

Reads are seen through ``os.environ`` (``[]``, ``get``, ``in``, ``os.getenv``, listing
it); a C extension's ``getenv`` at load is not.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

#: Variable -> (its value when first read while the template imported, or None where
#: unset; the top-level package that read it).
READS: dict[str, tuple[str | None, str]] = {}
#: The same for the reads made while the template imported learned preloads (the
#: libraries that tests imported in their bodies last time): a spawned child imports
#: such a library only once its test does, after its fixtures. A library that the
#: parent's conftests or collection imported, a spawned child imports while it boots,
#: before any fixture, as the template did: a later write does not change what it read.
LATE: dict[str, tuple[str | None, str]] = {}
#: Variables that the template's imports read unset and then set themselves (torch's
#: inductor sets ``TORCHINDUCTOR_CACHE_DIR`` to its default so): the value set. A test
#: whose environment has that value sees what the library would have made of it.
DEFAULTED: dict[str, str] = {}
#: Packages that listed the environment while imported -> the names it held then.
LISTED: dict[str, frozenset[str]] = {}
#: Set by spawnrun itself while the template imports (not the user's): not a read.
OWN: set[str] = set()
#: Every variable read while this process booted (``observing_boot``).
BOOT: set[str] = set()
#: Variables spawnrun gives each test's child besides its mask (``_starting.child_env``).
PER_TEST = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "XLA_PYTHON_CLIENT_PREALLOCATE",
        "XLA_PYTHON_CLIENT_MEM_FRACTION",
    }
)
#: The variables that restrict which devices a process sees (``_vendors``' own).
MASKS = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "ZE_AFFINITY_MASK",
        "ASCEND_RT_VISIBLE_DEVICES",
    }
)

_Environ = type(os.environ)
_original_getitem = _Environ.__getitem__
_original_iter = _Environ.__iter__
_original_setitem = _Environ.__setitem__
_original_delitem = _Environ.__delitem__
#: Modules whose frames read for someone else (``Mapping.get`` lives in
#: ``_collections_abc``, which calls itself ``collections.abc``).
_SKIPPED = ("os", "posixpath", "genericpath", "_collections_abc", "collections.abc", __name__)
_doubt = ""


def _reader() -> str:
    """The top-level package of the code reading the environment ("" if none found)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name and name not in _SKIPPED and not name.startswith(("importlib", "<frozen")):
            return str(name).partition(".")[0]
        frame = frame.f_back  # type: ignore[assignment]
    return ""


def _observed_getitem(self: Any, key: str) -> str:
    if _booting:  # a test's boot, not the template's imports: only the names
        if self is os.environ:
            BOOT.add(key)
        return _original_getitem(self, key)
    try:
        value: str | None = _original_getitem(self, key)
    except KeyError:
        value = None
    if self is os.environ and isinstance(key, str) and key not in OWN:
        if key not in READS:
            READS[key] = (value, _reader())
        if _late and key not in LATE and (reader := _reader()) == _late:
            LATE[key] = (value, reader)
    if value is None:
        raise KeyError(key)
    return value


def _observed_iter(self: Any) -> Iterator[str]:
    if self is os.environ and _booting:
        BOOT.update(MASKS)  # it saw them, whichever were set
    if self is os.environ and not _booting:
        reader = _reader()
        LISTED.setdefault(reader, frozenset(_original_iter(self)) - OWN)
    return _original_iter(self)


def _observed_setitem(self: Any, key: str, value: str) -> None:
    _original_setitem(self, key, value)
    if self is os.environ and key in READS and READS[key][0] is None:
        DEFAULTED[key] = value  # read unset, then set: the library's default


@contextlib.contextmanager
def observing() -> Iterator[None]:
    """While the template imports: every read of ``os.environ`` is noted (``READS``),
    and what it set of what it read unset (``DEFAULTED``)."""
    _Environ.__getitem__ = _observed_getitem  # type: ignore[method-assign]
    _Environ.__iter__ = _observed_iter  # type: ignore[method-assign]
    _Environ.__setitem__ = _observed_setitem  # type: ignore[method-assign]
    try:
        yield
    finally:
        _Environ.__getitem__ = _original_getitem  # type: ignore[method-assign]
        _Environ.__iter__ = _original_iter  # type: ignore[method-assign]
        _Environ.__setitem__ = _original_setitem  # type: ignore[method-assign]


#: The top-level package of the learned preload being imported ("": none).
_late = ""


@contextlib.contextmanager
def reading_late(module: str) -> Iterator[None]:
    """While the template imports ``module``, which tests imported in their bodies
    ("": another): the reads its own package makes are noted in ``LATE`` too. What
    other packages read meanwhile (the standard library's ``sysconfig`` reading
    ``HOME`` for the user's site directory) is not: that is their state, which a
    spawned child's own imports make as they do."""
    global _late
    _late = module.partition(".")[0]
    try:
        yield
    finally:
        _late = ""


_booting = False


def observing_boot() -> Callable[[], None]:
    """While a test's child boots (configures pytest, collects): note each variable
    read (``BOOT``); the returned function ends it. A boot that read its device mask
    depends on the devices it saw (``read_mask``)."""
    global _booting
    if _Environ.__getitem__ is not _original_getitem:
        return lambda: None  # a template's imports are observed already
    _booting = True
    _Environ.__getitem__ = _observed_getitem  # type: ignore[method-assign]
    _Environ.__iter__ = _observed_iter  # type: ignore[method-assign]

    def stop() -> None:
        global _booting
        _booting = False
        _Environ.__getitem__ = _original_getitem  # type: ignore[method-assign]
        _Environ.__iter__ = _original_iter  # type: ignore[method-assign]

    return stop


def read_mask() -> bool:
    """Whether this process's boot read the variables that say which devices it sees."""
    return bool(BOOT & MASKS)


def final_environment(env: Mapping[str, str], unset: Sequence[str]) -> dict[str, str]:
    """The environment a fork will have: this process's, less ``unset``, plus ``env``."""
    final = {k: v for k, v in os.environ.items() if k not in unset}
    final.update(env)
    return final


def conflict(final: Mapping[str, str]) -> tuple[str, str]:
    """The first thing the template's imports read that ``final`` gives otherwise:
    (package, why); ("", "") where a fork sees what a spawned child would."""
    for name, (seen, reader) in READS.items():
        now = final.get(name)
        if now != seen and not (name in DEFAULTED and now == DEFAULTED[name]):
            return reader, (
                f"{reader or 'a module'} read {name} at import in the template "
                f"({_shown(seen)}), and this test's is {_shown(now)}"
            )
    names = _listed_names(final)
    for reader, listed in LISTED.items():
        if _listed_names(listed) != names:
            differ = sorted(_listed_names(listed) ^ names)[:3]
            return reader, (
                f"{reader or 'a module'} listed the environment at import in the template, "
                f"and this test's differs ({', '.join(differ)})"
            )
    return "", ""


def _listed_names(names: Iterable[str]) -> frozenset[str]:
    """What a package that lists the environment is checked for: the names the parent's
    environment has, not those spawnrun gives each test (its device mask, budget and own
    markers), which a library that lists the environment at import (networkx) looks
    past, nor those a library of the template set to its default there
    (``DEFAULTED``: the parent's own import of it set them, not the user); a value it
    read is checked as any read is (``READS``)."""
    own = OWN | PER_TEST | MASKS | DEFAULTED.keys()
    return frozenset(n for n in names if n not in own and not n.startswith("SPAWNRUN_"))


def _shown(value: str | None) -> str:
    return "unset" if value is None else repr(value)


def watch_writes() -> None:
    """In a forked test's process: a write, to another value, of a variable that the
    template's learned preloads read at import makes the test's outcome doubtful
    (``doubt``). A variable that only the libraries of the conftests and collection
    read is not watched: a spawned child read it at import before its fixtures too."""
    if not LATE or _Environ.__setitem__ is not _original_setitem:
        return  # nothing read in a template (a spawned child), or watched already

    def setitem(self: Any, key: str, value: str) -> None:
        before = _current(self, key)
        _original_setitem(self, key, value)
        if self is os.environ:
            _wrote(key, value, before)

    def delitem(self: Any, key: str) -> None:
        before = _current(self, key)
        _original_delitem(self, key)
        if self is os.environ:
            _wrote(key, None, before)

    _Environ.__setitem__ = setitem  # type: ignore[method-assign]
    _Environ.__delitem__ = delitem  # type: ignore[method-assign]


#: Variables written while ``mock.patch.dict`` put the environment back (it empties it,
#: then writes every variable again): judged once that is over.
_restored: set[str] = set()


def _current(environ: Any, key: str) -> str | None:
    try:
        return str(_original_getitem(environ, key))
    except KeyError:
        return None


def _wrote(key: str, value: str | None, before: str | None) -> None:
    """A write of ``key`` (``value``; None: deleted), which had ``before``: a variable a
    learned preload read, now at a value that library would have made otherwise, makes
    the test's outcome doubtful. Not a write of the value it had (restoring is not
    changing), nor one equal to what the library read, or to the default the library set
    itself where it read it unset (``DEFAULTED``: a spawned child's library, finding the
    test's value, would keep it: the same); writes while ``mock.patch.dict`` puts the
    environment back are judged once it is done (it passes through an empty one)."""
    if _doubt or key not in LATE or value == before:
        return
    if _putting_back():
        _restored.add(key)
        return
    _judge(key, value)
    _judge_restored()


def _judge(key: str, value: str | None) -> None:
    global _doubt
    seen, reader = LATE[key]
    if _doubt or value == seen or (seen is None and value == DEFAULTED.get(key)):
        return
    _doubt = (
        f"{key} was set to {_shown(value)} in its process, and {reader or 'a module'} "
        f"had read it at import in the template ({_shown(seen)})"
    )


def _judge_restored() -> None:
    for key in sorted(_restored):
        _judge(key, _current(os.environ, key))
    _restored.clear()


def _putting_back() -> bool:
    """Whether ``unittest.mock`` is putting a patched dict back (its clear, then update)."""
    frame = sys._getframe(3)
    while frame is not None:
        if frame.f_code.co_name in ("_unpatch_dict", "_clear_dict"):
            if frame.f_globals.get("__name__") == "unittest.mock":
                return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def doubt() -> str:
    """Why this fork's outcome may not be a spawned child's ("": no reason known)."""
    _judge_restored()
    return _doubt
