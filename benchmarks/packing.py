"""Packing several isolated tests on one GPU (issue 14's targets), side by side in one run.

Builds its suites in a temporary folder and runs, in one invocation (on one H200, or with
``--cpu`` on a machine without CUDA, declaring devices and their memory to spawnrun):

1. throughput: N tests in one module importing torch, each ``--body-seconds`` of 512x512
   matmuls, each ``@pytest.mark.gpu(memory="2GiB")``: plain pytest, ``pytest -n 8``
   (xdist, spawnrun off), spawnrun default (spawn) and fast (forkserver) mode, packed by
   default (``--spawn-pack declared``);
2. exclusive: small trivial tests ``gpu(exclusive=True)``, one per file: plain,
   pytest-forked (when installed), fast mode: per-test overhead ((mode - plain) / N) and
   the gap from one test's end to the next one's start on its device;
3. leak: three tests that each take 60% of the device and keep it (module-level
   reference), no budgets: default settings, and fast mode with ``--spawn-pack auto``
   twice (the peak it learns is too large to share): they must never overlap on a device,
   and each must find >= 90% of the device free;
4. auto: the throughput tests with no budget (``@pytest.mark.gpu``) under
   ``--spawn-pack auto`` in a fresh folder (its own pytest cache): a first run in fast
   mode learns the peaks (with ``--learn-body-seconds`` of work per test: the peak does
   not depend on it), then the second run is measured in fast mode and in default mode,
   on that cache. ``--auto-learn each``: each mode in a folder of its own, run twice (one
   learning run more, ~1 min on an H200).
5. mixed: 48 tests in 3 files, in an order that mixes them: 32 budgeted (0.1-0.6 s of
   matmuls holding 0.5-1.5 GiB, budgets of 1-3 GiB), 8 bare ``gpu`` tests, 6
   ``exclusive=True``, 2 ``count=0``: plain, ``-n 8``, then spawnrun default and fast
   mode, each twice in a folder of its own with pytest's cache kept (the second run has
   the first one's records: durations, boots). No option beyond the marker.
6. collect: the shape of kornia's suite. 40 unmarked tests in 4 files (0.05-0.15 s of
   small matmuls each), whose conftest asks ``torch.cuda.is_available()`` while pytest
   collects (``--collect-context``: and makes a context), so no file template is safe:
   plain, then spawnrun fast mode with ``--spawn-gpu`` twice, pytest's cache kept
   (default mode boots an interpreter per test).

Every test appends a stamp (JSON line: node id, pid, start and end wall-clock,
``CUDA_VISIBLE_DEVICES``, ``SPAWNRUN_GPU_BUDGET``, the device's UUID, free and total
memory at its start, torch's reserved peak) to a file. From the stamps: tests at once
(max, and mean = busy time / span), budget overruns (on one device, at a test's start,
tests running together whose budgets plus ``--reserve`` each, an unbudgeted test
counting as the whole device, exceed its memory), gaps, overlaps. While a spawnrun run
goes, a thread samples NVML (pynvml, when importable) every ``--nvml-interval`` s: a test
child (matched by pid) whose memory on a device exceeds its budget plus the reserve is
an overrun too. Prints a table per case, then the targets (met / MISSED / INVALID when
not every test passed / not measured), and writes everything as JSON to ``--out``
(rewritten after every run, so a killed run leaves what was measured).

    python benchmarks/packing.py --out packing.json          # on the H200 (.ci/gpu/packing.sh)
    python benchmarks/packing.py --cpu --out /tmp/packing.json   # dry run, no CUDA
    python benchmarks/packing.py --cpu --cases throughput -n 4
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from gpu_scheduling import normalize
from speed import PYTEST_INI
from speed import Outcome
from speed import _gpu_name
from speed import _load
from speed import run
from speed import script_parser
from stamps import GIB
from stamps import Stamp
from stamps import at_once
from stamps import by_device
from stamps import gaps
from stamps import nvml_overruns
from stamps import overlaps
from stamps import parse_size
from stamps import parse_stamps
from stamps import short_of_free
from stamps import stamp_overruns
from stamps import torch_overruns

LEAK_SHARE = 0.6

CONFTEST = """
import json
import os
import time

import pytest
import torch

