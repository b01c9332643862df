"""Per-test overhead of isolation: plain pytest, pytest-forked, and spawnrun's modes.

Builds synthetic suites (one test per file) in a temporary folder and runs each, in one
invocation, with every selected mode. Repetitions are interleaved (round 1 of every
suite and mode, then round 2, ...) so that drift on the machine hits all modes alike.
Prints, per suite and mode, the median wall time (``--stat min``: the fastest), the
per-test overhead ((mode - plain) / N, plain of the same suite) and its ratio to
pytest-forked's overhead, then a "targets" block: each target, the measured value (and
the value of each round), and whether it was met.

Modes (``--modes``; plain and pytest-forked always run, ``--modes all`` runs every one):

    plain                      pytest in-process (``-p no:spawnrun``)
    pytest-forked              ``--forked``
    spawnrun default           ``--spawn-gpu`` and nothing else: spawn, default jobs and
                               lookahead (booting ahead on)
    spawnrun fast              ``--spawn-gpu --spawn-method forkserver --spawn-preload torch``
    spawnrun fast-nopreload    ``--spawn-gpu --spawn-method forkserver`` (not default)
    spawnrun fast, library template
                               fast mode with ``--spawn-template library`` (each child
                               collects its file; fast mode's default forks the tests
                               of a file from a template that collected it)
    spawnrun fast, run template
                               fast mode with ``--spawn-template run`` (not default): a
                               template collects its share of the run's files and forks
                               each of their tests (files of one test too)
    spawnrun default, scope module / spawnrun fast, scope module
                               the same with ``--spawn-scope module`` (not default): one
                               child per file, so give ``--per-file`` more than 1
    spawnrun spawn             pinned: one child at a time, nothing booted ahead (not default)
    spawnrun spawn+lookahead   pinned: one child at a time, one booted ahead (not default)
    spawnrun forkserver        pinned: one child at a time, forkserver + torch (not default)

Suites (``--suites``; default: the CPU ones, and every suite with ``--gpu``):

    trivial                a trivial torch test
    work-0.5s              ~0.5 s of torch CPU work
    fakedevice             a trivial torch test that also uses a fake fork-unsafe device
                           (examples/fakedevice.py); its conftest only declares the device
                           to spawnrun (hook ``pytest_spawnrun_device_state``)
    fakedevice-at-import   the same tests; the conftest also initializes the device at
                           import, so a forked child breaks as with CUDA (pytest-forked runs
                           with -x, only to show that it fails)
    cuda-trivial           a trivial CUDA test (``@pytest.mark.gpu``)
    cuda-work-0.5s         ~0.5 s of CUDA matmuls (``@pytest.mark.gpu``)
    cuda-at-import         cuda-trivial's tests; the conftest runs
                           ``torch.zeros(1, device="cuda")`` at import (pytest-forked: -x)

A suite whose conftest initializes a runtime at import is compared with its clean
reference suite (added when not selected): pytest-forked cannot run it.

    python benchmarks/speed.py                  # CPU suites
    python benchmarks/speed.py -n 6 -r 1 --suites trivial fakedevice-at-import
    python benchmarks/speed.py --gpu -n 12 --suites cuda-trivial cuda-at-import
                                                # adds the CUDA-context floor and the
                                                # spawnrun parent's GPU memory (nvidia-smi)

Every run keeps its temporary directories in a folder of this benchmark's own
(``PYTEST_DEBUG_TEMPROOT``): a run that makes a base temp (spawnrun's do, plain and
pytest-forked runs of these suites do not) removes old numbered ones at its exit, and in
the shared ``/tmp/pytest-of-<user>`` those may be other jobs' (seconds, measured here).

Needs pytest-forked, which is broken on pytest 9.2 (its report cannot be serialized):
run it where pytest < 9.2 (see README, Performance).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKEDEVICE = ROOT / "examples" / "fakedevice.py"

TORCH_TRIVIAL = """
import torch

def test_trivial_{i}():
    assert torch.ones(2).sum().item() == 2.0
"""

TORCH_WORK = """
import time
import torch

def test_work_{i}():
    end = time.monotonic() + 0.5
    a = torch.ones(64, 64)
    while time.monotonic() < end:
        a = (a @ a).clamp_(-1, 1)
"""

FAKE_TRIVIAL = """
import fakedevice
import torch

