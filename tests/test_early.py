"""Children started while the parent collects (``_early``).

End to end: a file's child imports it while the parent is still importing the suite,
in the default and fast start methods, per test and per module; a child started for a
file whose tests need other devices, or are not selected, runs nothing. The pool's
matching rules without processes.
"""

from __future__ import annotations

import json

import pytest
from patience import patient

from spawnrun.driver import _early

# The parent records when its collection ended; every process records when it began
# importing each file. The slow file makes the parent's collection last.
TIMES = """
import json, os, time
import spawnrun


def note(what):
    with open(os.environ["EARLY_EVENTS"], "a") as f:
        f.write(json.dumps([what, os.getpid(), spawnrun.is_child(), time.time()]) + "\\n")


def pytest_collection_finish(session):
    if not spawnrun.is_child():
        note("parent collected")
"""

FAST_FILE = """
import os
import pytest
from conftest import note

note("imported test_a.py")


@pytest.fixture(scope="module")
def built():
    return os.getpid()


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(2))
def test_a(built, i):
    assert built == os.getpid()
    note(f"ran test_a[{i}]")
"""

SLOW_FILE = """
import time
from conftest import note

note("imported test_b.py")
time.sleep(3.0)  # a heavy library's import


def test_b():
    pass
"""


def _events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    "args",
    [[], ["--spawn-scope", "module"], ["--spawn-method", "forkserver", "--spawn-scope", "module"]],
    ids=["default", "scope-module", "fast-scope-module"],
)
def test_a_files_child_imports_it_while_the_parent_still_collects(pytester, monkeypatch, args):
    pytester.makeconftest(TIMES)
    pytester.makepyfile(test_a=FAST_FILE, test_b=SLOW_FILE)
    events = pytester.path / "events.jsonl"
    monkeypatch.setenv("EARLY_EVENTS", str(events))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-lookahead", "1", *args
    )
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    result.assert_outcomes(passed=3)
    rows = _events(events)
    collected = next(t for what, _, child, t in rows if what == "parent collected")
    ran = {what: pid for what, pid, child, _ in rows if what.startswith("ran ")}
    first = ran["ran test_a[0]"]
    imports = [t for what, pid, child, t in rows if what == "imported test_a.py" and pid == first]
    # The child that ran the file's first test had imported the file before the parent
    # had finished collecting: it was started when the file was listed.
    assert imports and imports[0] < collected, rows
    parent = next(pid for what, pid, child, _ in rows if what == "parent collected")
    assert parent not in ran.values()
    if "module" in args:
        assert ran["ran test_a[1]"] == first  # one child for the module
    else:
        assert ran["ran test_a[1]"] != first  # a fresh child for the next test
    result.stdout.fnmatch_lines(["1 child started while collecting (1 used)"])


WRONG_GUESS = """
import os
import pytest

# Names the marker, with no literal count: a child is started for this file, for one
# GPU (the marker's default).
TWO = 2


@pytest.mark.gpu(count=TWO)
def test_two():
    assert sorted(os.environ["CUDA_VISIBLE_DEVICES"].split(",")) == ["0", "1"]
    with open(os.environ["EARLY_RAN"], "a") as f:
        f.write(f"{os.getpid()}\\n")
"""

DESELECTED = """
import os
import pytest


@pytest.mark.gpu
def test_not_selected():
    with open(os.environ["EARLY_RAN"], "a") as f:
        f.write("deselected test ran\\n")
"""


def test_a_child_started_for_other_devices_or_no_selected_test_runs_nothing(pytester, monkeypatch):
    # Both files get a child while collecting (one GPU each, the marker's default): one
    # file's test needs two GPUs, the other's is deselected. Neither child runs a test.
    pytester.makepyfile(test_a_skipped=DESELECTED, test_b_two=WRONG_GUESS)
    ran = pytester.path / "ran.txt"
    monkeypatch.setenv("EARLY_RAN", str(ran))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-lookahead", "2", "-k", "two", "-v"
    )
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    result.assert_outcomes(passed=1, deselected=1)
    lines = ran.read_text().splitlines()
    assert len(lines) == 1 and lines[0].isdigit()  # test_two's pid; the deselected never ran
    result.stdout.fnmatch_lines(
        ["*::test_two PASSED*", "2 children started while collecting (0 used)"]
    )


GROUP_FIRST = """
import pytest


@pytest.mark.gpu(count=0, group="llm")
def test_first():
    pass


@pytest.mark.gpu(count=0)
def test_between():
    pass
"""

GROUP_SECOND = """
import pytest


@pytest.mark.gpu(count=0, group="llm")
def test_second():
    pass
"""


