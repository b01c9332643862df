"""What a CUDA process costs a device beside its allocator, and how fast it gives it back.

Run on a GPU host (needs torch with CUDA and nvidia-ml-py)::

    python benchmarks/release.py -n 5

For each of ``-n`` fresh processes: the memory NVML lists for it after a first 512x512
matmul (the CUDA context and cuBLAS's workspace: what spawnrun's per-process reserve
covers), torch's reserved memory then, and the seconds until NVML no longer lists the
process after ``spawnrun.proc._probe.release_devices()`` (the child's release before its
session ends) against after the process exits. Prints medians; ``--json`` writes all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import os, sys, time
import torch
x = torch.randn(512, 512, device="cuda")
(x @ x).sum().item()
torch.cuda.synchronize()
print("ready", torch.cuda.memory_reserved(0), flush=True)
sys.stdin.readline()
if sys.argv[1] == "release":
    from spawnrun.proc import _probe
    t = time.monotonic()
    _probe.release_devices()
    print("released", time.monotonic() - t, flush=True)
    sys.stdin.readline()
"""


def listed(nvml, handle, pid: int) -> int | None:
    for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == pid:
            return int(proc.usedGpuMemory or 0)
    return None


def until_gone(nvml, handle, pid: int, limit: float = 10.0) -> float:
    start = time.monotonic()
    while listed(nvml, handle, pid) is not None:
        if time.monotonic() - start > limit:
            return float("inf")
        time.sleep(0.002)
    return time.monotonic() - start


def one(nvml, handle, how: str) -> dict[str, float]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    _, reserved = proc.stdout.readline().split()
    time.sleep(0.2)
    used = listed(nvml, handle, proc.pid) or 0
    start = time.monotonic()
    proc.stdin.write("\n")
    proc.stdin.flush()
    if how == "release":
        proc.stdout.readline()
        gone = until_gone(nvml, handle, proc.pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
    else:
        gone = until_gone(nvml, handle, proc.pid)
    proc.wait(timeout=60)
    return {
        "nvml_mib": used / 2**20,
        "torch_reserved_mib": int(reserved) / 2**20,
        "reserve_mib": (used - int(reserved)) / 2**20,
        "unlisted_s": gone,
        "from_s": time.monotonic() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    rows: dict[str, list[dict[str, float]]] = {"release": [], "exit": []}
    for _ in range(args.n):
        for how in rows:
            rows[how].append(one(pynvml, handle, how))
    for how, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        most = max(r["reserve_mib"] for r in runs)
        print(
            f"{how:8s} NVML per process {med['nvml_mib']:.0f} MiB, torch reserved "
            f"{med['torch_reserved_mib']:.0f} MiB, beside the allocator {med['reserve_mib']:.0f} "
            f"MiB (most {most:.0f}); unlisted {med['unlisted_s'] * 1000:.1f} ms after the "
            f"{'release' if how == 'release' else 'exit request'}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
