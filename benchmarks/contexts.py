"""The floor under per-test isolation on one GPU: how fast the driver creates CUDA contexts.

Every isolated test that uses CUDA creates a context of its own; ``pytest -n 8`` creates
eight in all. This script forks N children, each from a process that imported torch but
never initialized CUDA (as fast mode's template does), at most ``--at-once`` alive at a
time; each child creates its context (``torch.zeros(1, device="cuda")``, synchronized),
runs one 512x512 matmul (cuBLAS's handle, as a test's first op does), then frees its
context (``torch.cuda.empty_cache``, ``cuDevicePrimaryCtxReset``, as spawnrun's children do
before "done") and exits. Printed per level of concurrency: wall for N contexts, contexts
per second, and the median time a child spent creating its context.

    python benchmarks/contexts.py -n 32 --at-once 1 2 4 8      # on the H200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def driver_child(write_fd: int, reset: bool) -> None:
    """The driver alone (no torch, no CUDA runtime): cuInit, the primary context, one
    allocation; where the time goes that torch's own start adds to it."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    start = time.perf_counter()
    device, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    assert cuda.cuInit(0) == 0
    assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0
    created = time.perf_counter()
    assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)) == 0
    assert cuda.cuCtxSynchronize() == 0
    worked = time.perf_counter()
    if reset:
        cuda.cuMemFree_v2(ptr)
        cuda.cuDevicePrimaryCtxRelease_v2(device)
        cuda.cuDevicePrimaryCtxReset_v2(device)
    freed = time.perf_counter()
    os.write(write_fd, json.dumps([created - start, worked - created, freed - worked]).encode())
    os._exit(0)


def child(write_fd: int, reset: bool) -> None:
    if DRIVER_ONLY:
        driver_child(write_fd, reset)
    import torch

    from spawnrun.proc import _probe

    start = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    created = time.perf_counter()
    a = torch.randn(512, 512, device="cuda")
    (a @ a).sum().item()
    worked = time.perf_counter()
    if reset:
        _probe.release_devices()
    freed = time.perf_counter()
    os.write(write_fd, json.dumps([created - start, worked - created, freed - worked]).encode())
    os._exit(0)


DRIVER_ONLY = False


def level(n: int, at_once: int, reset: bool) -> dict[str, float]:
    running: dict[int, int] = {}
    times: list[list[float]] = []
    started = 0
    begin = time.perf_counter()
    while started < n or running:
        while started < n and len(running) < at_once:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                child(w, reset)
            os.close(w)
            running[pid] = r
            started += 1
        pid, _ = os.wait()
        fd = running.pop(pid)
        data = os.read(fd, 4096)
        os.close(fd)
        if data:
            times.append(json.loads(data))
    wall = time.perf_counter() - begin
    return {
        "at_once": at_once,
        "wall_s": wall,
        "contexts_per_s": n / wall,
        "create_median_s": statistics.median(t[0] for t in times),
        "matmul_median_s": statistics.median(t[1] for t in times),
        "free_median_s": statistics.median(t[2] for t in times),
        "ok": len(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=32, help="contexts per level (32)")
    parser.add_argument("--at-once", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--no-reset", action="store_true", help="exit without freeing first")
    parser.add_argument("--out", help="JSON results")
    parser.add_argument(
        "--driver-only",
        action="store_true",
        help="the driver's own context (ctypes, no torch): cuInit, primary context, 1 MiB",
    )
    opts = parser.parse_args()
    global DRIVER_ONLY
    DRIVER_ONLY = opts.driver_only
    import torch  # in the template, before any fork; CUDA stays uninitialized

    assert not torch.cuda.is_initialized()
    rows = [level(opts.n, k, not opts.no_reset) for k in opts.at_once]
    print(f"{'at once':>8} {'wall':>7} {'ctx/s':>6} {'create':>7} {'matmul':>7} {'free':>6}  ok")
    for r in rows:
        print(
            f"{r['at_once']:>8} {r['wall_s']:>6.2f}s {r['contexts_per_s']:>6.2f} "
            f"{r['create_median_s']:>6.3f}s {r['matmul_median_s']:>6.3f}s "
            f"{r['free_median_s']:>5.3f}s  {r['ok']}/{opts.n}"
        )
    if opts.out:
        Path(opts.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
