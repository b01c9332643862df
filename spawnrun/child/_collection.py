"""The child's collection: only what its arguments name, and the parent's test in it.

Runs in the child only (a spawned child, a fork of a template). The relay (``_relay``)
narrows pytest's collection to the paths its arguments name (``wanted_paths``,
``list_wanted``), finds the parent's test among what was collected, and binds it to
the parent's parameters (``bind_parents``), or says why it cannot be the parent's test.
Imports nothing of spawnrun but the protocol.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

from spawnrun.wire import _identity
from spawnrun.wire import _orders

_MAX_LISTED_IDS = 10


def list_wanted(wanted: Callable[[str], bool]) -> Callable[[], None]:
    """pytest's directory and package collectors list only the ``wanted`` entries, until
    the returned function undoes it.

    They call the ignore hook for each entry of the directories on the way to the
    test: a hook call of every plugin, and a legacy path made for it, per sibling file
    (a fork of a template collecting one file of a folder of 40 spent a third of its
    collection on them). What is left out here, ``Relay.pytest_ignore_collect`` would
    ignore; other collectors (a plugin's own) still meet the hook. Where pytest lists
    directories otherwise (another version), nothing changes.

    The patch is of pytest's modules, which every session in the process shares: it is
    undone once the child's own collection is over (``Relay.undo``), so that a session
    its test starts (``pytester.runpytest()``, ``inline_run``) lists its directories as
    it would in-process, not filtered by the child's arguments.
    """
    import _pytest.pathlib

    listing = _pytest.pathlib.scandir

    def scandir(path: Any, *args: Any, **kwargs: Any) -> list[os.DirEntry[str]]:
        return [e for e in listing(path, *args, **kwargs) if wanted(e.path)]

    patched = []
    for name in ("_pytest.main", "_pytest.python"):
        module = sys.modules.get(name)
        if getattr(module, "scandir", None) is listing:
            module.scandir = scandir  # type: ignore[union-attr]
            patched.append(module)

    def undo() -> None:
        for module in patched:
            if module.scandir is scandir:  # type: ignore[union-attr]
                module.scandir = listing  # type: ignore[union-attr]

    return undo


def wanted_paths(args: list[str], invocation_dir: str) -> tuple[set[str], tuple[str, ...]] | None:
    """The paths the child's arguments name and every directory above them, and the
    directory arguments (what lies below them is wanted too); None: an argument that
    names no existing path (a module name for ``--pyargs``), so nothing is left out."""
    on_the_way: set[str] = set()
    below: list[str] = []
    for arg in args:
        path = os.path.abspath(os.path.join(invocation_dir, arg.split("::")[0]))
        if not os.path.exists(path):
            return None
        if os.path.isdir(path):
            below.append(path.rstrip(os.sep) + os.sep)
        while path not in on_the_way:
            on_the_way.add(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
    return on_the_way, tuple(below)


def bind_parents(item: Any, spec: _orders.ChildSpec, theirs: dict[str, _orders.Binding]) -> str:
    """Make the child's test the parent's; "" once it is, else why it cannot be.

    Where the child's values read as the parent's, the child's own run (as they
    would in-process: one object, shared with its module). Where they differ (drawn
    at random at import, a set's order), the parent's values are put in their place,
    so the child runs exactly the parent's test. A value that cannot travel (it does
    not pickle, or does not unpickle here) leaves another test under this id: that
    is refused, never run.
    """
    mine = _identity.spellings(item)
    differ = sorted(k for k in mine if k in theirs and mine[k] != theirs[k].spelling)
    if set(mine) != set(theirs):
        return _other_test(item, spec.args, theirs, mine, "it takes other parameters")
    values = {}
    for name in differ:
        binding = theirs[name]
        if not binding.value:
            why = f"the parent's {name} cannot travel: {binding.unsent}"
            return _other_test(item, spec.args, theirs, mine, why)
        try:
            values[name] = pickle.loads(binding.value)
        except Exception as exc:  # noqa: BLE001 - whatever a value's reducer raises
            why = f"the parent's {name} does not unpickle here ({type(exc).__name__}: {exc})"
            return _other_test(item, spec.args, theirs, mine, why)
    if values:
        item.callspec.params.update(values)
    return ""


def _other_test(
    item: Any, args: list[str], bindings: dict[str, _orders.Binding], mine: dict[str, str], why: str
) -> str:
    theirs = {k: b.spelling for k, b in bindings.items()}
    return (
        f"node id {item.nodeid!r} names another test in the child "
        f"(collected args: {' '.join(args)}): the parent's binds "
        f"{_identity.describe(theirs)}, the child's binds {_identity.describe(mine)}, and {why}. "
        "Its parameters come from data that differs between interpreters (random "
        "values drawn at import: seed them; a set, whose order follows the hash seed: "
        "sort it or set PYTHONHASHSEED) or from collection-time state (a counter in "
        "pytest_generate_tests); spawnrun will not run a different test under this id"
    )


def not_found(spec: _orders.ChildSpec, session: Any, collect_errors: list[str]) -> str:
    """Why the child has no test of the parent's id: what it collected instead, and the
    errors its collection met."""
    lines = [
        f"node id {spec.nodeid!r} was not collected by the child "
        f"(collected args: {' '.join(spec.args)})"
    ]
    ids = [i.nodeid for i in session.items]
    if ids:
        shown = ids[:_MAX_LISTED_IDS]
        more = len(ids) - len(shown)
        lines.append(f"the child collected {len(ids)} test(s):")
        lines += [f"  {i}" for i in shown]
        if more:
            lines.append(f"  ... and {more} more")
    else:
        lines.append("the child collected no tests")
    lines += collect_errors
    return "\n".join(lines)
