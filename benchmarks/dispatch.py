"""The dispatcher's own cost per test, as suites grow: it must stay flat.

Drives ``spawnrun.dispatch.Dispatcher`` through the deterministic simulator of
``tests/sim`` (no process is started) with suites of the shape fast mode runs most: files
of ``--per-file`` short tests, each file's tests forked from its template, on a machine
without GPUs, ``--jobs`` at once. Prints, for each size, the simulator's wall time and
the CPU time per test; the last column is that time against the smallest suite's (a
dispatcher whose steps walk every test or child it ever had grows with the suite: 1.0
means it does not).

    python benchmarks/dispatch.py
    python benchmarks/dispatch.py --sizes 1000 8000 --per-file 60 --jobs 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from sim.world import Spec  # noqa: E402 - the simulator lives beside the tests
from sim.world import World  # noqa: E402

from spawnrun.dispatch import events as ev  # noqa: E402


def suite(size: int, per_file: int) -> list[Spec]:
    specs = []
    for i in range(size):
        path = f"tests/test_{i // per_file}.py"
        test = ev.Test(f"{path}::test_{i}", need=None, template=f"tpl {path}")
        specs.append(Spec(test, duration=0.01, boot=0.05, exit_after=0.005))
    return specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 4000, 16000])
    parser.add_argument("--per-file", type=int, default=60)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    settings = ev.Settings(
        devices=(),
        capacity=(),
        per_gpu=1,
        jobs=args.jobs,
        lookahead=args.jobs,
        exit_grace=20.0,
        kill_grace=5.0,
        settle=10.0,
    )
    first = None
    print(f"{'tests':>7} {'wall s':>8} {'CPU ms/test':>12} {'vs smallest':>12}")
    for size in args.sizes:
        world = World(settings, suite(size, args.per_file))
        wall, cpu = time.perf_counter(), time.process_time()
        result = world.run()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert not result.stuck and len(result.ends) == size, "the simulated run lost tests"
        per = cpu / size * 1000
        first = first or per
        print(f"{size:>7} {wall:>8.2f} {per:>12.3f} {per / first:>11.2f}x", flush=True)


if __name__ == "__main__":
    main()
