"""JAX's compilations in a test's own process: each of the ``--spawn-jax-cache`` modes
against plain pytest, side by side in one invocation.

Builds a suite of ``--tests`` tests in a temporary folder, each calling the same
``--functions`` jitted functions of its module (as a project's tests call its model's
functions), and runs it plain (in one process: each function compiled once), then under
spawnrun fast mode with ``--spawn-gpu`` (every test in a fresh child) once per mode
``off``, ``run`` and ``auto``, ``--runs`` times each with pytest's cache kept (``auto``
keeps the compilations there for the next run). Prints each run's wall time and its
ratio to plain; every run must pass every test.

    python benchmarks/jax_compiles.py            # jax[cpu] on the CPU, or a GPU's jax
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUITE = """
import jax, jax.numpy as jnp
import pytest

# The module's functions, jitted once per process: in one process each compiles once.
FUNCTIONS = [
    jax.jit(lambda a, k=k: jnp.tanh(a @ a.T + k).sum(axis=0) * jnp.cos(a).mean())
    for k in range(NFUNCS)
]

@pytest.mark.parametrize("i", range(NTESTS))
def test_model(i):
    x = jnp.ones((256, 256), dtype=jnp.float32) * (i + 1) / 100
    for f in FUNCTIONS:
        f(x).block_until_ready()
"""


def run(folder: Path, args: list[str], timeout: float) -> tuple[float, str]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    out = (done.stdout + done.stderr).strip().splitlines()
    return time.monotonic() - start, out[-1] if out else f"rc {done.returncode}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tests", type=int, default=12)
    p.add_argument("--functions", type=int, default=6)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--run-timeout", type=float, default=300)
    p.add_argument("--spawn-args", default="--spawn-method forkserver --spawn-gpu")
    opts = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jax-compiles-"))
    rows: list[tuple[str, float, str]] = []
    try:
        suite = SUITE.replace("NFUNCS", str(opts.functions)).replace("NTESTS", str(opts.tests))
        plain_dir = root / "plain"
        plain_dir.mkdir()
        (plain_dir / "test_jax.py").write_text(suite)
        wall, last = run(
            plain_dir, ["-p", "no:spawnrun", "-p", "no:cacheprovider"], opts.run_timeout
        )
        rows.append(("plain", wall, last))
        for mode in ("off", "run", "auto"):
            folder = root / mode  # its own pytest cache: a mode's runs see only their own
            folder.mkdir()
            (folder / "test_jax.py").write_text(suite)
            for i in range(1, opts.runs + 1):
                args = [*opts.spawn_args.split(), "--spawn-jax-cache", mode]
                wall, last = run(folder, args, opts.run_timeout)
                rows.append((f"fast, --spawn-jax-cache {mode}, run {i}", wall, last))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    plain = rows[0][1]
    expected = f"{opts.tests} passed"
    for name, wall, last in rows:
        ok = re.search(rf"\b{expected}\b", last) and "failed" not in last
        verdict = "ok" if ok else "NOT ALL PASSED"
        print(f"{name:36} {wall:7.1f} s  {wall / plain:5.2f}x  {verdict}: {last}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
