"""Pure computations on the stamps that benchmarks/packing.py's tests write (no processes).

A stamp is one JSON line a test appended: node id, pid, start and end wall-clock times of
its body, ``CUDA_VISIBLE_DEVICES``, ``SPAWNRUN_GPU_BUDGET``, its CUDA device's UUID, the
free and total memory at its start and torch's reserved peak at its end (the last four
only on CUDA). Unit-tested in tests/test_benchmarks_packing.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gpu_scheduling import normalize

GIB = 1 << 30
FREE_AT_START = 0.9


@dataclass(frozen=True)
class Stamp:
    nodeid: str
    pid: int
    start: float
    end: float
    #: The device(s) the test ran on: its CUDA device's UUID (normalized), else the
    #: entries of its CUDA_VISIBLE_DEVICES, else "-" (no device named).
    devices: tuple[str, ...]
    #: SPAWNRUN_GPU_BUDGET (bytes per device); None: the test had the device alone.
    budget: int | None = None
    total: int | None = None
    free: int | None = None
    peak_reserved: int | None = None


def parse_size(text: str | float) -> int:
    """Bytes from ``2GiB``, ``500MB``, ``1.5`` (GiB) and the like."""
    if isinstance(text, (int, float)):
        return int(text * GIB)
    found = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not found:
        raise ValueError(f"not a size: {text!r}")
    unit = (found.group(2) or "GiB").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    scale.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})
    return int(float(found.group(1)) * scale[unit])


def parse_stamps(text: str) -> list[Stamp]:
    """Stamps from JSON lines; a line that does not parse (a torn last write) is skipped."""
    stamps = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
            start, end = float(rec["start"]), float(rec["end"])
        except (ValueError, KeyError, TypeError):
            continue
        if rec.get("uuid"):
            devices: tuple[str, ...] = (normalize(str(rec["uuid"])),)
        elif rec.get("cvd"):
            devices = tuple(d.strip() for d in str(rec["cvd"]).split(",") if d.strip())
        else:
            devices = ("-",)
        budget = rec.get("budget")
        stamps.append(
            Stamp(
                str(rec.get("nodeid", "?")),
                int(rec.get("pid", 0)),
                start,
                end,
                devices or ("-",),
                int(float(budget)) if budget not in (None, "") else None,
                _int_or_none(rec.get("total")),
                _int_or_none(rec.get("free")),
                _int_or_none(rec.get("peak_reserved")),
            )
        )
    return stamps


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _sweep(stamps: list[Stamp]) -> list[tuple[float, int, int]]:
    """(time, +1 start / -1 end, index) in time order, ends before starts at one instant."""
    events = [(s.start, 1, i) for i, s in enumerate(stamps)]
    events += [(s.end, -1, i) for i, s in enumerate(stamps)]
    return sorted(events, key=lambda e: (e[0], e[1]))


def at_once(stamps: list[Stamp]) -> tuple[int, float]:
    """Tests running at once: the most at any instant, and the mean over the run's span
    (the sum of the tests' durations over the time from the first start to the last end)."""
    if not stamps:
        return 0, 0.0
    most = now = 0
    for _, step, _ in _sweep(stamps):
        now += step
        most = max(most, now)
    span = max(s.end for s in stamps) - min(s.start for s in stamps)
    busy = sum(s.end - s.start for s in stamps)
    return most, (busy / span if span > 0 else float(most))


def by_device(stamps: list[Stamp]) -> dict[str, list[Stamp]]:
    found: dict[str, list[Stamp]] = {}
    for s in stamps:
        for d in s.devices:
            found.setdefault(d, []).append(s)
    return found


@dataclass(frozen=True)
class Overrun:
    device: str
    at: float
    #: What the tests running at that instant asked for in all (budget + reserve each; an
    #: unbudgeted test counts as the whole device) and the device's memory.
    demand: int
    total: int
    nodeids: tuple[str, ...]


def stamp_overruns(
    stamps: list[Stamp], reserve: int, capacity: dict[str, int], default: int | None
) -> tuple[list[Overrun], list[str]]:
    """Instants (a test's start) where tests running together on one device ask for more
    than its memory; and the devices that could not be checked (memory unknown).

    A device's memory: the largest ``total`` a stamp on it recorded, else ``capacity``
    (NVML's, by device), else ``default`` (declared). A test alone is never an overrun.
    """
    found: list[Overrun] = []
    unknown: list[str] = []
    for device, group in sorted(by_device(stamps).items()):
        totals = [s.total for s in group if s.total]
        total = max(totals) if totals else capacity.get(device, default)
        if not total:
            unknown.append(device)
            continue
        running: set[int] = set()
        for t, step, i in _sweep(group):
            if step < 0:
                running.discard(i)
                continue
            running.add(i)
            if len(running) < 2:
                continue
            demand = sum(_demand(group[j], total, reserve) for j in running)
            if demand > total:
                names = tuple(sorted(group[j].nodeid for j in running))
                found.append(Overrun(device, t, demand, total, names))
    return found, unknown


def _demand(s: Stamp, total: int, reserve: int) -> int:
    return total if s.budget is None else s.budget + reserve


def nvml_overruns(
    peaks: dict[tuple[str, int], int], stamps: list[Stamp], reserve: int
) -> tuple[list[str], int]:
    """Test children whose NVML memory on a device exceeded their budget plus the reserve,
    and how many of NVML's (device, pid) pairs belong to a stamped test (0 with processes
    seen means the pids do not match: another PID namespace, say)."""
    budgets = {s.pid: s for s in stamps}
    found = []
    matched = 0
    for (device, pid), used in sorted(peaks.items()):
        stamp = budgets.get(pid)
        if stamp is None:
            continue
        matched += 1
        if stamp.budget is not None and used > stamp.budget + reserve:
            found.append(
                f"{stamp.nodeid} (pid {pid}) used {used / GIB:.2f} GiB on {device}, "
                f"budget {stamp.budget / GIB:.2f} GiB + reserve {reserve / GIB:.2f} GiB"
            )
    return found, matched


def torch_overruns(stamps: list[Stamp]) -> list[str]:
    """Tests whose torch reserved peak, measured in the test, exceeded their budget."""
    return [
        f"{s.nodeid}: torch reserved {s.peak_reserved / GIB:.2f} GiB, budget {s.budget / GIB:.2f}"
        for s in stamps
        if s.budget is not None and s.peak_reserved is not None and s.peak_reserved > s.budget
    ]


def gaps(stamps: list[Stamp]) -> list[float]:
    """On each device, from one test's end to the next test's start (tests in start order):
    the start-to-start gap minus the first test's body."""
    found = []
    for group in by_device(stamps).values():
        ordered = sorted(group, key=lambda s: s.start)
        found += [b.start - a.end for a, b in zip(ordered, ordered[1:], strict=False)]
    return found


def overlaps(stamps: list[Stamp]) -> list[tuple[str, str, str]]:
    """Pairs of tests whose bodies overlapped in time on one device: (device, a, b)."""
    found = []
    for device, group in sorted(by_device(stamps).items()):
        ordered = sorted(group, key=lambda s: s.start)
        for i, a in enumerate(ordered):
            for b in ordered[i + 1 :]:
                if b.start < a.end:
                    found.append((device, a.nodeid, b.nodeid))
    return found


def short_of_free(stamps: list[Stamp], share: float = FREE_AT_START) -> list[str]:
    """Tests that found less than ``share`` of their device free at their start."""
    return [
        f"{s.nodeid}: {s.free / GIB:.1f} of {s.total / GIB:.1f} GiB free"
        for s in stamps
        if s.free is not None and s.total and s.free < share * s.total
    ]