CUDA = os.environ.get("PACKING_DEVICE", "cuda") == "cuda"
if not CUDA:
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _packing_stamp(request):
    rec = {
        "nodeid": request.node.nodeid,
        "pid": os.getpid(),
        "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "budget": os.environ.get("SPAWNRUN_GPU_BUDGET"),
        "start": time.time(),
    }
    # A count=0 test sees no device (CUDA_VISIBLE_DEVICES empty): nothing to ask.
    cuda = CUDA and os.environ.get("CUDA_VISIBLE_DEVICES") != ""
    if cuda:
        rec["free"], rec["total"] = torch.cuda.mem_get_info()
        rec["uuid"] = str(torch.cuda.get_device_properties(0).uuid)
    yield
    if cuda:
        torch.cuda.synchronize()
        rec["peak_reserved"] = torch.cuda.max_memory_reserved()
    rec["end"] = time.time()
    # One write of one line on an O_APPEND descriptor: concurrent tests never interleave.
    fd = os.open(os.environ["PACKING_STAMPS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (json.dumps(rec) + "\\n").encode())
    finally:
        os.close(fd)
"""

WORK = """
import os
import time

import pytest
import torch

BODY = float(os.environ.get("PACKING_BODY_SECONDS", "{body}"))
DEVICE = "cuda" if os.environ.get("PACKING_DEVICE", "cuda") == "cuda" else "cpu"


@{mark}
@pytest.mark.parametrize("i", range({n}))
def test_work(i):
    a = torch.randn(512, 512, device=DEVICE)
    end = time.monotonic() + BODY
    while time.monotonic() < end:
        for _ in range(10):
            a = (a @ a).clamp_(-1, 1)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
"""

EXCLUSIVE = """
import os

import pytest
import torch


@pytest.mark.gpu(exclusive=True)
def test_trivial_{i}():
    device = "cuda" if os.environ.get("PACKING_DEVICE", "cuda") == "cuda" else "cpu"
    assert torch.ones(1024, device=device).sum().item() == 1024.0
"""

LEAK = f"""
import os
import time

import pytest
import torch

# Kept until the process ends, as a test that leaks would.
KEPT = []


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(3))
def test_leak(i):
    if os.environ.get("PACKING_DEVICE", "cuda") == "cuda":
        total = torch.cuda.mem_get_info()[1]
        KEPT.append(torch.empty(int(total * {LEAK_SHARE}), dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
    else:
        KEPT.append(torch.empty(1 << 20, dtype=torch.uint8))
    time.sleep(0.2)
"""

MIXED_HEAD = """
import os
import time

import pytest
import torch

DEVICE = "cuda" if os.environ.get("PACKING_DEVICE", "cuda") == "cuda" else "cpu"


def work(seconds, gib):
    held = torch.empty(int(gib * 2**30) // 4 if DEVICE == "cuda" else 1024, device=DEVICE)
    a = torch.randn(512, 512, device=DEVICE)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(10):
            a = (a @ a).clamp_(-1, 1)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    del held
"""


def mixed_files() -> dict[str, str]:
    """The mixed suite: 48 tests over 3 files, kinds interleaved in a fixed order."""
    kinds = ["budget"] * 32 + ["bare"] * 8 + ["exclusive"] * 6 + ["count0"] * 2
    order = sorted(range(len(kinds)), key=lambda i: (i * 37) % len(kinds))
    files: dict[str, list[str]] = {f"test_mixed_{f}.py": [MIXED_HEAD] for f in range(3)}
    for n, i in enumerate(order):
        kind = kinds[i]
        if kind == "budget":
            mark = f'gpu(memory="{1 + i % 3}GiB")'
            body = f"work({0.1 + 0.1 * (i % 6):.1f}, {0.5 + 0.5 * (i % 3):.1f})"
        elif kind == "bare":
            mark, body = "gpu", "work(0.3, 0.5)"
        elif kind == "exclusive":
            mark, body = "gpu(exclusive=True)", "work(0.2, 0.5)"
        else:
            mark, body = "gpu(count=0)", "time.sleep(0.1)"
        text = f"\n\n@pytest.mark.{mark}\ndef test_{n:02d}_{kind}():\n    {body}\n"
        files[f"test_mixed_{n % 3}.py"].append(text)
    return {name: "".join(parts) for name, parts in files.items()}


#: The collect case's conftest ends as kornia's does (timm's test_layers asks the same
#: in a skipif): the CUDA driver is initialized while pytest collects, so no file
#: template is safe; ``--collect-context`` also makes a context there.
COLLECT_INIT = """

TEST_DEVICES = ["cpu", "cuda"] if CUDA and torch.cuda.is_available() else ["cpu"]
if os.environ.get("PACKING_COLLECT_CONTEXT"):
    torch.empty(1, device="cuda")
"""

COLLECT = """
import os
import time

import pytest
import torch

DEVICE = "cuda" if os.environ.get("PACKING_DEVICE", "cuda") == "cuda" else "cpu"


@pytest.mark.parametrize("i", range({n}))
def test_op(i):
    a = torch.randn(256, 256, device=DEVICE)
    end = time.monotonic() + 0.05 * (1 + i % 3)
    while time.monotonic() < end:
        a = (a @ a).clamp_(-1, 1)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    assert a.shape == (256, 256)
"""


def collect_files(files: int = 4, per_file: int = 10) -> dict[str, str]:
    """The collect case: unmarked tests (run with --spawn-gpu), a conftest that makes a
    CUDA context while collecting."""
    out = {"conftest.py": CONFTEST + COLLECT_INIT}
    out.update({f"test_collect_{f}.py": COLLECT.format(n=per_file) for f in range(files)})
    return out


BUDGET_MARK = 'pytest.mark.gpu(memory="2GiB")'
NO_SPAWNRUN = ["-p", "no:spawnrun"]
FAST = ["--spawn-method", "forkserver"]
AUTO = ["--spawn-pack", "auto"]
FAST_EX = "spawnrun fast"


# ----------------------------------------------------------------------------------------
# NVML sampling


class NvmlSampler:
    """Per (device UUID, pid), the most memory NVML listed, sampled in a thread."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.peaks: dict[tuple[str, int], int] = {}
        self.most_processes: dict[str, int] = {}
        self.totals: dict[str, int] = {}
        self.samples = 0
        self.errors = 0
        self.why_not = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml  # type: ignore[import-not-found, unused-ignore]

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                uuid = normalize(uuid.decode() if isinstance(uuid, bytes) else uuid)
                self.totals[uuid] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
                self._handles.append((uuid, handle))
        except Exception as exc:  # noqa: BLE001 - no NVML: said, and the stamps still count
            self.why_not = f"{type(exc).__name__}: {exc}"

    @property
    def available(self) -> bool:
        return not self.why_not

    def _loop(self) -> None:
        while not self._stop.is_set():
            for uuid, handle in self._handles:
                try:
                    procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                except Exception:  # noqa: BLE001 - one failed sample is counted, not fatal
                    self.errors += 1
                    continue
                self.most_processes[uuid] = max(self.most_processes.get(uuid, 0), len(procs))
                for p in procs:
                    used = int(getattr(p, "usedGpuMemory", None) or 0)
                    key = (uuid, int(p.pid))
                    self.peaks[key] = max(self.peaks.get(key, 0), used)
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> NvmlSampler:
        if self.available:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# ----------------------------------------------------------------------------------------
# Runs


@dataclass
class Measured:
    case: str
    mode: str
    args: list[str]
    expected: int
    #: False: a learning run (its wall is not a result).
    measured: bool = True
    spawnrun: bool = True
    outcome: Outcome | None = None
    skipped: str = ""
    stamps: list[Stamp] = field(default_factory=list)
    nvml: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        o = self.outcome
        return bool(
            o
            and not o.timed_out
            and not o.failed
            and o.passed == self.expected
            and o.returncode == 0
        )

    @property
    def wall(self) -> float | None:
        return self.outcome.wall if self.outcome else None


def make_suite(root: Path, name: str, files: dict[str, str]) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "pytest.ini").write_text(PYTEST_INI)
    (folder / "conftest.py").write_text(CONFTEST)
    for fname, text in files.items():
        (folder / fname).write_text(text)
    return folder


class Bench:
    def __init__(self, opts: argparse.Namespace, root: Path) -> None:
        self.opts = opts
        self.root = root
        self.started = time.monotonic()
        self.results: list[Measured] = []
        self.reserve = parse_size(opts.reserve)
        self.declared = parse_size(opts.gpu_memory) if opts.cpu else None
        self.spawn_extra = shlex.split(opts.spawn_args)
        self.host: dict[str, Any] = {}
        if opts.cpu:
            self.spawn_extra += ["--spawn-gpus", opts.spawn_gpus]
            self.spawn_extra += ["--spawn-gpu-memory", opts.gpu_memory]

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def go(self, m: Measured, folder: Path, env_extra: dict[str, str], cache: bool) -> Measured:
        self.results.append(m)
        label = f"{m.case} / {m.mode}"
        deadline = self.opts.deadline
        if deadline and self.elapsed() > deadline:
            m.skipped = f"not run: the {deadline:.0f}s deadline had passed"
            print(f"[{self.elapsed():5.0f}s] {label}: {m.skipped}")
            return m
        limit = self.opts.run_timeout
        if deadline:
            limit = max(10.0, min(limit, deadline + 60 - self.elapsed()))
        args = [*m.args, *(self.spawn_extra if m.spawnrun else [])]
        stamps = self.root / "stamps" / f"{len(self.results):02d}.jsonl"
        stamps.parent.mkdir(exist_ok=True)
        env = {**_env(self.opts, str(stamps)), **env_extra}
        log = None
        if self.opts.logs:
            slug = re.sub(r"\W+", "_", f"{len(self.results):02d} {label}").strip("_")
            log = self.opts.logs / f"{slug}.txt"
        print(f"[{self.elapsed():5.0f}s] {label}: pytest {shlex.join(args)} (cap {limit:.0f}s)")
        sampler = NvmlSampler(self.opts.nvml_interval) if m.spawnrun and not self.opts.cpu else None
        if sampler is not None:
            with sampler:
                m.outcome = run(folder, args, limit, log, env=env, cache=cache)
        else:
            m.outcome = run(folder, args, limit, log, env=env, cache=cache)
        m.stamps = parse_stamps(stamps.read_text()) if stamps.exists() else []
        self.analyse(m, sampler)
        o = m.outcome
        most, mean = m.checks["at_once"]
        print(
            f"[{self.elapsed():5.0f}s]   {o.wall:6.1f}s, {len(m.stamps)} stamps, at once "
            f"{most}/{mean:.2f}, rc {o.returncode}: {o.tail}"
        )
        if not m.ok:
            why = "TIMED OUT" if o.timed_out else f"returncode {o.returncode}"
            print(f"  RUN FAILED ({why}, {o.passed} of {m.expected} passed); its output ends:")
            print("\n".join("    | " + line for line in o.last_lines.splitlines()))
        self.write_json()
        return m

    def analyse(self, m: Measured, sampler: NvmlSampler | None) -> None:
        m.checks["at_once"] = at_once(m.stamps)
        m.checks["at_once_per_device"] = {d: at_once(g)[0] for d, g in by_device(m.stamps).items()}
        if not m.spawnrun:
            return
        capacity = dict(sampler.totals) if sampler else {}
        found, unknown = stamp_overruns(m.stamps, self.reserve, capacity, self.declared)
        m.checks["overruns_stamps"] = [asdict(o) for o in found]
        m.checks["devices_unchecked"] = unknown
        m.checks["overruns_torch"] = torch_overruns(m.stamps)
        if sampler is None:
            m.nvml = {"available": False, "why": "CPU dry run"}
        elif not sampler.available:
            m.nvml = {"available": False, "why": sampler.why_not}
        else:
            over, matched = nvml_overruns(sampler.peaks, m.stamps, self.reserve)
            m.nvml = {
                "available": True,
                "samples": sampler.samples,
                "errors": sampler.errors,
                "processes_seen": len(sampler.peaks),
                "matched_to_stamps": matched,
                "most_processes_per_device": sampler.most_processes,
                "overruns": over,
            }

    def write_json(self) -> None:
        if not self.opts.out:
            return
        doc = {
            "host": self.host,
            "options": {k: str(v) for k, v in vars(self.opts).items()},
            "runs": [_run_json(m) for m in self.results],
            "targets": [asdict(t) for t in targets(self)],
        }
        self.opts.out.write_text(json.dumps(doc, indent=1))

    def find(self, case: str, mode: str) -> Measured | None:
        for m in self.results:
            if m.case == case and m.mode == mode and m.measured:
                return m
        return None


def _run_json(m: Measured) -> dict[str, Any]:
    o = m.outcome
    doc: dict[str, Any] = {
        "case": m.case,
        "mode": m.mode,
        "args": m.args,
        "measured": m.measured,
        "expected": m.expected,
        "ok": m.ok,
        "skipped": m.skipped,
    }
    if o is not None:
        doc.update(
            wall=o.wall,
            returncode=o.returncode,
            passed=o.passed,
            failed=o.failed,
            timed_out=o.timed_out,
            tail=o.tail,
        )
        if not m.ok:
            doc["last_lines"] = o.last_lines
    doc["checks"] = m.checks
    doc["nvml"] = m.nvml
    doc["stamps"] = [asdict(s) for s in m.stamps]
    return doc


@dataclass(frozen=True)
class Planned:
    case: str
    mode: str
    args: list[str]
    tests: int
    #: Seconds it should take if the targets are met (for the plan only).
    estimate: float
    #: Runs that name one folder share it, and its pytest cache.
    folder: str
    learns: bool = False


def plan(b: Bench) -> list[Planned]:
    o = b.opts
    n, k = o.tests, o.exclusive_tests
    plain = n * (o.body_seconds + 0.05) + 6
    xdist = plain / o.xdist + 8
    alone = n * (o.learn_body_seconds + 0.9) + 6
    fast = min(plain, 1.3 * xdist)
    rows = []
    if "throughput" in o.cases:
        rows += [
            Planned("throughput", "plain", NO_SPAWNRUN, n, plain, "throughput"),
            Planned(
                "throughput",
                f"xdist -n {o.xdist}",
                [*NO_SPAWNRUN, "-n", str(o.xdist)],
                n,
                xdist,
                "throughput",
            ),
            Planned("throughput", "spawnrun default, packed", [], n, 1.5 * plain, "throughput"),
            Planned("throughput", "spawnrun fast, packed", FAST, n, fast, "throughput"),
        ]
    if "exclusive" in o.cases:
        rows += [
            Planned("exclusive", "plain", NO_SPAWNRUN, k, 0.2 * k + 6, "exclusive"),
            Planned(
                "exclusive",
                "pytest-forked",
                [*NO_SPAWNRUN, "--forked"],
                k,
                0.5 * k + 6,
                "exclusive",
            ),
            Planned("exclusive", "spawnrun default", [], k, 2.0 * k + 6, "exclusive"),
            # Again, with what the first run saw of each file's boot (--warm keeps it).
            Planned("exclusive", "spawnrun default, run 2", [], k, 2.0 * k + 6, "exclusive"),
            Planned("exclusive", FAST_EX, FAST, k, 0.9 * k + 6, "exclusive"),
        ]
    if "leak" in o.cases:
        rows += [
            Planned("leak", "spawnrun default", [], 3, 12, "leak"),
            Planned("leak", "spawnrun fast auto, run 1", [*FAST, *AUTO], 3, 10, "leak auto"),
            Planned("leak", "spawnrun fast auto, run 2", [*FAST, *AUTO], 3, 10, "leak auto"),
        ]
    if "mixed" in o.cases:
        plain_mixed = 0.3 * 48 + 6
        rows += [
            Planned("mixed", "plain", NO_SPAWNRUN, 48, plain_mixed, "mixed"),
            Planned(
                "mixed",
                f"xdist -n {o.xdist}",
                [*NO_SPAWNRUN, "-n", str(o.xdist)],
                48,
                plain_mixed / 2,
                "mixed",
            ),
        ]
        for mode, extra in (("default", []), ("fast", FAST)):
            for run_ in (1, 2):
                label = f"spawnrun {mode}, run {run_}"
                rows.append(Planned("mixed", label, extra, 48, plain_mixed, f"mixed {mode}"))
    if "collect" in o.cases:
        plain_collect = 0.1 * 40 + 6
        rows.append(Planned("collect", "plain", NO_SPAWNRUN, 40, plain_collect, "collect"))
        for run_ in (1, 2):  # default mode boots an interpreter per test: fast only
            label = f"spawnrun fast, run {run_}"
            args = [*FAST, "--spawn-gpu"]
            rows.append(Planned("collect", label, args, 40, 2 * plain_collect, "collect fast"))
    if "auto" in o.cases:
        for mode, extra, t in (("fast", FAST, fast), ("default", [], 1.5 * plain)):
            # --auto-learn once: fast mode's learning run serves both modes.
            folder = "auto" if o.auto_learn == "once" else f"auto {mode}"
            if mode == "fast" or o.auto_learn == "each":
                learn = f"spawnrun {mode} auto, run 1 (learns)"
                rows.append(Planned("auto", learn, [*extra, *AUTO], n, alone, folder, True))
            rows.append(
                Planned("auto", f"spawnrun {mode} auto, run 2", [*extra, *AUTO], n, t, folder)
            )
    return rows


def execute(b: Bench) -> None:
    o = b.opts
    texts = {
        "throughput": {
            "test_work.py": WORK.format(body=o.body_seconds, mark=BUDGET_MARK, n=o.tests)
        },
        "exclusive": {
            f"test_ex_{i:03d}.py": EXCLUSIVE.format(i=i) for i in range(o.exclusive_tests)
        },
        "leak": {"test_leak.py": LEAK},
        "mixed": mixed_files(),
        "collect": collect_files(),
        "auto": {
            "test_work.py": WORK.format(body=o.body_seconds, mark="pytest.mark.gpu", n=o.tests)
        },
    }
    missing = {
        f"xdist -n {o.xdist}": importlib.util.find_spec("xdist") is None,
        "pytest-forked": importlib.util.find_spec("pytest_forked") is None,
    }
    folders: dict[str, Path] = {}
    warmed: set[str] = set()
    for p in plan(b):
        m = Measured(p.case, p.mode, p.args, p.tests, not p.learns, NO_SPAWNRUN[1] not in p.args)
        if missing.get(p.mode):
            b.results.append(m)
            m.skipped = f"not run: {p.mode.split()[0]} is not installed"
            print(f"[{b.elapsed():5.0f}s] {p.case} / {p.mode}: {m.skipped}")
            continue
        if p.folder not in folders:
            name = re.sub(r"\W+", "_", p.folder)
            folders[p.folder] = make_suite(b.root, name, texts[p.case])
        if not b.results:
            # Untimed: the first run of all pays for cold file caches (torch, pytest).
            print(f"[{b.elapsed():5.0f}s] warm-up (untimed): plain pytest, the exclusive tests")
            warm = make_suite(b.root, "warm-up", texts["exclusive"])
            run(warm, NO_SPAWNRUN, o.run_timeout, None, env=_env(o, os.devnull))
        env = {"PACKING_BODY_SECONDS": str(o.learn_body_seconds)} if p.learns else {}
        if p.case == "collect" and o.collect_context and not o.cpu:
            env["PACKING_COLLECT_CONTEXT"] = "1"
        cache = AUTO[0] in p.args or p.case in ("mixed", "collect")
        if o.warm and p.case in ("throughput", "exclusive"):
            cache = True
            if m.spawnrun and p.folder not in warmed:
                # Untimed: a first spawnrun run fills the folder's bytecode cache.
                warmed.add(p.folder)
                print(f"[{b.elapsed():5.0f}s] warm-up (untimed): {p.case}, spawnrun fast")
                run(
                    folders[p.folder],
                    FAST,
                    o.run_timeout,
                    None,
                    env=_env(o, os.devnull),
                    cache=True,
                )
        b.go(m, folders[p.folder], env, cache=cache)
        if p.case in ("leak", "exclusive"):
            m.checks["overlaps"] = overlaps(m.stamps)
        if p.case == "leak":
            m.checks["short_of_free"] = short_of_free(m.stamps)
            m.checks["free_checked"] = sum(s.free is not None for s in m.stamps)
        if p.case == "exclusive":
            found = gaps(m.stamps)
            m.checks["gaps"] = found
            m.checks["gap_median"] = statistics.median(found) if found else None
        b.write_json()


def _env(o: argparse.Namespace, stamps: str) -> dict[str, str]:
    device = "cpu" if o.cpu else "cuda"
    return dict(os.environ, PYTHONUNBUFFERED="1", PACKING_STAMPS=stamps, PACKING_DEVICE=device)


# ----------------------------------------------------------------------------------------
# Report


@dataclass
class TargetResult:
    label: str
    limit: str
    value: str
    verdict: str


def _ratio(a: Measured | None, b: Measured | None) -> float | None:
    if a is None or b is None or a.wall is None or not b.wall:
        return None
    return a.wall / b.wall


def _verdict(runs: list[Measured], met: bool) -> str:
    broken = [f"{r.case}/{r.mode}" for r in runs if not r.ok]
    if broken:
        return f"INVALID: not every test passed in {', '.join(broken)}"
    return "met" if met else "MISSED"


def _wall_target(
    b: Bench, case: str, mode: str, ref: str, limit: float, ref_case: str = "throughput"
) -> TargetResult:
    label = f"{case}: {mode} vs {ref}"
    mine, theirs = b.find(case, mode), b.find(ref_case, ref)
    if mine is None or theirs is None or mine.wall is None or not theirs.wall:
        return TargetResult(label, f"<= {limit:.1f}x", "", "not measured")
    ratio = mine.wall / theirs.wall
    value = f"{ratio:.2f}x ({mine.wall:.1f}s vs {theirs.wall:.1f}s)"
    return TargetResult(label, f"<= {limit:.1f}x", value, _verdict([mine, theirs], ratio <= limit))


def _exclusive_targets(b: Bench) -> list[TargetResult]:
    plain, forked, fast = (b.find("exclusive", m) for m in ("plain", "pytest-forked", FAST_EX))
    label = "exclusive: fast mode's per-test overhead vs pytest-forked's"
    found = [TargetResult(label, "<= 1.5x", "", "not measured")]
    if plain and forked and fast and plain.wall and forked.wall and fast.wall:
        n = b.opts.exclusive_tests
        mine, theirs = (fast.wall - plain.wall) / n, (forked.wall - plain.wall) / n
        value = f"{mine * 1000:.0f} ms vs {theirs * 1000:.0f} ms"
        if theirs > 0:
            value = f"{mine / theirs:.2f}x ({value})"
        verdict = _verdict([plain, forked, fast], theirs > 0 and mine / theirs <= 1.5)
        found = [TargetResult(label, "<= 1.5x", value, verdict)]
    label = "exclusive: fast mode, a test's end to the next one's start, median"
    gap = fast.checks.get("gap_median") if fast else None
    if fast is None or gap is None:
        return [*found, TargetResult(label, "<= 0.40 s", "", "not measured")]
    return [*found, TargetResult(label, "<= 0.40 s", f"{gap:.2f} s", _verdict([fast], gap <= 0.4))]


def _leak_targets(b: Bench) -> list[TargetResult]:
    found = []
    for m in b.results:
        if m.case != "leak" or m.outcome is None:
            continue
        shared, short = m.checks.get("overlaps", []), m.checks.get("short_of_free", [])
        checked = m.checks.get("free_checked", 0)
        value = f"{len(shared)} overlaps, {len(short)} of {checked} found < 90% free"
        if b.opts.cpu:
            value = f"{len(shared)} overlaps (free memory: not on CPU)"
        verdict = _verdict([m], not shared and not short)
        if verdict == "met" and not checked and not b.opts.cpu:
            verdict = "not measured (no free-memory stamp)"
        label = f"leak ({m.mode}): never shared, device free"
        found.append(TargetResult(label, "== 0", value, verdict))
    if not found and "leak" in b.opts.cases:
        found.append(TargetResult("leak: never shared, device free", "== 0", "", "not measured"))
    return found


def _overrun_targets(b: Bench) -> list[TargetResult]:
    spawned = [m for m in b.results if m.spawnrun and m.stamps]
    if not spawned:
        return [TargetResult("budget overruns", "== 0", "", "not measured (no spawnrun stamps)")]
    count = sum(len(m.checks["overruns_stamps"]) + len(m.checks["overruns_torch"]) for m in spawned)
    label = f"budget overruns from stamps, {len(spawned)} spawnrun runs with stamps"
    verdict = "met" if not count else "MISSED"
    failed = [m for m in b.results if m.spawnrun and m.outcome is not None and not m.ok]
    if failed:
        verdict += f" ({len(failed)} spawnrun run(s) failed: their stamps may be incomplete)"
    found = [TargetResult(label, "== 0", str(count), verdict)]
    sampled = [m for m in spawned if m.nvml.get("available")]
    if not sampled:
        why = spawned[0].nvml.get("why", "")
        nvml = TargetResult("budget overruns from NVML", "== 0", "", f"not measured ({why})")
        return [*found, nvml]
    count = sum(len(m.nvml["overruns"]) for m in sampled)
    verdict = "met" if not count else "MISSED"
    blind = [m for m in sampled if m.nvml["processes_seen"] and not m.nvml["matched_to_stamps"]]
    if blind:
        verdict += f" (in {len(blind)} run(s) no NVML pid matched a stamp: PID namespace?)"
    label = f"budget overruns from NVML, {len(sampled)} spawnrun runs"
    return [*found, TargetResult(label, "== 0", str(count), verdict)]


def targets(b: Bench) -> list[TargetResult]:
    x = f"xdist -n {b.opts.xdist}"
    found: list[TargetResult] = []
    for case, fast, default in (
        ("throughput", "spawnrun fast, packed", "spawnrun default, packed"),
        ("auto", "spawnrun fast auto, run 2", "spawnrun default auto, run 2"),
    ):
        found.append(_wall_target(b, case, fast, "plain", 1.0))
        found.append(_wall_target(b, case, fast, x, 1.3))
        found.append(_wall_target(b, case, default, "plain", 1.5))
    if "mixed" in b.opts.cases:  # issue 25: no option beyond the marker
        for mode, limit in (("fast, run 1", 1.2), ("fast, run 2", 1.0), ("default, run 2", 1.0)):
            found.append(_wall_target(b, "mixed", f"spawnrun {mode}", "plain", limit, "mixed"))
    if "collect" in b.opts.cases:  # issue 25: a conftest that makes a context at collection
        for mode, limit in (("fast, run 1", 2.5), ("fast, run 2", 1.5)):
            found.append(_wall_target(b, "collect", f"spawnrun {mode}", "plain", limit, "collect"))
    return found + _exclusive_targets(b) + _leak_targets(b) + _overrun_targets(b)


def report(b: Bench) -> None:
    x = b.find("throughput", f"xdist -n {b.opts.xdist}")
    for case in ("throughput", "auto", "exclusive", "leak", "mixed", "collect"):
        rows = [m for m in b.results if m.case == case]
        if not rows:
            continue
        if case in ("mixed", "collect"):
            x = b.find(case, f"xdist -n {b.opts.xdist}")
        own_plain = ("exclusive", "mixed", "collect")
        plain = b.find(case if case in own_plain else "throughput", "plain")
        third = {"exclusive": "ms/test", "leak": "shared"}.get(case, "vs -n")
        print(f"\n{case}:")
        print(
            f"  {'run':38} {'wall':>7} {'at once':>11} {'vs plain':>8} {third:>8} "
            f"{'overruns':>8} {'NVML':>8}  result"
        )
        for m in rows:
            if m.outcome is None:
                print(f"  {m.mode:38} {m.skipped}")
                continue
            most, mean = m.checks["at_once"]
            if case == "exclusive":
                col = "-" if not plain or not plain.wall else f"{_per_test(b, m, plain):.0f}"
            elif case == "leak":
                col = str(len(m.checks.get("overlaps", [])))
            else:
                col = _fmt(_ratio(m, x))
            over = nv = "-"
            if m.spawnrun:
                over = str(len(m.checks["overruns_stamps"]) + len(m.checks["overruns_torch"]))
                nv = str(len(m.nvml["overruns"])) if m.nvml.get("available") else "n/a"
            name = m.mode + ("" if m.measured else " *")
            print(
                f"  {name:38} {m.outcome.wall:6.1f}s {most:>4} / {mean:4.2f} "
                f"{_fmt(_ratio(m, plain)):>8} {col:>8} {over:>8} {nv:>8}  {_result(m)}"
            )
        if case == "auto":
            print("  * learning run, not measured; ratios against the throughput case's runs")
            if b.opts.auto_learn == "once":
                print("  (default mode's run 2 ran on the cache that fast mode's runs left)")
        if case == "exclusive":
            for m in rows:
                if m.checks.get("gap_median") is not None:
                    print(
                        f"  {m.mode}: a test's end to the next one's start on its device: "
                        f"median {m.checks['gap_median']:.2f}s, max {max(m.checks['gaps']):.2f}s"
                    )
    print("\nNVML:", _nvml_line(b))
    print("\ntargets:")
    for t in targets(b):
        print(f"  {t.label} {t.limit}: {t.value or '-'} -> {t.verdict}")
    for m in b.results:
        for o in m.checks.get("overruns_stamps", [])[:3]:
            print(
                f"  overrun in {m.case}/{m.mode}: device {o['device']}: {o['demand'] / GIB:.1f} "
                f"of {o['total'] / GIB:.1f} GiB asked by {', '.join(o['nodeids'])}"
            )
        for line in (m.checks.get("overruns_torch", []) + m.nvml.get("overruns", []))[:3]:
            print(f"  overrun in {m.case}/{m.mode}: {line}")
        if m.checks.get("devices_unchecked"):
            print(
                f"  {m.case}/{m.mode}: memory unknown, not checked: {m.checks['devices_unchecked']}"
            )


def _per_test(b: Bench, m: Measured, plain: Measured) -> float:
    """Milliseconds per test over plain."""
    return ((m.wall or 0.0) - (plain.wall or 0.0)) / int(b.opts.exclusive_tests) * 1000


def _result(m: Measured) -> str:
    o = m.outcome
    if o is None:
        return m.skipped
    if m.ok:
        return o.tail
    if o.timed_out:
        return f"RUN FAILED: {o.tail}"
    said = [ln for ln in o.last_lines.splitlines() if "error" in ln.lower()]
    return (
        f"RUN FAILED (rc {o.returncode}, {o.passed}/{m.expected} passed): {(said or [o.tail])[-1]}"
    )


def _nvml_line(b: Bench) -> str:
    sampled = [m for m in b.results if m.nvml.get("available")]
    if not sampled:
        whys = {m.nvml.get("why", "") for m in b.results if m.nvml}
        return f"not sampled ({'; '.join(sorted(whys)) or 'no spawnrun run'})"
    most: dict[str, int] = {}
    for m in sampled:
        for d, k in m.nvml["most_processes_per_device"].items():
            most[d] = max(most.get(d, 0), k)
    return (
        f"{sum(m.nvml['samples'] for m in sampled)} samples in {len(sampled)} runs, "
        f"{sum(m.nvml['matched_to_stamps'] for m in sampled)} of "
        f"{sum(m.nvml['processes_seen'] for m in sampled)} (device, pid) pairs matched a "
        f"test's stamp; most processes on a device at once: "
        + (", ".join(f"{k} on {d}" for d, k in sorted(most.items())) or "-")
    )


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def main() -> None:
    parser = script_parser(__doc__)
    cases = ["throughput", "exclusive", "leak", "auto", "mixed", "collect"]
    parser.add_argument("--cpu", action="store_true", help="dry run without CUDA (see below)")
    parser.add_argument("-n", "--tests", type=int, help="throughput tests (64; --cpu: 8)")
    parser.add_argument("--body-seconds", type=float, help="work per test (0.3; --cpu: 0.1)")
    parser.add_argument(
        "--learn-body-seconds", type=float, default=0.05, help="work per test in learning runs"
    )
    parser.add_argument("--exclusive-tests", type=int, help="exclusive tests (12; --cpu: 4)")
    parser.add_argument("--xdist", type=int, help="xdist workers (8; --cpu: 2)")
    parser.add_argument("--cases", nargs="*", choices=cases, default=cases, help="only these")
    parser.add_argument(
        "--auto-learn",
        choices=["once", "each"],
        default="once",
        help="auto: one learning run (fast mode) for both modes, or one per mode in its own cache",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="throughput and exclusive: runs keep pytest's cache in their folder, after an "
        "untimed spawnrun run (a later run of a suite: spawn_pycache's bytecode is there)",
    )
    parser.add_argument(
        "--collect-context",
        action="store_true",
        help="collect: the conftest also makes a CUDA context while collecting",
    )
    parser.add_argument("--reserve", default="1GiB", help="per-process reserve (default 1GiB)")
    parser.add_argument(
        "--gpu-memory", default="80GiB", help="--cpu: declared memory per device (80GiB)"
    )
    parser.add_argument("--spawn-gpus", default="0,1", help="--cpu: declared devices (0,1)")
    parser.add_argument("--spawn-args", default="", help="more arguments for spawnrun runs")
    parser.add_argument("--nvml-interval", type=float, default=0.05, help="seconds (0.05)")
    parser.add_argument("--run-timeout", type=float, default=120, help="seconds per run (120)")
    parser.add_argument(
        "--deadline", type=float, help="seconds: no run starts after it, none ends 60 s past it"
    )
    parser.add_argument("--out", type=Path, help="JSON results (rewritten after every run)")
    parser.add_argument("--logs", type=Path, help="folder for the output of every run")
    opts = parser.parse_args()
    cpu = opts.cpu
    for name, gpu_default, cpu_default in (
        ("tests", 64, 8),
        ("body_seconds", 0.3, 0.1),
        ("exclusive_tests", 12, 4),
        ("xdist", 8, 2),
    ):
        if getattr(opts, name) is None:
            setattr(opts, name, cpu_default if cpu else gpu_default)
    if opts.logs:
        opts.logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="spawnrun-packing-") as tmp:
        b = Bench(opts, Path(tmp))
        gpu = "" if cpu else _gpu_name()
        b.host = {
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "gpu": gpu,
            "load": _load(),
        }
        print(
            f"python {b.host['python']}, {b.host['cpus']} CPUs, "
            f"{gpu or ('CPU dry run: devices ' + opts.spawn_gpus + ' of ' + opts.gpu_memory)}; "
            f"load average {_load()}"
        )
        print(
            f"{opts.tests} tests x {opts.body_seconds}s "
            f"(learning runs {opts.learn_body_seconds}s), "
            f"{opts.exclusive_tests} exclusive tests, reserve {opts.reserve}, per-run cap "
            f"{opts.run_timeout:.0f}s{f', deadline {opts.deadline:.0f}s' if opts.deadline else ''}"
        )
        print("planned runs (estimate if the targets are met):")
        rows = plan(b)
        for p in rows:
            print(
                f"  {p.case:10} {p.mode:38} {p.tests:3} tests  ~{p.estimate:4.0f}s  "
                f"{shlex.join(p.args)}  [{p.folder}]"
            )
        print(f"  in all ~{sum(p.estimate for p in rows) + 10:.0f}s ([folder]: own pytest cache)\n")
        execute(b)
        report(b)
        b.write_json()
        print(f"\n{b.elapsed():.0f}s in all; load average now {_load()}")
        if opts.out:
            print(f"results: {opts.out}")


if __name__ == "__main__":
    main()
