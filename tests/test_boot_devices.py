"""A child's devices and environment are final before any user code runs in it.

End to end, in every way a child can start (booted ahead or at its turn, spawned or
forked from the zygote): a conftest that initializes CUDA at import must see the
test's own ``CUDA_VISIBLE_DEVICES``, and environment changes made in the parent by
earlier tests reach later spawned tests.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from itertools import combinations
from pathlib import Path

import pytest

# Like real CUDA, the fake reads CUDA_VISIBLE_DEVICES once, when the driver initializes,
# and never again. As in real torch, is_available() and device_count() initialize the
# driver (cuInit) without making is_initialized() true; only _lazy_init() (any tensor
# on the device) does. Its own name: tests/conftest.py's fake_torch stays as it is.
RECORDING_TORCH = {
    "torch/__init__.py": (
        "from torch import cuda\n"
        "def zeros(n, device='cpu'):\n"
        "    if str(device).startswith('cuda'):\n"
        "        cuda._lazy_init()\n"
        "    return [0] * n\n"
    ),
    "torch/cuda.py": '''
import os

_UNSET = object()
_visible = _UNSET
_context = False


def _driver_init():
    global _visible
    if _visible is _UNSET:
        _visible = os.environ.get("CUDA_VISIBLE_DEVICES")


def _count():
    if _visible is None:
        return 2
    return len([d for d in _visible.split(",") if d])


def is_available():
    _driver_init()
    return _count() > 0


def device_count():
    _driver_init()
    return _count()


def _lazy_init():
    global _context
    _driver_init()
    if not _count():
        raise RuntimeError("No CUDA GPUs are available")
    _context = True


def is_initialized():
    return _context


def _is_in_bad_fork():
    return False


def memory_reserved(i):
    return 0


def driver_initialized():
    return _visible is not _UNSET


def visible_at_init():
    """CUDA_VISIBLE_DEVICES as the driver read it when it initialized."""
    if _visible is _UNSET:
        raise RuntimeError("the fake CUDA driver is not initialized")
    return _visible
''',
}

# The conftest touches CUDA at import, in every process, as many real ones do. Its
# sleep makes each child boot slower than the parent gets to its turn, so the parent
# dispatches children that are still booting. The hook stands in for spawnrun's probe
# of libcuda (has cuInit run?), which cannot see a fake driver.
DEVICE_CONFTEST = """
import json, os, re, time
import pytest
import spawnrun
import torch

if spawnrun.is_child():
    time.sleep(1.0)
torch.cuda.is_available()


def pytest_spawnrun_device_state(config):
    return "the fake CUDA driver is initialized" if torch.cuda.driver_initialized() else None


@pytest.fixture(autouse=True)
def _record(request):
    start = time.time()
    yield
    row = {
        "nodeid": request.node.nodeid,
        "name": request.node.name,
        "visible_at_init": torch.cuda.visible_at_init(),
        "env": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pid": os.getpid(),
        "start": start,
        "end": time.time(),
    }
    name = re.sub(r"\\W", "_", request.node.nodeid) + ".json"
    with open(os.path.join(os.environ["SPAWNRUN_DEMO_RECORDS"], name), "w") as f:
        json.dump(row, f)
"""

DEVICE_TESTS = """
import os, time
import pytest
import torch


def check(spawned=True):
    at_init, given = torch.cuda.visible_at_init(), os.environ.get("CUDA_VISIBLE_DEVICES")
    assert at_init == given
    if spawned:
        if torch.cuda.device_count():
            torch.zeros(2, device="cuda")  # in a child only: no CUDA context in the parent
        time.sleep(0.3)  # long enough for the children on the two GPUs to overlap


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(3))
def test_one(i):
    check()


def test_in_process():
    check(spawned=False)


@pytest.mark.gpu(count=0)
@pytest.mark.parametrize("i", range(2))
def test_none(i):
    check()


@pytest.mark.gpu(count=2)
def test_two():
    check()
"""

MODES = {
    "spawn-default-lookahead": [],
    "spawn-lookahead-3": ["--spawn-lookahead", "3"],
    "forkserver": ["--spawn-method", "forkserver", "--spawn-preload", "torch"],
}


def _junit_devices(path: Path) -> dict[str, str | None]:
    """Test name -> its ``spawnrun_devices`` property in the parent's junitxml (or None)."""
    found: dict[str, str | None] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        found[case.get("name", "")] = props.get("spawnrun_devices")
    return found


