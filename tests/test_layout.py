"""The package's layout holds: rooms by side and concern, imports only downwards.

``spawnrun/`` is laid out in rooms (subpackages), lowest first: ``proc`` (what a process
knows of itself), ``wire`` (the protocol), ``devices``, ``dispatch`` (the pure scheduling
core), ``child`` (a test's process), ``fork`` (the zygote), ``learn``, ``config``,
``launch`` (where a child is started), ``driver`` (the parent's loop and a test's life),
``calls`` (``spawnrun.call``), then ``plugin.py``. A module imports its own room or a lower
one; modules import each other in no loop; and a test's process never loads the
parent's side. (A module is sized by its concept, not a line count: the 400-line cap,
which cut classes into base-class chains, is lifted.) Read from the code (``ast``), not
run, except the last check, which imports the child's side in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "spawnrun"
ROOMS = "proc wire devices dispatch child fork learn config launch driver calls".split()
#: Modules at the package's top level, and the room each stands in.
TOP = {"__init__": "plugin", "hookspecs": "proc", "plugin": "plugin"}
ORDER = [*ROOMS, "plugin"]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "plugin"  # the package itself: the public surface (``spawnrun.call``)
    return TOP.get(parts[1], parts[1])


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which modules of the package each one imports (a room's ``__init__`` excepted)."""
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("spawnrun"):
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    found.add(name if name in modules else str(node.module))
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("spawnrun")}
        packages = {m for m, p in modules.items() if p.name == "__init__.py"}
        edges[module] = {m for m in found if m in modules and m != module and m not in packages}
    return edges


def test_every_module_stands_in_a_room():
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(ROOMS)
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert loose == set(TOP), "a module at the top level: put it in its room"
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text()))
        assert doc, f"spawnrun/{room}/__init__.py says what the room owns"


def test_imports_go_to_the_same_room_or_a_lower_one():
    upward = [
        f"{a} -> {b}"
        for a, targets in _imports(_modules()).items()
        for b in targets
        if ORDER.index(_room(b)) > ORDER.index(_room(a))
    ]
    assert upward == []


def test_modules_import_each_other_in_no_loop():
    edges = _imports(_modules())
    loops = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                loops.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert loops == []


@pytest.mark.parametrize(
    "entry",
    [
        "spawnrun.child._child",
        "spawnrun.child._relay",
        "spawnrun.child._template",
        "spawnrun.fork._zygote",
        "spawnrun.calls._call_child",
    ],
)
def test_a_tests_process_loads_nothing_of_the_parents_side(entry):
    """What a child, a template or the zygote imports, in a fresh interpreter: none of
    the parent's driver, launcher, configuration, learned state, dispatcher or plugin."""
    parent_side = ("driver", "launch", "config", "learn", "dispatch")
    code = (
        f"import sys, {entry}; "
        f"print(sorted(m for m in sys.modules if m == 'spawnrun.plugin' or "
        f"m.split('.')[:2] in [['spawnrun', r] for r in {parent_side!r}]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=PACKAGE.parent,
    )
    assert done.stdout.strip() == "[]"
