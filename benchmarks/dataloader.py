"""A test that iterates torch's ``DataLoader`` with worker processes: its time under
spawnrun against plain pytest, side by side in one invocation.

Builds a one-file suite in a temporary folder: ``--tests`` tests, each iterating a
``DataLoader(num_workers=--workers)`` over a small dataset (one defined in the test
module, one inside the test itself, as projects write them). Runs it plain (spawnrun not
loaded), spawned (``--spawn-gpu``: every test in a fresh child) and in fast mode
(``--spawn-method forkserver``), ``--runs`` times each, and prints for each mode the
median of the tests' own time (pytest's ``call`` durations, from junitxml) and the
session's wall time, with both ratios to plain. Every run must pass every test.

A worker of a ``DataLoader`` is a process of multiprocessing's default start method. A
fresh interpreter on Linux forks it (it costs milliseconds); a child spawned by
multiprocessing had ``spawn`` forced as the process-wide method, and each worker
imported torch and the test module again (26-33 s for four workers on two cores). Since
spawnrun's children are fresh interpreters to multiprocessing (``proc._fresh``), the
workers fork in a spawned test as in plain pytest.

    python benchmarks/dataloader.py                 # CPU torch is enough
    python benchmarks/dataloader.py --workers 8 --runs 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from speed import run_session

SUITE = """
import torch
from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):
    def __len__(self):
        return 256
    def __getitem__(self, i):
        return torch.tensor([float(i)]) ** 2

def test_module_dataset_{i}():
    loader = DataLoader(Squares(), batch_size=32, num_workers=WORKERS)
    assert sum(float(b.sum()) for b in loader) == sum(float(i) ** 2 for i in range(256))

def test_local_dataset_{i}():
    class Local(Dataset):  # defined in the test: a spawn worker could not pickle it
        def __len__(self):
            return 64
        def __getitem__(self, i):
            return i
    loader = DataLoader(Local(), batch_size=8, num_workers=WORKERS)
    assert sorted(int(x) for b in loader for x in b) == list(range(64))
"""

MODES = {
    "plain": ["-p", "no:spawnrun"],
    "spawned": ["--spawn-gpu"],
    "fast": ["--spawn-gpu", "--spawn-method", "forkserver"],
}


def _call_seconds(junit: Path) -> float:
    """The tests' call time together, as pytest timed it (junitxml's case times hold
    setup, call and teardown; the suite's fixtures are trivial)."""
    cases = list(ET.parse(junit).iter("testcase"))
    return sum(float(c.get("time", "0")) for c in cases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=int, default=1, help="tests of each kind")
    parser.add_argument("--workers", type=int, default=4, help="num_workers of each loader")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0, help="per run (s)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="spawnrun-dataloader-"))
    body = SUITE.replace("WORKERS", str(args.workers))
    (root / "test_loader.py").write_text(
        "\n".join(body.replace("{i}", str(i)) for i in range(args.tests))
    )
    expected = 2 * args.tests
    print(f"suite: {expected} tests, DataLoader(num_workers={args.workers}), in {root}")
    results: dict[str, tuple[list[float], list[float]]] = {}
    for mode, extra in MODES.items():
        tests, walls = [], []
        for run in range(args.runs):
            junit = root / f"{mode}-{run}.xml"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            cmd += ["-p", "no:randomly", *extra, f"--junitxml={junit}", str(root)]
            start = time.perf_counter()
            out, err, code, timed_out = run_session(cmd, cwd=root, timeout=args.timeout)
            wall = time.perf_counter() - start
            if code != 0 or timed_out or f"{expected} passed" not in out:
                tail = "\n".join((out + err).strip().splitlines()[-15:])
                sys.exit(f"{mode} run {run}: rc {code}, timed out {timed_out}\n{tail}")
            tests.append(_call_seconds(junit))
            walls.append(wall)
        results[mode] = (tests, walls)
    base_test = statistics.median(results["plain"][0])
    base_wall = statistics.median(results["plain"][1])
    print(f"{'mode':8} {'tests (s)':>10} {'ratio':>7} {'session (s)':>12} {'ratio':>7}")
    for mode, (tests, walls) in results.items():
        test, wall = statistics.median(tests), statistics.median(walls)
        print(
            f"{mode:8} {test:10.2f} {test / base_test:6.2f}x {wall:12.2f} {wall / base_wall:6.2f}x"
        )


if __name__ == "__main__":
    main()