@pytest.mark.parametrize("args", list(MODES.values()), ids=list(MODES))
def test_cuda_initialized_at_import_sees_the_tests_own_devices(pytester, monkeypatch, args):
    for name, text in RECORDING_TORCH.items():
        path = pytester.path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    pytester.makeconftest(DEVICE_CONFTEST)
    pytester.makepyfile(test_devices=DEVICE_TESTS)
    records = pytester.mkdir("records")
    monkeypatch.setenv("SPAWNRUN_DEMO_RECORDS", str(records))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("SPAWNRUN_CHILD", raising=False)
    xml = pytester.path / "out.xml"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-v", f"--junitxml={xml}", *args
    )
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    result.assert_outcomes(passed=7)

    rows = {r["name"]: r for r in (json.loads(p.read_text()) for p in records.iterdir())}
    assert len(rows) == 7
    junit = _junit_devices(xml)
    for name, row in rows.items():
        # What CUDA saw at import is what the test was given, and what the report says.
        assert row["visible_at_init"] == row["env"], name
        assert (row["visible_at_init"] or None) == junit[name], name
    for i in range(3):
        assert rows[f"test_one[{i}]"]["visible_at_init"] in ("0", "1")
    for i in range(2):
        assert rows[f"test_none[{i}]"]["visible_at_init"] == ""  # hidden, not inherited
    assert sorted(rows["test_two"]["visible_at_init"].split(",")) == ["0", "1"]  # any order
    assert rows["test_in_process"]["visible_at_init"] is None  # the parent's own
    result.stdout.fnmatch_lines(["*::test_two PASSED [[]gpu [01],[01][]]*"])
    result.stdout.no_fnmatch_line("*::test_none*[[]gpu*")

    # One process per spawned test, none of them the parent.
    pids = [r["pid"] for r in rows.values()]
    assert len(set(pids)) == 7
    # Tests that ran at the same time never shared a device.
    held = [r for r in rows.values() if r["visible_at_init"]]
    for a, b in combinations(held, 2):
        if a["start"] < b["end"] and b["start"] < a["end"]:
            shared = set(a["visible_at_init"].split(",")) & set(b["visible_at_init"].split(","))
            assert not shared, (a, b)


ENV_LEAKER = """
import os


def test_leaks_environment():
    # Deliberately not undone: later tests see it, as they would in one process.
    os.environ["SPAWNRUN_DEMO_FLAG"] = "on"
    del os.environ["SPAWNRUN_DEMO_GONE"]
"""

ENV_READER = """
import json, os
import pytest

# A child booted ahead may import this before the parent's change: recorded, not asserted.
AT_IMPORT = os.environ.get("SPAWNRUN_DEMO_FLAG")


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(3))
def test_sees_the_parents_environment(i):
    row = {
        "at_import": AT_IMPORT,
        "flag": os.environ.get("SPAWNRUN_DEMO_FLAG"),
        "gone": os.environ.get("SPAWNRUN_DEMO_GONE"),
    }
    with open(os.path.join(os.environ["SPAWNRUN_DEMO_RECORDS"], f"{i}.json"), "w") as f:
        json.dump(row, f)
    assert row["flag"] == "on"
    assert row["gone"] is None
"""


@pytest.mark.parametrize(
    "args",
    [["--spawn-lookahead", "2"], ["--spawn-lookahead", "2", "--spawn-method", "forkserver"]],
    ids=["spawn", "forkserver"],
)
def test_environment_changed_by_an_earlier_test_reaches_children(pytester, monkeypatch, args):
    # test_a_* collects before test_b_*: its children boot ahead while test_a runs.
    pytester.makepyfile(test_a_leaks=ENV_LEAKER, test_b_reads=ENV_READER)
    records = pytester.mkdir("records")
    monkeypatch.setenv("SPAWNRUN_DEMO_RECORDS", str(records))
    monkeypatch.setenv("SPAWNRUN_DEMO_GONE", "here before the run")
    monkeypatch.delenv("SPAWNRUN_DEMO_FLAG", raising=False)
    monkeypatch.delenv("SPAWNRUN_CHILD", raising=False)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    result.assert_outcomes(passed=4)
    rows = [json.loads((records / f"{i}.json").read_text()) for i in range(3)]
    assert [(r["flag"], r["gone"]) for r in rows] == [("on", None)] * 3
    assert {r["at_import"] for r in rows} <= {None, "on"}


# A child whose boot touches no device boots while the test before it runs alone there.
ALONE_TESTS = """
import json, os, time
import pytest
import spawnrun

IMPORTED = time.time()
if spawnrun.is_child():
    time.sleep(1.0)  # a slow boot (torch and the library, in a real suite)


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(4))
def test_alone(i):
    start = time.time()
    time.sleep(1.0)
    row = {"i": i, "imported": IMPORTED, "start": start, "end": time.time(),
           "env": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid()}
    with open(os.path.join(os.environ["SPAWNRUN_DEMO_RECORDS"], f"{i}.json"), "w") as f:
        json.dump(row, f)
"""


def test_the_next_exclusive_test_boots_while_the_one_before_runs(pytester, monkeypatch):
    """Four tests alone on one GPU: once the file's first boot showed it touches no
    device, the next children boot (unclaimed) while the test before runs, and each
    starts once the device is free; none overlaps another. Before, a child held its
    claim from its start, so each boot began only after the test before had ended."""
    pytester.makepyfile(test_alone=ALONE_TESTS)
    records = pytester.mkdir("records")
    monkeypatch.setenv("SPAWNRUN_DEMO_RECORDS", str(records))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--spawn-gpus",
        "0,",
        "--spawn-jobs",
        "2",
        "--spawn-lookahead",
        "2",
    )
    result.assert_outcomes(passed=4)
    rows = sorted((json.loads(p.read_text()) for p in records.iterdir()), key=lambda r: r["start"])
    assert [r["env"] for r in rows] == ["0"] * 4
    for before, after in zip(rows, rows[1:], strict=False):
        assert before["end"] <= after["start"], (before, after)  # alone
    # From the third on, each child had booted (imported its file) before the test
    # before it ended (the second may boot before the file's first boot is known). How
    # soon it then starts depends on the machine's load, so only the order is asserted.
    gaps = [round(a["start"] - b["end"], 2) for b, a in zip(rows, rows[1:], strict=False)]
    booted_before = [a["imported"] < b["end"] for b, a in zip(rows, rows[1:], strict=False)]
    assert booted_before[1:] == [True, True], (gaps, rows)
