"""Memory that lives outside the test's process, and JAX's: issue 45's targets, side by side.

Builds two suites in a temporary folder and runs each, in one invocation on one GPU:
plain pytest, then spawnrun fast mode (``--spawn-method forkserver``) ``--runs`` times in
the same folder, pytest's cache kept (the first run learns, the next ones pack by it).

1. engine: ``--engines`` bare ``gpu`` tests, each starting an engine process (as vLLM's
   ``LLM(...)`` does) that takes ``--share`` of the device's total memory and refuses to
   start where less is free, for ``--engine-seconds``; beside ``--small`` bare ``gpu``
   tests holding 2 GiB each for about a second. Targets: every run passes with no test
   run again, no engine test overlaps another test (its stamps), and no test's process
   tree (its process and its engine's, from NVML samples) held more than its budget plus
   the 1 GiB reserve.
2. jax: ``--jax`` bare ``gpu`` tests and as many with ``memory="6GiB"``, each
   jit-compiling and running matmuls. Target: the second run at most 1.5x plain.

Every test appends a stamp (JSON line: node id, pid, start, end, ``SPAWNRUN_GPU_BUDGET``)
to a file; each engine appends its pid under its test's id. A thread samples NVML's
per-process usage while a run goes. Prints a table, then the targets (met / MISSED), and
writes everything as JSON to ``--out``.

    python benchmarks/engines.py --out engines.json          # on a GPU (.ci/gpu/engines.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from speed import run_session

GiB = 2**30
RESERVE = 1 * GiB

CONFTEST = """
import json, os, time
import pytest

@pytest.fixture(autouse=True)
def _stamp(request):
    start = time.time()
    yield
    with open(os.environ["STAMPS"], "a") as f:
        f.write(json.dumps({
            "id": request.node.nodeid, "pid": os.getpid(), "start": start, "end": time.time(),
            "budget": int(os.environ.get("SPAWNRUN_GPU_BUDGET", 0)),
        }) + "\\n")
"""

ENGINE_TESTS = '''
import os, subprocess, sys, time
import pytest

ENGINE = r"""
import json, os, sys, time
import torch
share, seconds = float(sys.argv[1]), float(sys.argv[2])
free, total = torch.cuda.mem_get_info()
want = int(total * share)
if free < want:
    sys.exit(f"engine: free memory {free / 2**30:.1f} GiB less than desired {want / 2**30:.1f} GiB")
with open(os.environ["STAMPS"], "a") as f:
    test = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
    f.write(json.dumps({"engine_of": test, "pid": os.getpid()}) + "\\n")
held = torch.empty(want - (512 << 20), dtype=torch.uint8, device="cuda")
time.sleep(seconds)
"""

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(ENGINES))
def test_engine(i):
    subprocess.run([sys.executable, "-c", ENGINE, "SHARE", "SECONDS"], check=True)

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(SMALL))
def test_small(i):
    import torch
    held = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    x = torch.randn(1024, 1024, device="cuda")
    end = time.time() + 1.0
    while time.time() < end:
        x = torch.tanh(x @ x)
    torch.cuda.synchronize()
'''

JAX_TESTS = """
import pytest

def _work():
    import jax, jax.numpy as jnp
    f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    x = jnp.ones((2048, 2048), dtype=jnp.float32)
    for _ in range(50):
        f(x).block_until_ready()

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(NTESTS))
def test_bare(i):
    _work()

@pytest.mark.gpu(memory="6GiB")
@pytest.mark.parametrize("i", range(NTESTS))
def test_budgeted(i):
    _work()
"""


class Sampler:
    """NVML's per-process usage on every device, every ``interval`` s, in a thread:
    ``samples`` is [(time, {pid: bytes})]."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.samples: list[tuple[float, dict[int, int]]] = []
        self._stop = threading.Event()
        try:
            import pynvml  # type: ignore[import-not-found, unused-ignore]

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml: Any = pynvml
        except Exception:  # noqa: BLE001 - no NVML: no samples, said in the table
            self._nvml = None
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            used: dict[int, int] = {}
            for handle in self._handles:
                try:
                    for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                        used[int(p.pid)] = used.get(int(p.pid), 0) + int(p.usedGpuMemory or 0)
                except Exception:  # noqa: BLE001, S112 - a lost sample is only a gap
                    continue
            self.samples.append((time.time(), used))
            self._stop.wait(self.interval)

    def __enter__(self) -> Sampler:
        if self._nvml is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def run(folder: Path, args: list[str], timeout: float, log: Path) -> dict[str, Any]:
    """One pytest run in ``folder``: its wall, outcomes, reruns, stamps and NVML samples."""
    stamps = folder / "stamps.jsonl"
    stamps.unlink(missing_ok=True)
    env = {**os.environ, "STAMPS": str(stamps), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *args]
    start = time.monotonic()
    with Sampler() as sampler:
        stdout, stderr, code, timed_out = run_session(cmd, cwd=folder, env=env, timeout=timeout)
        out, rc = stdout + stderr, -1 if timed_out else code
    wall = time.monotonic() - start
    log.write_text(out)
    counts = (
        {
            k: int(n)
            for n, k in re.findall(
                r"(\d+) (passed|failed|error|errors|skipped)", out.splitlines()[-1]
            )
        }
        if out.strip()
        else {}
    )
    lines = [json.loads(x) for x in stamps.read_text().splitlines()] if stamps.exists() else []
    again = re.search(r"(\d+) tests? failed \(or skipped after using a GPU\)", out)
    return {
        "wall": wall,
        "rc": rc,
        "counts": counts,
        "again": int(again.group(1)) if again else 0,
        "tests": [s for s in lines if "id" in s],
        "engines": [s for s in lines if "engine_of" in s],
        "samples": sampler.samples,
    }


