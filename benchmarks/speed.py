"""Per-test overhead of isolation: plain pytest, pytest-forked, and spawnrun's modes.

Builds synthetic suites in a temporary folder and runs each, in one invocation, with:
plain pytest; pytest-forked (``--forked``); spawnrun spawning a fresh child per test
with nothing booted ahead; spawnrun with one child booted ahead; and spawnrun's
zygote (``--spawn-method forkserver``, torch preloaded). All spawnrun modes run one
child at a time (``--spawn-jobs 1``), as pytest-forked does. Prints, per suite and
mode, the median wall time over the repetitions, the per-test overhead
((mode - plain) / N) and its ratio to pytest-forked's overhead.

    python benchmarks/speed.py               # CPU: N trivial torch tests, N tests of ~0.5 s
    python benchmarks/speed.py --gpu         # adds CUDA suites, the CUDA-context floor and
                                             # the parent's GPU memory (nvidia-smi)

Needs pytest-forked, which is broken on pytest 9.2 (its report cannot be serialized):
run it where pytest < 9.2 (see README, Performance).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SUITES = {
    "trivial": """
import torch

def test_trivial_{i}():
    assert torch.ones(2).sum().item() == 2.0
""",
    "work-0.5s": """
import time
import torch

def test_work_{i}():
    end = time.monotonic() + 0.5
    a = torch.ones(64, 64)
    while time.monotonic() < end:
        a = (a @ a).clamp_(-1, 1)
""",
    "cuda-trivial": """
import torch

def test_cuda_{i}():
    assert torch.ones(1024, device="cuda").sum().item() == 1024.0
""",
    "cuda-work-0.5s": """
import time
import torch

def test_cuda_work_{i}():
    a = torch.ones(2048, 2048, device="cuda")
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
""",
}

NO_SPAWNRUN = ["-p", "no:spawnrun"]
SPAWN = ["--spawn-gpu", "--spawn-jobs", "1"]
MODES = {
    "plain": NO_SPAWNRUN,
    "pytest-forked": [*NO_SPAWNRUN, "--forked"],
    "spawnrun spawn": [*SPAWN, "--spawn-lookahead", "0"],
    "spawnrun spawn+lookahead": [*SPAWN, "--spawn-lookahead", "1"],
    "spawnrun forkserver": [*SPAWN, "--spawn-method", "forkserver", "--spawn-preload", "torch"],
}

FLOOR = """
import time, torch
t = time.perf_counter()
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
print(time.perf_counter() - t)
"""


def make_suite(root: Path, name: str, n: int) -> Path:
    folder = root / name.replace(".", "_")
    folder.mkdir()
    (folder / "conftest.py").write_text("")
    for i in range(n):
        (folder / f"test_{i:03d}.py").write_text(SUITES[name].format(i=i))
    return folder


def run(folder: Path, args: list[str]) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder), *args]
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = out.stdout.strip().splitlines()
    return wall, lines[-1] if lines else out.stderr.strip()[-200:]


class ParentGpuMemory:
    """Samples nvidia-smi for the compute processes of pytest parents we started."""

    def __init__(self) -> None:
        self.max_mib = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            out = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            ).stdout
            parents = _pytest_parents(me)
            for line in out.splitlines():
                pid, _, used = line.partition(",")
                if pid.strip().isdigit() and int(pid) in parents:
                    self.max_mib = max(self.max_mib, int(used.strip().split()[0]))
            self.samples += 1
            time.sleep(0.2)

    def __enter__(self) -> ParentGpuMemory:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _pytest_parents(me: int) -> set[int]:
    """Direct children of this script: the pytest parents (not their test children)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                found.add(int(entry.name))
    return found


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=20, help="tests per suite (default 20)")
    parser.add_argument("-r", "--repeat", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--gpu", action="store_true", help="also the CUDA suites")
    parser.add_argument("--suites", nargs="*", help="only these suites")
    parser.add_argument("--modes", nargs="*", help="only these modes (plain always runs)")
    opts = parser.parse_args()
    names = opts.suites or (list(SUITES) if opts.gpu else ["trivial", "work-0.5s"])
    root = Path(tempfile.mkdtemp(prefix="spawnrun-bench-"))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, N={opts.n}, {opts.repeat} reps")
    try:
        if opts.gpu:
            floors = [
                float(
                    subprocess.run(
                        [sys.executable, "-c", FLOOR], capture_output=True, text=True, check=True
                    ).stdout
                )
                for _ in range(opts.repeat)
            ]
            floor = statistics.median(floors)
            print(
                f"CUDA-context floor (first CUDA op in a fresh process that imported torch): "
                f"{floor * 1000:.0f} ms"
            )
        for name in names:
            folder = make_suite(root, name, opts.n)
            medians: dict[str, float] = {}
            tails: dict[str, str] = {}
            modes = {
                m: a
                for m, a in MODES.items()
                if not opts.modes or m in opts.modes or m in ("plain", "pytest-forked")
            }
            gpu_suite = opts.gpu and name.startswith("cuda")
            mem = ParentGpuMemory() if gpu_suite else _Nothing()
            for mode, args in modes.items():
                # Only spawnrun's parents must hold no GPU memory: plain pytest and
                # pytest-forked run CUDA in (or forked from) their own process.
                sampling = mem if mode.startswith("spawnrun") else _Nothing()
                walls = []
                with sampling:
                    for _ in range(opts.repeat):
                        wall, tail = run(folder, args)
                        walls.append(wall)
                medians[mode] = statistics.median(walls)
                tails[mode] = tail
            plain = medians["plain"]
            forked = (medians["pytest-forked"] - plain) / opts.n
            print(f"\nsuite {name!r}:")
            print(
                f"  {'mode':26} {'median':>8} {'per-test overhead':>18} {'vs forked':>10}  result"
            )
            for mode, median in medians.items():
                over = (median - plain) / opts.n
                ratio = f"{over / forked:.1f}x" if mode not in ("plain",) and forked > 0 else "-"
                print(
                    f"  {mode:26} {median:7.2f}s {over * 1000:15.0f} ms {ratio:>10}  {tails[mode]}"
                )
            if gpu_suite and "spawnrun forkserver" in medians:
                fs = (medians["spawnrun forkserver"] - plain) / opts.n
                print(f"  forkserver overhead / CUDA-context floor: {fs / floor:.2f}x")
                print(
                    f"  spawnrun's pytest parent, GPU memory, max over {mem.samples} samples: "
                    f"{mem.max_mib} MiB"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)


class _Nothing:
    samples = 0
    max_mib = 0

    def __enter__(self) -> _Nothing:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


if __name__ == "__main__":
    main()
