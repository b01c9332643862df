"""Multi-GPU scheduling with a conftest that asks CUDA at import, in one invocation.

Run on a host with two or more GPUs, from the repository root (spawnrun importable,
e.g. ``PYTHONPATH=$PWD PYTEST_ADDOPTS="-p spawnrun.plugin"`` as .ci/gpu/scheduling.sh):

    python benchmarks/gpu_scheduling.py

Builds a suite in a temporary folder whose conftest calls ``torch.cuda.is_available()``
at import (cuInit: in the pytest parent and in every child, before its test starts, as
GPU projects' conftests often do), then runs it three times, each with spawnrun's
default settings (booting ahead on):

1. the eight busy tests (~2 s of bf16 matmuls each) with ``--spawn-jobs 1``;
2. the same eight tests, default jobs (one child per GPU);
3. a mixed run: busy tests of ~0.5 s interleaved with ``@pytest.mark.gpu(count=0)`` tests
   and one ``count=2`` test, so children booted ahead for tests with and without devices
   alternate.

Every test records, in its child: ``CUDA_VISIBLE_DEVICES`` at conftest import and at the
test, the UUIDs torch sees (``torch.cuda.get_device_properties(i).uuid``),
``torch.cuda.device_count()`` and when its GPU work ran. Prints, over all three runs:

- wrong-device tests: the UUIDs a test saw are not those of the devices its
  ``CUDA_VISIBLE_DEVICES`` names (index -> UUID from ``nvidia-smi -L``, else NVML), or it
  saw another number of devices than it asked for;
- overlapping pairs on one UUID: two tests whose GPU work overlapped in time on a device;
- count=0 violations: a ``count=0`` test whose ``torch.cuda.device_count()`` is not 0;
- the speedup of run 2 over run 1 (wall time of the whole pytest run);

then a "targets" block with each target, the measured value and met/missed.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from speed import run_session
from speed import script_parser

BUSY_TESTS = 8
ZERO_TESTS = 3
SPEEDUP_TARGET = 1.8

CONFTEST = """
import json
import os
from pathlib import Path

import pytest
import torch

