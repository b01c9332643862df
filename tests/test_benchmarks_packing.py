"""benchmarks/stamps.py: what benchmarks/packing.py reads from its tests' stamps (pure)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
stamps = importlib.import_module("stamps")
Stamp = stamps.Stamp
GIB = stamps.GIB


def stamp(name, start, end, device="0", budget=None, total=None, free=None, pid=1, peak=None):
    budget = None if budget is None else int(budget * GIB)
    total = None if total is None else int(total * GIB)
    free = None if free is None else int(free * GIB)
    return Stamp(name, pid, start, end, (device,), budget, total, free, peak)


@pytest.mark.parametrize(
    "text, expected",
    [("2GiB", 2 * GIB), ("500MB", 500 * 10**6), ("1.5", int(1.5 * GIB)), (3, 3 * GIB)],
)
def test_parse_size(text, expected):
    assert stamps.parse_size(text) == expected


def test_parse_size_rejects_words():
    with pytest.raises(ValueError, match="lots"):
        stamps.parse_size("lots")


def test_parse_stamps_devices_budgets_and_a_torn_line():
    lines = [
        {"nodeid": "a", "pid": 5, "start": 1, "end": 2, "uuid": "GPU-ABC", "budget": "2147483648"},
        {"nodeid": "b", "pid": 6, "start": 1, "end": 2, "cvd": "0,1", "budget": None},
        {"nodeid": "c", "pid": 7, "start": 1, "end": 2, "total": 10, "free": 9},
    ]
    text = "\n".join(json.dumps(rec) for rec in lines) + '\n{"nodeid": "d", "sta'
    a, b, c = stamps.parse_stamps(text)
    assert (a.devices, a.budget, a.pid) == (("abc",), 2 * GIB, 5)
    assert (b.devices, b.budget) == (("0", "1"), None)
    assert (c.devices, c.total, c.free) == (("-",), 10, 9)


def test_at_once_counts_an_end_and_a_start_at_one_instant_as_no_overlap():
    found = stamps.at_once([stamp("a", 0, 2), stamp("b", 1, 3), stamp("c", 2, 4)])
    assert found == (2, 1.5)  # 6 s of tests over a 4 s span
    assert stamps.at_once([]) == (0, 0.0)


def test_overruns_budgets_plus_reserve_against_the_device():
    runs = [
        stamp("a", 0, 10, budget=4, total=10),
        stamp("b", 1, 10, budget=4, total=10),  # 2 x (4 + 1) = 10: fits exactly
        stamp("c", 2, 3, budget=1, total=10),  # 12 > 10
        stamp("d", 0, 10, device="1", budget=4, total=10),  # another device
    ]
    found, unknown = stamps.stamp_overruns(runs, GIB, {}, None)
    assert unknown == []
    assert [(o.device, o.at, o.nodeids) for o in found] == [("0", 2, ("a", "b", "c"))]
    assert found[0].demand == 12 * GIB and found[0].total == 10 * GIB


def test_an_unbudgeted_test_counts_as_the_whole_device_but_alone_is_fine():
    alone = [stamp("a", 0, 1), stamp("b", 1, 2, budget=70)]
    assert stamps.stamp_overruns(alone, GIB, {}, 80 * GIB) == ([], [])
    shared = [stamp("a", 0, 2), stamp("b", 1, 3, budget=1)]
    found, _ = stamps.stamp_overruns(shared, GIB, {"0": 80 * GIB}, None)
    assert [o.nodeids for o in found] == [("a", "b")]


def test_overruns_device_memory_from_stamps_then_nvml_then_declared():
    runs = [stamp("a", 0, 2, budget=4), stamp("b", 1, 3, budget=4)]  # 10 GiB asked
    assert stamps.stamp_overruns(runs, GIB, {}, None) == ([], ["0"])
    assert len(stamps.stamp_overruns(runs, GIB, {}, 9 * GIB)[0]) == 1
    assert stamps.stamp_overruns(runs, GIB, {"0": 10 * GIB}, 9 * GIB)[0] == []


def test_nvml_overruns_match_pids_to_stamps():
    runs = [stamp("a", 0, 1, budget=2, pid=10), stamp("b", 0, 1, pid=11)]
    peaks = {("u", 10): int(3.5 * GIB), ("u", 11): 50 * GIB, ("u", 99): 80 * GIB}
    found, matched = stamps.nvml_overruns(peaks, runs, GIB)
    assert matched == 2
    assert len(found) == 1 and found[0].startswith("a (pid 10) used 3.50 GiB")
    assert stamps.nvml_overruns({("u", 10): 3 * GIB}, runs, GIB) == ([], 1)


def test_torch_overruns():
    runs = [stamp("a", 0, 1, budget=1, peak=2 * GIB), stamp("b", 0, 1, budget=1, peak=GIB)]
    assert [line.split(":")[0] for line in stamps.torch_overruns(runs)] == ["a"]


def test_gaps_per_device_in_start_order():
    runs = [
        stamp("b", 3, 4),
        stamp("a", 0, 2.5),
        stamp("c", 0, 1, device="1"),
        stamp("d", 1.25, 2, device="1"),
    ]
    assert sorted(stamps.gaps(runs)) == [0.25, 0.5]


def test_overlaps_only_on_one_device():
    runs = [stamp("a", 0, 2), stamp("b", 2, 3), stamp("c", 1, 2, device="1"), stamp("d", 1.5, 4)]
    assert stamps.overlaps(runs) == [("0", "a", "d"), ("0", "d", "b")]  # in start order


def test_short_of_free():
    runs = [stamp("a", 0, 1, total=100, free=95), stamp("b", 0, 1, total=100, free=40)]
    assert [line.split(":")[0] for line in stamps.short_of_free(runs)] == ["b"]