def engine_checks(result: dict[str, Any]) -> dict[str, Any]:
    """Overlaps of an engine test with another test, and trees over their budgets."""
    tests = result["tests"]
    overlaps = 0
    for e in (t for t in tests if "::test_engine[" in t["id"]):
        overlaps += sum(
            1 for o in tests if o is not e and o["start"] < e["end"] and e["start"] < o["end"]
        )
    pids: dict[str, set[int]] = {t["id"]: {t["pid"]} for t in tests}
    for e in result["engines"]:
        pids.setdefault(e["engine_of"], set()).add(e["pid"])
    overruns: list[str] = []
    for t in tests:
        if not t["budget"]:
            continue
        for when, used in result["samples"]:
            held = sum(used.get(p, 0) for p in pids[t["id"]])
            if t["start"] <= when <= t["end"] and held > t["budget"] + RESERVE:
                overruns.append(f"{t['id']}: {held / GiB:.1f} GiB > {t['budget'] / GiB:.1f}")
                break
    return {"overlaps": overlaps, "overruns": overruns, "samples": len(result["samples"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="engine,jax")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--engines", type=int, default=6)
    p.add_argument("--small", type=int, default=12)
    p.add_argument("--share", type=float, default=0.45)
    p.add_argument("--engine-seconds", type=float, default=2.0)
    p.add_argument("--jax", type=int, default=8)
    p.add_argument("--run-timeout", type=float, default=150)
    p.add_argument("--logs", default="")
    p.add_argument("--out", default="")
    opts = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="engines-"))
    logs = Path(opts.logs) if opts.logs else root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    suites = {
        "engine": ENGINE_TESTS.replace("ENGINES", str(opts.engines))
        .replace("SMALL", str(opts.small))
        .replace("SHARE", str(opts.share))
        .replace("SECONDS", str(opts.engine_seconds)),
        "jax": JAX_TESTS.replace("NTESTS", str(opts.jax)),
    }
    results: dict[str, dict[str, Any]] = {}
    targets: list[tuple[str, bool]] = []
    for case in opts.cases.split(","):
        folder = root / case
        folder.mkdir()
        (folder / "conftest.py").write_text(CONFTEST)
        (folder / f"test_{case}.py").write_text(suites[case])
        rows = [("plain", ["-p", "no:spawnrun", "-p", "no:cacheprovider"])]
        rows += [
            (f"fast, run {i}", ["--spawn-method", "forkserver"]) for i in range(1, opts.runs + 1)
        ]
        for name, args in rows:
            log = logs / f"{case}-{name.replace(', ', '-').replace(' ', '')}.log"
            r = run(folder, args, opts.run_timeout, log)
            if case == "engine" and name != "plain":
                r["checks"] = engine_checks(r)
            results[f"{case}: {name}"] = r
            c = r.get("checks", {})
            print(
                f"{case:7} {name:12} {r['wall']:7.1f} s  rc {r['rc']:>2}  {r['counts']}  "
                f"again {r['again']}  "
                + (
                    f"engine overlaps {c['overlaps']}, overruns {len(c['overruns'])}, "
                    f"NVML samples {c['samples']}"
                    if c
                    else ""
                ),
                flush=True,
            )
            for line in c.get("overruns", [])[:5]:
                print(f"    over its budget: {line}")
        expected = opts.engines + opts.small if case == "engine" else 2 * opts.jax

        def ok(r: dict[str, Any], expected: int = expected) -> bool:
            return r["rc"] == 0 and r["counts"].get("passed") == expected

        plain = results[f"{case}: plain"]["wall"]
        fast = [results[f"{case}: fast, run {i}"] for i in range(1, opts.runs + 1)]
        print(
            f"{case}: "
            + ", ".join(f"run {i + 1} {f['wall'] / plain:.2f}x" for i, f in enumerate(fast))
        )
        if case == "engine":
            clean = all(
                ok(f)
                and not f["again"]
                and not f["checks"]["overlaps"]
                and not f["checks"]["overruns"]
                and f["checks"]["samples"]
                for f in fast
            )
            targets.append(
                ("engine: every run green, 0 reruns, 0 engine overlaps, 0 overruns", clean)
            )
        elif len(fast) >= 2:
            met = ok(results["jax: plain"]) and ok(fast[1]) and fast[1]["wall"] <= 1.5 * plain
            targets.append(("jax: second run at most 1.5x plain, all passed", met))
    for what, met in targets:
        print(f"{'met   ' if met else 'MISSED'} {what}")
    if opts.out:
        for r in results.values():
            r["samples"] = len(r["samples"])
        Path(opts.out).write_text(json.dumps({"results": results, "targets": targets}, indent=1))
    return 0 if all(met for _, met in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