def test_fake_{i}():
    assert fakedevice.compute(21) == 42
    assert torch.ones(2).sum().item() == 2.0
"""

CUDA_TRIVIAL = """
import pytest
import torch

@pytest.mark.gpu
def test_cuda_{i}():
    assert torch.ones(1024, device="cuda").sum().item() == 1024.0
"""

CUDA_WORK = """
import time
import pytest
import torch

@pytest.mark.gpu
def test_cuda_work_{i}():
    a = torch.ones(2048, 2048, device="cuda")
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
"""

FAKE_HOOK = """
@pytest.hookimpl(optionalhook=True)
def pytest_spawnrun_device_state(config=None):
    # Declares the fork-unsafe runtime to spawnrun (config may be None in its template).
    return "fakedevice is initialized" if fakedevice.is_initialized() else None
"""

FAKE_CLEAN_CONFTEST = "import fakedevice\nimport pytest\n" + FAKE_HOOK

FAKE_AT_IMPORT_CONFTEST = f"""import fakedevice
import pytest

# Like a GPU project's conftest that touches CUDA at import: forked children now break.
fakedevice.init()
{FAKE_HOOK}"""

CUDA_AT_IMPORT_CONFTEST = """import torch

# As GPU projects' conftests often do: CUDA is now initialized in the pytest parent.
torch.zeros(1, device="cuda")
"""

#: Pins rootdir to the suite's folder; registers the marker for runs without spawnrun.
PYTEST_INI = "[pytest]\nmarkers =\n    gpu: run in a spawnrun child\n"


@dataclass(frozen=True)
class Suite:
    test: str
    conftest: str = ""
    gpu: bool = False
    #: Same tests, clean conftest: its pytest-forked overhead is the reference.
    reference: str | None = None
    #: The conftest initializes a fork-unsafe runtime at import: pytest-forked must fail.
    at_import: bool = False
    #: Copy examples/fakedevice.py next to the tests.
    fakedevice: bool = False
    note: str = ""


SUITES: dict[str, Suite] = {
    "trivial": Suite(TORCH_TRIVIAL),
    "work-0.5s": Suite(TORCH_WORK),
    "fakedevice": Suite(FAKE_TRIVIAL, FAKE_CLEAN_CONFTEST, fakedevice=True),
    "fakedevice-at-import": Suite(
        FAKE_TRIVIAL,
        FAKE_AT_IMPORT_CONFTEST,
        reference="fakedevice",
        at_import=True,
        fakedevice=True,
        note="conftest initializes a fake fork-unsafe device at import",
    ),
    "cuda-trivial": Suite(CUDA_TRIVIAL, gpu=True),
    "cuda-work-0.5s": Suite(CUDA_WORK, gpu=True),
    "cuda-at-import": Suite(
        CUDA_TRIVIAL,
        CUDA_AT_IMPORT_CONFTEST,
        gpu=True,
        reference="cuda-trivial",
        at_import=True,
        note='conftest runs torch.zeros(1, device="cuda") at import',
    ),
}
CPU_SUITES = ["trivial", "work-0.5s", "fakedevice", "fakedevice-at-import"]

NO_SPAWNRUN = ["-p", "no:spawnrun"]
PINNED = ["--spawn-gpu", "--spawn-jobs", "1"]
FAST = ["--spawn-gpu", "--spawn-method", "forkserver", "--spawn-preload", "torch"]
MODES: dict[str, list[str]] = {
    "plain": NO_SPAWNRUN,
    "pytest-forked": [*NO_SPAWNRUN, "--forked"],
    "spawnrun default": ["--spawn-gpu"],
    "spawnrun fast": FAST,
    "spawnrun fast-nopreload": ["--spawn-gpu", "--spawn-method", "forkserver"],
    "spawnrun fast, library template": [*FAST, "--spawn-template", "library"],
    "spawnrun fast, run template": [*FAST, "--spawn-template", "run"],
    "spawnrun default, scope module": ["--spawn-gpu", "--spawn-scope", "module"],
    "spawnrun fast, scope module": [*FAST, "--spawn-scope", "module"],
    "spawnrun spawn": [*PINNED, "--spawn-lookahead", "0"],
    "spawnrun spawn+lookahead": [*PINNED, "--spawn-lookahead", "1"],
    "spawnrun forkserver": [*PINNED, "--spawn-method", "forkserver", "--spawn-preload", "torch"],
}
ALWAYS = ["plain", "pytest-forked"]
DEFAULT_MODES = [*ALWAYS, "spawnrun default", "spawnrun fast"]
FAST_MODES = (
    "spawnrun fast",
    "spawnrun fast, library template",
    "spawnrun fast, run template",
    "spawnrun fast-nopreload",
    "spawnrun forkserver",
    "spawnrun fast, scope module",
)


@dataclass(frozen=True)
class Target:
    label: str
    suite: str
    mode: str
    limit: float
    #: With a reference: value = overhead / the reference's overhead (a ratio).
    #: Without: value = overhead in seconds per test.
    ref_suite: str | None = None
    ref_mode: str | None = None


TARGETS = [
    Target(
        "(a) H200: fast mode on cuda-at-import vs pytest-forked on cuda-trivial",
        "cuda-at-import",
        "spawnrun fast",
        1.5,
        "cuda-trivial",
        "pytest-forked",
    ),
    Target(
        "(a) H200: default mode on cuda-at-import vs default mode on cuda-trivial",
        "cuda-at-import",
        "spawnrun default",
        1.0,
        "cuda-trivial",
        "spawnrun default",
    ),
    Target(
        "(b) H200: fast mode vs pytest-forked, cuda-trivial",
        "cuda-trivial",
        "spawnrun fast",
        1.5,
        "cuda-trivial",
        "pytest-forked",
    ),
    Target(
        "(b) H200: default mode overhead, cuda-trivial", "cuda-trivial", "spawnrun default", 1.5
    ),
    Target(
        "(c) CPU: fast mode on fakedevice-at-import vs pytest-forked on fakedevice",
        "fakedevice-at-import",
        "spawnrun fast",
        2.0,
        "fakedevice",
        "pytest-forked",
    ),
    Target(
        "(c) CPU: fast mode vs pytest-forked, trivial",
        "trivial",
        "spawnrun fast",
        2.0,
        "trivial",
        "pytest-forked",
    ),
    Target(
        "(16) CPU: fast mode with --spawn-template run vs pytest-forked, trivial",
        "trivial",
        "spawnrun fast, run template",
        2.0,
        "trivial",
        "pytest-forked",
    ),
    Target(
        "(16) CPU: fast mode with scope module vs pytest-forked, trivial (--per-file > 1)",
        "trivial",
        "spawnrun fast, scope module",
        1.5,
        "trivial",
        "pytest-forked",
    ),
]

FLOOR = """
import time, torch
t = time.perf_counter()
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
print(time.perf_counter() - t)
"""


def make_suite(root: Path, name: str, n: int, per_file: int = 1) -> Path:
    suite = SUITES[name]
    folder = root / name.replace(".", "_")
    folder.mkdir()
    (folder / "pytest.ini").write_text(PYTEST_INI)
    (folder / "conftest.py").write_text(suite.conftest)
    if suite.fakedevice:
        shutil.copy(FAKEDEVICE, folder / "fakedevice.py")
    for first in range(0, n, per_file):
        tests = range(first, min(n, first + per_file))
        text = "".join(suite.test.format(i=i) for i in tests)
        (folder / f"test_{first:03d}.py").write_text(text)
    return folder


@dataclass
class Outcome:
    wall: float
    tail: str
    passed: int
    failed: int
    timed_out: bool
    returncode: int | None = None
    #: The last lines of stdout and of stderr (what a failed run said).
    last_lines: str = ""


def run_session(
    cmd: list[str],
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float,
    grace: float = 15.0,
) -> tuple[str, str, int, bool]:
    """``cmd`` in a session of its own: its stdout, stderr, return code and whether it
    ran past ``timeout``. Past it, SIGTERM (spawnrun ends its children), then after
    ``grace`` SIGKILL to the whole session, so that no process of this run is left
    running beside the next one (a GPU test's child would hold the device)."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return stdout, stderr, proc.returncode, False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", ""
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the session still runs
        except ProcessLookupError:
            pass
        if proc.returncode is None:
            more_out, more_err = proc.communicate()
            stdout, stderr = stdout + more_out, stderr + more_err
        return stdout, stderr, proc.returncode, True


def run(
    folder: Path,
    args: list[str],
    timeout: float,
    log: Path | None,
    *,
    env: dict[str, str] | None = None,
    cache: bool = False,
) -> Outcome:
    """One pytest run on ``folder``; ``cache``: with pytest's cache (else ``no:cacheprovider``)."""
    nocache = [] if cache else ["-p", "no:cacheprovider"]
    cmd = [sys.executable, "-m", "pytest", "-q", *nocache, str(folder), *args]
    start = time.perf_counter()
    stdout, stderr, returncode, timed_out = run_session(cmd, cwd=folder, env=env, timeout=timeout)
    wall = time.perf_counter() - start
    if log is not None:
        log.write_text(f"$ {' '.join(cmd)}\n# wall {wall:.2f}s\n{stdout}\n--- stderr\n{stderr}")
    lines = stdout.strip().splitlines() or stderr.strip().splitlines() or ["(no output)"]
    tail = lines[-1].strip()[-200:]
    if timed_out:
        tail = f"TIMED OUT after {timeout:.0f}s: {tail}"
    last = "\n".join([*stdout.strip().splitlines()[-12:], *stderr.strip().splitlines()[-8:]])
    passed = _count(r"(\d+) passed", tail)
    return Outcome(wall, tail, passed, _failures(tail), timed_out, returncode, last)


def _count(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    return int(found.group(1)) if found else 0


def _failures(tail: str) -> int:
    return sum(_count(rf"(\d+) {word}", tail) for word in ("failed", "errors?"))


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
                mib = used.strip().split()[0] if used.strip() else ""
                if pid.strip().isdigit() and int(pid) in parents and mib.isdigit():
                    self.max_mib = max(self.max_mib, int(mib))
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


class _Nothing:
    samples = 0
    max_mib = 0

    def __enter__(self) -> _Nothing:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


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


class Results:
    """Every run's outcome, by (suite, mode), in round order."""

    def __init__(self, n: int, stat: str = "median") -> None:
        self.n = n
        self.stat = statistics.median if stat == "median" else min
        self.runs: dict[tuple[str, str], list[Outcome]] = {}

    def add(self, suite: str, mode: str, outcome: Outcome) -> None:
        self.runs.setdefault((suite, mode), []).append(outcome)

    def has(self, suite: str, mode: str) -> bool:
        return bool(self.runs.get((suite, mode)))

    def wall(self, suite: str, mode: str) -> float:
        return self.stat([o.wall for o in self.runs[(suite, mode)]])

    def all_passed(self, suite: str, mode: str) -> bool:
        return all(
            o.passed == self.n and not o.failed and not o.timed_out
            for o in self.runs[(suite, mode)]
        )

    def overhead(self, suite: str, mode: str, rnd: int | None = None) -> float:
        """Seconds per test over plain (median or min, or round ``rnd``'s)."""
        if rnd is None:
            return (self.wall(suite, mode) - self.wall(suite, "plain")) / self.n
        mine = self.runs[(suite, mode)][rnd].wall
        return (mine - self.runs[(suite, "plain")][rnd].wall) / self.n


def script_parser(doc: str) -> argparse.ArgumentParser:
    """Line-buffered stdout, and a parser whose help is the script's docstring ``doc``."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    return argparse.ArgumentParser(
        description=doc.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(doc.split("\n")[1:]),
    )


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("-n", type=int, default=20, help="tests per suite (default 20)")
    parser.add_argument(
        "--per-file", type=int, default=1, help="tests per file (default 1; scope module: >1)"
    )
    parser.add_argument("-r", "--repeat", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--gpu", action="store_true", help="also the CUDA suites")
    parser.add_argument("--suites", nargs="*", choices=list(SUITES), help="only these suites")
    parser.add_argument(
        "--modes",
        nargs="*",
        choices=[*MODES, "all"],
        help="only these modes (plain and pytest-forked always run); 'all': every mode",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        help="seconds: start no further repetition that would likely end after this",
    )
    parser.add_argument(
        "--run-timeout", type=float, default=600, help="seconds one pytest run may take"
    )
    parser.add_argument(
        "--stat",
        choices=["median", "min"],
        default="median",
        help="wall time of a mode over the reps (min: robust to other load on the machine)",
    )
    parser.add_argument("--logs", type=Path, help="folder for the output of every run")
    opts = parser.parse_args()
    started = time.monotonic()

    names = list(dict.fromkeys(opts.suites or (list(SUITES) if opts.gpu else CPU_SUITES)))
    for name in list(names):
        ref = SUITES[name].reference
        if ref and ref not in names:
            print(f"(adding suite {ref!r}: the clean reference of {name!r})")
            names.insert(names.index(name), ref)
    if not opts.modes:
        modes = DEFAULT_MODES
    elif "all" in opts.modes:
        modes = list(MODES)
    else:
        modes = [*ALWAYS, *(m for m in MODES if m in opts.modes and m not in ALWAYS)]
    if opts.logs:
        opts.logs.mkdir(parents=True, exist_ok=True)

    root = Path(tempfile.mkdtemp(prefix="spawnrun-bench-"))
    gpu_name = _gpu_name() if opts.gpu else ""
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
        f"{', ' + gpu_name if gpu_name else ''}, N={opts.n}, up to {opts.repeat} reps"
        f"{f', deadline {opts.deadline:.0f}s' if opts.deadline else ''}; "
        f"load average {_load()}"
    )
    print(f"suites: {' '.join(names)}\nmodes: {', '.join(modes)}")
    results = Results(opts.n, opts.stat)
    memory: dict[tuple[str, str], ParentGpuMemory] = {}
    floor = None
    try:
        if opts.gpu:
            floor = _cuda_floor(opts.repeat)
            print(
                f"CUDA-context floor (first CUDA op in a fresh process that imported torch): "
                f"{floor * 1000:.0f} ms"
            )
        folders = {name: make_suite(root, name, opts.n, opts.per_file) for name in names}
        temproot = root / "pytest-tmp"
        temproot.mkdir()
        env = {**os.environ, "PYTEST_DEBUG_TEMPROOT": str(temproot)}
        # Untimed: the first run of all pays for cold file caches (torch, pytest).
        run(folders[names[0]], MODES["plain"], opts.run_timeout, None, env=env)
        rounds = 0
        for rnd in range(opts.repeat):
            round_start = time.monotonic()
            print(f"\nround {rnd + 1}:")
            for name in names:
                suite = SUITES[name]
                for mode in modes:
                    args = list(MODES[mode])
                    if mode == "pytest-forked" and suite.at_import:
                        args.append("-x")  # only to show it fails: stop at the first
                    sampling: ParentGpuMemory | _Nothing = _Nothing()
                    # Only spawnrun's parents must hold no GPU memory, and only where the
                    # conftest leaves CUDA alone.
                    if suite.gpu and not suite.at_import and mode.startswith("spawnrun"):
                        sampling = memory.setdefault((name, mode), ParentGpuMemory())
                    log = None
                    if opts.logs:
                        slug = f"{name}__{mode.replace(' ', '_')}__{rnd + 1}.txt"
                        log = opts.logs / slug
                    with sampling:
                        outcome = run(folders[name], args, opts.run_timeout, log, env=env)
                    results.add(name, mode, outcome)
                    print(f"  {name:22} {mode:26} {outcome.wall:7.2f}s  {outcome.tail}")
            rounds += 1
            took = time.monotonic() - round_start
            elapsed = time.monotonic() - started
            if opts.deadline and rnd + 1 < opts.repeat and elapsed + took * 1.1 > opts.deadline:
                print(
                    f"\nstopping after {rounds} of {opts.repeat} reps: another round "
                    f"(~{took:.0f}s) would pass the {opts.deadline:.0f}s deadline"
                )
                break
        print(
            f"\n{rounds} rep(s), {time.monotonic() - started:.0f}s in all; "
            f"load average now {_load()} (other work on the machine skews the figures)"
        )
        for name in names:
            _print_suite(results, name, modes, floor, memory)
        _print_targets(results, rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _print_suite(
    results: Results,
    name: str,
    modes: list[str],
    floor: float | None,
    memory: dict[tuple[str, str], ParentGpuMemory],
) -> None:
    suite = SUITES[name]
    ref = suite.reference or name
    forked_ok = results.has(ref, "pytest-forked") and results.all_passed(ref, "pytest-forked")
    forked = results.overhead(ref, "pytest-forked") if forked_ok else 0.0
    about = f" ({suite.note}; pytest-forked reference: {ref!r})" if suite.note else ""
    print(f"\nsuite {name!r}{about}:")
    print(
        f"  {'mode':26} {results.stat.__name__:>8} {'spread':>7} {'per-test overhead':>18} "
        f"{'vs forked':>10}  result"
    )
    for mode in modes:
        outcomes = results.runs[(name, mode)]
        walls = [o.wall for o in outcomes]
        median = results.wall(name, mode)
        spread = f"{max(walls) - min(walls):6.2f}s"
        tail = outcomes[-1].tail
        if mode == "pytest-forked" and suite.at_import:
            failed = all(o.failed for o in outcomes)
            verdict = "fails, as expected" if failed else "DID NOT FAIL: is the suite hostile?"
            print(f"  {mode + ' (-x)':26} {median:7.2f}s {spread} {'-':>18} {'-':>10}  {verdict}")
            continue
        over = results.overhead(name, mode)
        ratio = f"{over / forked:.2f}x" if mode != "plain" and forked > 0 else "-"
        flag = "" if results.all_passed(name, mode) else "  [NOT ALL PASSED]"
        print(
            f"  {mode:26} {median:7.2f}s {spread} {over * 1000:15.0f} ms {ratio:>10}  {tail}{flag}"
        )
    if suite.gpu and floor:
        for mode in FAST_MODES:
            if results.has(name, mode):
                fs = results.overhead(name, mode)
                print(f"  {mode} overhead / CUDA-context floor: {fs / floor:.2f}x")
    for (sname, mode), mem in memory.items():
        if sname == name:
            print(
                f"  {mode}: spawnrun's pytest parent, GPU memory, max over {mem.samples} "
                f"samples: {mem.max_mib} MiB"
            )


def _print_targets(results: Results, rounds: int) -> None:
    print("\ntargets:")
    shown = 0
    for t in TARGETS:
        needed = [(t.suite, t.mode), (t.suite, "plain")]
        if t.ref_suite and t.ref_mode:
            needed += [(t.ref_suite, t.ref_mode), (t.ref_suite, "plain")]
        if not results.has(t.suite, "plain"):
            continue  # its suite was not selected
        shown += 1
        limit = f"<= {t.limit:.1f}x" if t.ref_suite else f"<= {t.limit:.1f} s/test"
        head = f"  {t.label} {limit}:"
        missing = [f"{s}/{m}" for s, m in needed if not results.has(s, m)]
        if missing:
            print(f"{head} not measured (needs {', '.join(missing)})")
            continue
        broken = [f"{s}/{m}" for s, m in needed if not results.all_passed(s, m)]
        if broken:
            print(f"{head} INVALID: not every test passed in {', '.join(broken)}")
            continue
        value = _target_value(results, t, None)
        per_round = [_target_value(results, t, r) for r in range(rounds)]
        if value is None:
            print(f"{head} n/a: the reference overhead is not positive")
            continue
        verdict = "met" if value <= t.limit else "MISSED"
        if t.ref_suite:
            detail = (
                f"{value:.2f}x ({results.overhead(t.suite, t.mode) * 1000:.0f} ms vs "
                f"{results.overhead(t.ref_suite, t.ref_mode or '') * 1000:.0f} ms)"
            )
            rounds_text = " ".join("-" if v is None else f"{v:.2f}x" for v in per_round)
        else:
            detail = f"{value:.2f} s/test"
            rounds_text = " ".join("-" if v is None else f"{v:.2f}" for v in per_round)
        print(f"{head} {detail}; per round: {rounds_text}  -> {verdict}")
    if not shown:
        print("  (none of the selected suites has a target)")


def _target_value(results: Results, t: Target, rnd: int | None) -> float | None:
    over = results.overhead(t.suite, t.mode, rnd)
    if not t.ref_suite or not t.ref_mode:
        return over
    ref = results.overhead(t.ref_suite, t.ref_mode, rnd)
    return over / ref if ref > 0 else None


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _cuda_floor(repeat: int) -> float:
    floors = [
        float(
            subprocess.run(
                [sys.executable, "-c", FLOOR], capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(repeat)
    ]
    return statistics.median(floors)


def _gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split("\n")
    except (OSError, subprocess.TimeoutExpired):
        return ""
    names = [n.strip() for n in out if n.strip()]
    return f"{len(names)}x {names[0]}" if names else ""


if __name__ == "__main__":
    main()
