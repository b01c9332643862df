"""Eight ~2 s GPU tests, one GPU at a time vs all GPUs at once, in one invocation.

Run on a host with two or more GPUs, from the repository root:

    python benchmarks/gpu_scheduling.py

Prints both wall times, the ratio, and whether any two overlapping tests shared a GPU
(by device UUID).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = "tests/gpu/test_scheduling_gpu.py"


def run(extra: list[str]) -> tuple[float, list[dict[str, object]], str]:
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, SPAWNRUN_GPU_RECORDS=folder, SPAWNRUN_GPU_PARENT_INIT="0")
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            TESTS,
            "-k",
            "busy",
            "-q",
            *extra,
        ]
        start = time.monotonic()
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.monotonic() - start
        records = [json.loads(p.read_text()) for p in Path(folder).glob("*.json")]
        return wall, records, out.stdout.strip().splitlines()[-1]


def main() -> None:
    serial, _, serial_tail = run(["--spawn-jobs", "1"])
    parallel, records, parallel_tail = run([])
    print(f"one GPU at a time (--spawn-jobs 1): {serial:.1f} s  [{serial_tail}]")
    print(f"all GPUs at once (default):        {parallel:.1f} s  [{parallel_tail}]")
    print(f"speedup: {serial / parallel:.2f}x")
    shared = [
        (a["uuid"], a["pid"], b["pid"])
        for a, b in itertools.combinations(records, 2)
        if a["start"] < b["end"] and b["start"] < a["end"] and a["uuid"] == b["uuid"]
    ]
    overlaps = sum(
        1
        for a, b in itertools.combinations(records, 2)
        if a["start"] < b["end"] and b["start"] < a["end"]
    )
    print(
        f"distinct device UUIDs seen: {len({r['uuid'] for r in records})}; "
        f"overlapping pairs: {overlaps}; overlapping pairs on one device: {len(shared)}"
    )


if __name__ == "__main__":
    main()