# At import, in the pytest parent and in every child: cuInit with the child's
# CUDA_VISIBLE_DEVICES as it is at that moment.
AVAILABLE_AT_IMPORT = {init}
VISIBLE_AT_IMPORT = os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture
def record(request):
    rec = {{
        "test": request.node.name,
        "pid": os.getpid(),
        "available_at_import": AVAILABLE_AT_IMPORT,
        "cvd_at_import": VISIBLE_AT_IMPORT,
        "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }}
    yield rec
    folder = os.environ.get("SCHED_RECORDS")
    if folder:
        (Path(folder) / (request.node.name + ".json")).write_text(json.dumps(rec))
"""

TESTS_HEAD = """
import os
import time

import pytest
import torch

BUSY_SECONDS = float(os.environ.get("SCHED_BUSY_SECONDS", "2.0"))


def _devices(record):
    record["device_count"] = torch.cuda.device_count()
    record["uuids"] = [
        str(torch.cuda.get_device_properties(i).uuid) for i in range(record["device_count"])
    ]


def _busy(record, devices):
    record["start"] = time.time()
    _devices(record)
    mats = []
    for d in range(devices):
        mats.append(torch.randn(8192, 8192, device=f"cuda:{d}", dtype=torch.bfloat16))
    while time.time() - record["start"] < BUSY_SECONDS:
        for _ in range(20):
            mats = [(a @ a).clamp_(-1, 1) for a in mats]
        for d in range(devices):
            torch.cuda.synchronize(d)
    record["end"] = time.time()
"""

BUSY = """

@pytest.mark.gpu
def test_busy_{i}(record):
    record["kind"] = "busy"
    _busy(record, 1)
"""

ZERO = """

@pytest.mark.gpu(count=0)
def test_nodevice_{i}(record):
    record["kind"] = "zero"
    record["start"] = record["end"] = time.time()
    record["device_count"] = torch.cuda.device_count()
    record["uuids"] = []
"""

PAIR = """

@pytest.mark.gpu(count=2)
def test_pair(record):
    record["kind"] = "pair"
    _busy(record, 2)
"""


def test_file() -> str:
    """Busy tests interleaved with count=0 tests, and the count=2 test in the middle."""
    parts = [TESTS_HEAD]
    zeros = iter(range(ZERO_TESTS))
    for i in range(BUSY_TESTS):
        parts.append(BUSY.format(i=i))
        if i % 3 == 0:
            z = next(zeros, None)
            if z is not None:
                parts.append(ZERO.format(i=z))
        if i == BUSY_TESTS // 2:
            parts.append(PAIR)
    return "".join(parts)


def expected_tests(mixed: bool) -> set[str]:
    names = {f"test_busy_{i}" for i in range(BUSY_TESTS)}
    if mixed:
        names |= {f"test_nodevice_{i}" for i in range(ZERO_TESTS)} | {"test_pair"}
    return names


def normalize(uuid: str) -> str:
    uuid = uuid.strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid


def device_map() -> tuple[dict[int, str], str]:
    """Physical index -> normalized UUID, from ``nvidia-smi -L`` (else NVML)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    found = {
        int(m.group(1)): normalize(m.group(2))
        for m in re.finditer(r"^GPU (\d+):.*\(UUID: (GPU-[^)]+)\)", out, re.MULTILINE)
    }
    if found:
        return found, "nvidia-smi -L"
    try:
        import pynvml  # type: ignore[import-not-found, unused-ignore]

        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            found[i] = normalize(uuid.decode() if isinstance(uuid, bytes) else uuid)
    except Exception:  # noqa: BLE001 - no NVML either: nothing to compare with
        return {}, "nothing (no nvidia-smi, no NVML)"
    return found, "NVML"


@dataclass
class Run:
    label: str
    wall: float
    tail: str
    passed: int
    records: list[dict[str, Any]]
    expected: set[str]
    #: test name -> spawnrun_devices from junitxml (spawnrun's own report).
    reported: dict[str, str] = field(default_factory=dict)


def run(
    label: str,
    folder: Path,
    extra: list[str],
    env_extra: dict[str, str],
    mixed: bool,
    timeout: float,
    logs: Path | None,
) -> Run:
    slug = re.sub(r"\W+", "_", label).strip("_")
    with tempfile.TemporaryDirectory() as records:
        junit = Path(records) / "junit.xml"
        env = dict(os.environ, SCHED_RECORDS=records, **env_extra)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-v",
            f"--junitxml={junit}",
            "test_sched.py",
            *extra,
        ]
        if not mixed:
            cmd += ["-k", "busy"]
        start = time.monotonic()
        stdout, stderr, _, timed_out = run_session(cmd, cwd=folder, env=env, timeout=timeout)
        out = stdout + stderr
        if timed_out:
            out += f"\nTIMED OUT after {timeout:.0f}s"
        wall = time.monotonic() - start
        if logs is not None:
            (logs / f"{slug}.txt").write_text(f"$ {shlex.join(cmd)}\n# wall {wall:.1f}s\n{out}")
        found = [json.loads(p.read_text()) for p in Path(records).glob("test_*.json")]
        reported = _reported_devices(junit)
    lines = out.strip().splitlines() or ["(no output)"]
    tail = lines[-1].strip(" =")
    found_passed = re.search(r"(\d+) passed", tail)
    passed = int(found_passed.group(1)) if found_passed else 0
    return Run(label, wall, tail, passed, found, expected_tests(mixed), reported)


def _reported_devices(junit: Path) -> dict[str, str]:
    try:
        tree = ET.parse(junit)
    except (OSError, ET.ParseError):
        return {}
    found = {}
    for case in tree.iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name") == "spawnrun_devices":
                found[case.get("name", "")] = prop.get("value", "")
    return found


def expected_uuids(cvd: str | None, devices: dict[int, str]) -> list[str] | None:
    """The UUIDs CUDA_VISIBLE_DEVICES names, or None if it names one we cannot map."""
    if not cvd:
        return []
    uuids = []
    for entry in cvd.split(","):
        entry = entry.strip()
        if entry.isdigit() and int(entry) in devices:
            uuids.append(devices[int(entry)])
        elif entry.lower().startswith("gpu-"):
            uuids.append(normalize(entry))
        else:
            return None
    return uuids


def wrong_device(rec: dict[str, Any], devices: dict[int, str]) -> str:
    """Why this device test ran on the wrong device(s), or ''."""
    want = 2 if rec.get("kind") == "pair" else 1
    expected = expected_uuids(rec.get("cvd"), devices)
    seen = [normalize(u) for u in rec.get("uuids", [])]
    if expected is None:
        return f"CUDA_VISIBLE_DEVICES={rec.get('cvd')!r} names a device not in the map"
    if len(expected) != want:
        return f"CUDA_VISIBLE_DEVICES={rec.get('cvd')!r}: not {want} device(s)"
    if rec.get("device_count") != want:
        return f"torch sees {rec.get('device_count')} device(s), asked for {want}"
    if sorted(seen) != sorted(expected):
        return (
            f"CUDA_VISIBLE_DEVICES={rec.get('cvd')!r} names {expected}, torch saw {seen} "
            f"(at conftest import: {rec.get('cvd_at_import')!r})"
        )
    return ""


def index_of(uuid: str, devices: dict[int, str]) -> str:
    for i, u in devices.items():
        if u == normalize(uuid):
            return str(i)
    return "?"


def check(runs: list[Run], devices: dict[int, str]) -> dict[str, int]:
    counts = dict(
        tests=0,
        wrong=0,
        overlaps=0,
        shared=0,
        zero_tests=0,
        zero_bad=0,
        missing=0,
        not_passed=0,
        report_mismatch=0,
    )
    for r in runs:
        print(f"\n{r.label}: {r.wall:.1f} s  [{r.tail}]")
        base = min((rec["start"] for rec in r.records if "start" in rec), default=0.0)
        for rec in sorted(r.records, key=lambda x: x.get("start", 0.0)):
            counts["tests"] += 1
            why = ""
            if rec.get("kind") == "zero":
                counts["zero_tests"] += 1
                if rec.get("device_count") != 0:
                    counts["zero_bad"] += 1
                    why = f"count=0 but torch sees {rec.get('device_count')} device(s)"
            elif "start" not in rec or "end" not in rec:
                counts["wrong"] += 1
                why = "no GPU work recorded (the test failed early?)"
            else:
                why = wrong_device(rec, devices)
                counts["wrong"] += bool(why)
            got = rec.get("cvd") or ""
            said = r.reported.get(rec["test"])
            if said is not None and said != got:
                counts["report_mismatch"] += 1
                why = (why + "; " if why else "") + f"spawnrun reported gpu {said!r}"
            seen = ",".join(index_of(u, devices) for u in rec.get("uuids", []))
            print(
                f"  {rec['test']:18} pid {rec['pid']:>7}  CUDA_VISIBLE_DEVICES={got!r:8} "
                f"(at import {rec.get('cvd_at_import')!r:8}) torch saw gpu [{seen}]"
                f"  {rec.get('start', base) - base:6.1f}-{rec.get('end', base) - base:5.1f}s"
                f"  {'WRONG: ' + why if why else 'ok'}"
            )
        names = {rec["test"] for rec in r.records}
        missing = r.expected - names
        counts["missing"] += len(missing)
        if missing:
            print(f"  no record from: {', '.join(sorted(missing))}")
        if r.passed != len(r.expected):
            counts["not_passed"] += len(r.expected) - r.passed
        busy = [rec for rec in r.records if rec.get("uuids") and "end" in rec]
        for a, b in itertools.combinations(busy, 2):
            if a["start"] < b["end"] and b["start"] < a["end"]:
                counts["overlaps"] += 1
                one = {normalize(u) for u in a["uuids"]} & {normalize(u) for u in b["uuids"]}
                if one:
                    counts["shared"] += 1
                    print(f"  SHARED: {a['test']} and {b['test']} overlapped on {sorted(one)}")
    return counts


def span(r: Run) -> float:
    busy = [rec for rec in r.records if "start" in rec and "end" in rec]
    if not busy:
        return 0.0
    return float(max(rec["end"] for rec in busy) - min(rec["start"] for rec in busy))


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--clean-conftest",
        action="store_true",
        help="the conftest leaves CUDA alone at import (to compare)",
    )
    parser.add_argument(
        "--pytest-args", default="", help="more arguments for every pytest run (one string)"
    )
    parser.add_argument("--skip-mixed", action="store_true", help="only the two busy runs")
    parser.add_argument(
        "--run-timeout", type=float, default=300, help="seconds one pytest run may take"
    )
    parser.add_argument("--logs", type=Path, help="folder for the output of every run")
    opts = parser.parse_args()
    extra = shlex.split(opts.pytest_args)
    if opts.logs:
        opts.logs.mkdir(parents=True, exist_ok=True)

    devices, source = device_map()
    print(f"devices ({source}): " + ", ".join(f"{i} {u}" for i, u in sorted(devices.items())))
    # nvidia-smi numbers devices in PCI bus order; CUDA does too only with PCI_BUS_ID
    # (the default, FASTEST_FIRST, agrees on hosts of identical GPUs).
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        print(f"parent's {name}: {os.environ.get(name, '(unset)')}")
    if len(devices) < 2:
        print("fewer than two GPUs: the speedup and exclusivity checks mean little here")
    root = Path(tempfile.mkdtemp(prefix="spawnrun-sched-"))
    try:
        folder = root / "suite"
        folder.mkdir()
        (folder / "pytest.ini").write_text("[pytest]\n")
        init = "None" if opts.clean_conftest else "torch.cuda.is_available()"
        (folder / "conftest.py").write_text(CONFTEST.format(init=init))
        (folder / "test_sched.py").write_text(test_file())
        what = "leaves CUDA alone" if opts.clean_conftest else "calls torch.cuda.is_available()"
        print(f"conftest {what} at import; extra pytest args: {extra or 'none'}")

        serial = run(
            "run 1: busy tests, one GPU at a time (--spawn-jobs 1)",
            folder,
            ["--spawn-jobs", "1", *extra],
            {},
            False,
            opts.run_timeout,
            opts.logs,
        )
        parallel = run(
            "run 2: busy tests, default settings (all GPUs)",
            folder,
            extra,
            {},
            False,
            opts.run_timeout,
            opts.logs,
        )
        runs = [serial, parallel]
        if not opts.skip_mixed:
            runs.append(
                run(
                    "run 3: mixed (0.5 s busy, count=0, count=2), default settings",
                    folder,
                    extra,
                    {"SCHED_BUSY_SECONDS": "0.5"},
                    True,
                    opts.run_timeout,
                    opts.logs,
                )
            )
        counts = check(runs, devices)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    speedup = serial.wall / parallel.wall if parallel.wall else 0.0
    span_speedup = span(serial) / span(parallel) if span(parallel) else 0.0
    print("\ncounts:")
    print(f"  tests recorded: {counts['tests']}")
    print(f"  wrong-device tests: {counts['wrong']}")
    print(
        f"  overlapping pairs on one UUID: {counts['shared']} "
        f"(of {counts['overlaps']} overlapping pairs)"
    )
    print(f"  count=0 violations: {counts['zero_bad']} (of {counts['zero_tests']} count=0 tests)")
    print(
        f"  tests without a record: {counts['missing']}; tests not passed: {counts['not_passed']}"
    )
    print(f"  spawnrun's reported device differs from the child's: {counts['report_mismatch']}")
    print(
        f"  speedup: {speedup:.2f}x ({serial.wall:.1f} s / {parallel.wall:.1f} s); "
        f"first GPU work to last: {span(serial):.1f} s / {span(parallel):.1f} s = "
        f"{span_speedup:.2f}x"
    )

    print("\ntargets:")
    verdict = {True: "met", False: "MISSED"}
    rows = [
        ("(d) wrong-device tests == 0", counts["wrong"], counts["wrong"] == 0),
        ("(d) overlapping pairs on one UUID == 0", counts["shared"], counts["shared"] == 0),
    ]
    if not opts.skip_mixed:
        ok = counts["zero_bad"] == 0 and counts["zero_tests"] > 0
        rows.append(("(d) count=0 violations == 0", counts["zero_bad"], ok))
    everything = counts["missing"] + counts["not_passed"]
    rows.append(("(d) every test passed and recorded", everything, everything == 0))
    for label, value, ok in rows:
        print(f"  {label}: {value} -> {verdict[ok]}")
    print(
        f"  (d) speedup, 8 busy tests, all GPUs vs --spawn-jobs 1 >= {SPEEDUP_TARGET}x: "
        f"{speedup:.2f}x -> {verdict[speedup >= SPEEDUP_TARGET]}"
    )


if __name__ == "__main__":
    main()