def test_a_child_started_for_a_file_whose_test_joins_a_group_elsewhere_is_ended(pytester):
    # The first file's child was started for that file alone; its first test shares a
    # child with a test of another file (a group), so the child cannot serve it. It is
    # ended, not left waiting for a test that never comes (the run's exit waited for
    # it forever). From the second run on, pytest's cache says what the file's first
    # test needs: the child's guess is then right but for the group.
    pytester.makepyfile(test_g1=GROUP_FIRST, test_g2=GROUP_SECOND)
    for _ in range(3):
        # A hang waits forever; a run takes a few seconds (many more on a loaded machine).
        result = pytester.runpytest_subprocess("--spawn-jobs", "1", timeout=patient(6.0))
        result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["1 child started while collecting (0 used)"])


SIBLING = """
import os
import pytest

with open(os.environ["EARLY_RAN"], "a") as f:
    f.write(f"imported {os.getpid()}\\n")


@pytest.mark.gpu
def test_sibling():
    pass
"""


BUDGETED = """
import pytest


@pytest.mark.gpu(memory="1GiB")
@pytest.mark.parametrize("i", range(2))
def test_budgeted(i):
    pass
"""


def test_a_file_whose_first_test_has_a_budget_is_served_by_its_child_next_time(pytester):
    """The guess kept only (marked, count): a child started for a file whose first test
    has a budget had another environment (no budget variables) and was always dismissed.
    Now its budget is remembered too: the next run's child serves it."""
    pytester.makepyfile(test_budgeted=BUDGETED)
    args = ["--spawn-lookahead", "2", "--spawn-gpus", "0,", "--spawn-gpu-memory", "80GiB"]
    first = pytester.runpytest_subprocess(*args)
    first.assert_outcomes(passed=2)
    first.stdout.fnmatch_lines(["1 child started while collecting (0 used)"])
    second = pytester.runpytest_subprocess(*args)
    second.assert_outcomes(passed=2)
    second.stdout.fnmatch_lines(["1 child started while collecting (1 used)"])


def test_a_file_the_command_line_does_not_name_gets_no_child(pytester, monkeypatch):
    """``pytest test_b.py``: pytest lists test_a.py too (through pytest_collect_file)
    but never imports it; no child may import it either (its import-time code ran in a
    child started for it while collecting)."""
    pytester.makepyfile(test_a_sibling=SIBLING, test_b_two=WRONG_GUESS)
    ran = pytester.path / "ran.txt"
    monkeypatch.setenv("EARLY_RAN", str(ran))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-lookahead", "2", "--spawn-gpus", "0,1", "test_b_two.py"
    )
    result.assert_outcomes(passed=1)
    lines = ran.read_text().splitlines()
    assert len(lines) == 1 and lines[0].isdigit(), lines  # test_two ran; nobody imported a
    result.stdout.fnmatch_lines(["1 child started while collecting*"])


class _LookupsOnly(frozenset):  # type: ignore[type-arg]
    """The paths pytest was given, counting the lookups and forbidding a walk over them."""

    lookups = 0

    def __contains__(self, item: object) -> bool:
        type(self).lookups += 1
        return super().__contains__(item)

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("asked_for walked over every path given to pytest")


def test_whether_a_file_was_asked_for_costs_lookups_by_depth_not_by_arguments(tmp_path):
    """pytest lists every file of a directory once per file argument in it, through
    the hook that asks this: with 80 file arguments, a walk over them for each listing
    made a run template's collection 1.4 s instead of 0.1 s (6400 listings)."""
    paths = {tmp_path / f"test_{i:03d}.py" for i in range(400)} | {tmp_path / "sub"}
    given = _LookupsOnly(paths)
    session = type("Session", (), {"_initialpaths": given})()
    parent = type("Parent", (), {"session": session})()
    assert _early.asked_for(parent, tmp_path / "test_007.py")
    assert _early.asked_for(parent, tmp_path / "sub" / "deeper" / "test_x.py")
    assert not _early.asked_for(parent, tmp_path / "test_zz.py")
    assert not _early.asked_for(parent, tmp_path.parent / "test_007.py")
    assert 0 < _LookupsOnly.lookups < 4 * (len(tmp_path.parts) + 3)


class _StandIn:
    def __init__(self) -> None:
        self.gone = False
        self.closed = False

    def close_pipe(self) -> None:
        self.closed = True


def _early_child(path: str, devices: list[str], env: dict[str, str]) -> _early.EarlyChild:
    return _early.EarlyChild(path, _StandIn(), devices, env)  # type: ignore[arg-type]


def test_the_pool_hands_a_child_only_to_a_test_of_its_file_and_environment():
    pool = _early.Early(limit=2)
    a = _early_child("/s/test_a.py", ["0"], {"CUDA_VISIBLE_DEVICES": "0"})
    b = _early_child("/s/test_b.py", ["1"], {"CUDA_VISIBLE_DEVICES": "1"})
    pool.add(a)
    assert pool.wants()
    pool.add(b)
    assert not pool.wants()  # at most its limit
    # Another file's test, or another environment: not this child.
    assert pool.take(["/s/test_c.py"], {"CUDA_VISIBLE_DEVICES": "0"}) == (None, [])
    taken, dismissed = pool.take(["/s/test_b.py"], {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert taken is None and dismissed == [b.child] and b.child.closed
    taken, dismissed = pool.take(["/s/test_a.py"], {"CUDA_VISIBLE_DEVICES": "0"})
    assert taken is a and dismissed == [] and not a.child.closed
    assert (pool.started, pool.taken) == (2, 1)


def test_the_pool_dismisses_what_the_session_end_leaves():
    pool = _early.Early(limit=3)
    kept = _early_child("/s/test_a.py", [], {})
    pool.add(kept)
    pool.open = False  # collection is over
    assert not pool.wants()  # none is started after collection
    assert pool.close() == [kept.child] and kept.child.closed
    assert pool.waiting == []
    assert not _early.Early(limit=0).wants()  # booting ahead is off


CONFTEST_MARKS = """
import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "gpu" in item.name:
            item.add_marker(pytest.mark.gpu(count=0))
"""


def test_a_file_whose_tests_were_spawned_before_gets_a_child_next_time(pytester):
    # The marker comes from the conftest, not the file's text: the first run cannot
    # guess; pytest's cache tells the next one, devices included (none here, where the
    # marker's default would be one of the two GPUs).
    pytester.makeconftest(CONFTEST_MARKS)
    pytester.makepyfile(test_marked="def test_on_gpu():\n    pass\n")
    first = pytester.runpytest_subprocess("--spawn-lookahead", "1")
    first.assert_outcomes(passed=1)
    first.stdout.no_fnmatch_line("*started while collecting*")
    second = pytester.runpytest_subprocess("--spawn-lookahead", "1")
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines(["1 child started while collecting (1 used)"])
    third = pytester.runpytest_subprocess("--no-spawn")  # runs nothing spawned
    third.assert_outcomes(passed=1)
    fourth = pytester.runpytest_subprocess("--spawn-lookahead", "1")
    fourth.stdout.fnmatch_lines(["1 child started while collecting (1 used)"])


class _Cache:
    def __init__(self) -> None:
        self.data: dict[str, object] = {}

    def get(self, key: str, default: object) -> object:
        return self.data.get(key, default)

    def set(self, key: str, value: object) -> None:
        self.data[key] = value


def test_what_is_remembered_is_what_each_files_first_spawned_test_needed(tmp_path):
    config = type("Config", (), {"cache": _Cache(), "rootpath": tmp_path})()
    a, b, c = (tmp_path / f"test_{n}.py" for n in "abc")
    budget = (True, 1, 2**30, "memory='1GiB'")
    _early.remember(config, {a: (True, 2, None, ""), b: budget}, [a, b, c])
    assert _early.remembered(config) == {"test_a.py": (True, 2, None, ""), "test_b.py": budget}
    _early.remember(config, {}, [b])  # b collected again, nothing of it spawned
    assert _early.remembered(config) == {"test_a.py": (True, 2, None, "")}  # a kept
    c.write_text("def test_c():\n    pass\n")
    known = _early.remembered(config)
    assert _early.guess(a, "gpu", known, tmp_path) == (True, 2, None, "")
    assert _early.guess(c, "gpu", known, tmp_path) is None
    c.write_text("import pytest\n\n@pytest.mark.gpu\ndef test_c():\n    pass\n")
    assert _early.guess(c, "gpu", {}, tmp_path) == (True, None, None, "")  # the default
    c.write_text("import pytest\n\n@pytest.mark.gpu(timeout=5, count=0)\ndef test_c():\n    pass\n")
    assert _early.guess(c, "gpu", {}, tmp_path) == (True, 0, None, "")  # its literal count
    c.write_text("import pytest\n\n@pytest.mark.gpu(count=N)\ndef test_c():\n    pass\n")
    assert _early.guess(c, "gpu", {}, tmp_path) == (True, None, None, "")
    # A record of an earlier version (marked, count) still reads, as no budget.
    config.cache.set(_early.SPAWNED_KEY, {"test_a.py": [True, 2]})
    assert _early.remembered(config) == {"test_a.py": (True, 2, None, "")}
    assert _early.guess(c, "gpux", {}, tmp_path) is None
