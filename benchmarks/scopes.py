"""Isolation per module against per test (issue 16's target), side by side in one run.

Builds a suite of ``--modules`` modules x ``--tests`` tests in a temporary folder. Each
module imports transformers and has a ``scope="module"`` fixture that builds a Llama of
~100M parameters (``LlamaConfig``, random weights, no download) on the GPU (``--cpu``: a
small one on the CPU), and each test greedily generates ``--tokens`` tokens with it.
Every test is ``@pytest.mark.gpu``; every fixture build appends a line to a file, so
the builds are counted. Runs, in this order: plain pytest, ``pytest -n <modules>``
(spawnrun off), spawnrun ``--spawn-scope module`` in default and fast mode, and
``--spawn-scope test`` in fast mode (capped: it builds the model for every test).
Prints wall, passed, fixture builds and the ratio to plain; ``--out`` keeps it as JSON.

    python benchmarks/scopes.py --out scopes.json          # on the H200 (.ci/gpu/scopes.sh)
    python benchmarks/scopes.py --cpu --modules 2 --tests 3  # dry run without CUDA
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed import PYTEST_INI  # noqa: E402
from speed import run  # noqa: E402
from speed import script_parser  # noqa: E402

MODULE = """
import json
import os
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

DEVICE = "cpu" if os.environ.get("SCOPES_CPU") else "cuda"
pytestmark = pytest.mark.gpu(count=0 if DEVICE == "cpu" else 1)


def event(what):
    with open(os.environ["SCOPES_EVENTS"], "a") as f:
        f.write(json.dumps([__name__, what, os.getpid(), time.time()]) + "\\n")


event("imported")


@pytest.fixture(scope="module")
def model():
    with open(os.environ["SCOPES_BUILDS"], "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    event("build")
    torch.manual_seed(0)
    config = LlamaConfig(**{config})
    built = LlamaForCausalLM(config).to(DEVICE).eval()
    event("built")
    return built


@pytest.mark.parametrize("i", range({tests}))
def test_generate(model, i):
    prompt = torch.tensor([[1 + i, 2, 3, 4]], device=DEVICE)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens={tokens}, do_sample=False)
    assert out.shape[1] == 4 + {tokens}
    event(f"test {{i}} done")
"""

GPU_CONFIG = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    vocab_size=32000,
)
CPU_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=512,
)
FAST = ["--spawn-method", "forkserver"]
OFF = ["-p", "no:spawnrun"]


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--cpu", action="store_true", help="a small model on the CPU")
    parser.add_argument("--modules", type=int, default=4)
    parser.add_argument("--tests", type=int, default=8, help="tests per module")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--run-timeout", type=float, default=150, help="seconds per run")
    parser.add_argument("--test-scope-timeout", type=float, default=90, help="the capped run")
    parser.add_argument("--runs", nargs="*", help="only these labels")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="runs keep pytest's cache in the suite's folder, after an untimed spawnrun run "
        "(a later run of the suite: bytecode and the template's exclusions are there)",
    )
    parser.add_argument(
        "--memory",
        help="add runs of scope module with this declared budget (--spawn-memory), e.g. 8GiB",
    )
    parser.add_argument(
        "--learned",
        action="store_true",
        help="add runs of scope module with --spawn-pack auto, after an untimed run that "
        "records the tests' peaks (a later run of the suite: its cache is kept)",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--logs", type=Path)
    o = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="spawnrun-scopes-"))
    suite = root / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text(PYTEST_INI)
    config = CPU_CONFIG if o.cpu else GPU_CONFIG
    for m in range(o.modules):
        text = MODULE.format(config=repr(config), tests=o.tests, tokens=o.tokens)
        (suite / f"test_model_{m}.py").write_text(text)
    runs = [
        ("plain", OFF, o.run_timeout, False),
        (f"xdist -n {o.modules}", [*OFF, "-n", str(o.modules)], o.run_timeout, False),
        ("spawnrun default, scope module", ["--spawn-scope", "module"], o.run_timeout, False),
        ("spawnrun fast, scope module", [*FAST, "--spawn-scope", "module"], o.run_timeout, False),
    ]
    if o.memory:
        declared = ["--spawn-scope", "module", "--spawn-memory", o.memory]
        runs += [
            (f"spawnrun default, scope module, memory {o.memory}", declared, o.run_timeout, False),
            (
                f"spawnrun fast, scope module, memory {o.memory}",
                [*FAST, *declared],
                o.run_timeout,
                False,
            ),
        ]
    if o.learned:
        auto = ["--spawn-scope", "module", "--spawn-pack", "auto"]
        runs += [
            ("spawnrun default, scope module, pack auto", auto, o.run_timeout, True),
            ("spawnrun fast, scope module, pack auto", [*FAST, *auto], o.run_timeout, True),
        ]
    runs.append(
        (
            "spawnrun fast, scope test (capped)",
            [*FAST, "--spawn-scope", "test"],
            o.test_scope_timeout,
            False,
        )
    )
    if o.runs:
        runs = [r for r in runs if r[0] in o.runs]
    if o.logs:
        o.logs.mkdir(parents=True, exist_ok=True)
    results = []
    n = o.modules * o.tests
    print(f"{o.modules} modules x {o.tests} tests, {'CPU' if o.cpu else 'GPU'} Llama {config}")
    base = {**os.environ, "SCOPES_BUILDS": os.devnull, "SCOPES_EVENTS": os.devnull}
    if o.cpu:
        base["SCOPES_CPU"] = "1"
    # Untimed: the first run of all pays for cold file caches.
    run(suite, [*OFF, "--co"], o.run_timeout, None)
    if o.warm or o.learned:
        # A spawnrun run that leaves bytecode, the template's exclusions and (with
        # --learned) the tests' peaks in the suite's cache, for the runs that keep it.
        learn = [*FAST, "--spawn-scope", "module", "--spawn-pack", "auto"]
        run(suite, learn, o.run_timeout, None, env=base, cache=True)
    for label, args, limit, learned in runs:
        builds = root / f"builds-{len(results)}.txt"
        events = root / f"events-{len(results)}.jsonl"
        env = {**base, "SCOPES_BUILDS": str(builds), "SCOPES_EVENTS": str(events)}
        log = (
            o.logs / f"{len(results):02d}_{label.split(',')[0].replace(' ', '_')}.txt"
            if o.logs
            else None
        )
        began = time.time()
        out = run(suite, args, limit, log, env=env, cache=o.warm or learned)
        count = len(builds.read_text().splitlines()) if builds.exists() else 0
        row = {
            "run": label,
            "wall": out.wall,
            "passed": out.passed,
            "failed": out.failed,
            "timed_out": out.timed_out,
            "builds": count,
            "tail": out.tail,
            "began": began,
            "timeline": timeline(events, began),
        }
        results.append(row)
        print(
            f"  {label:44} {out.wall:6.1f}s {out.passed:3d}/{n} passed {count:3d} builds"
            f"  {out.tail}"
        )
        for line in row["timeline"]:
            print(f"      {line}")
        if o.out:
            o.out.write_text(json.dumps(results, indent=1))
    plain = next((r for r in results if r["run"] == "plain"), None)
    if plain and plain["passed"] == n:
        print("\nvs plain (target for scope module: <= 1.3x, with one build per module):")
        for r in results[1:]:
            ok = r["passed"] == n and not r["timed_out"]
            note = "" if ok else f" (not every test passed: {r['passed']}/{n})"
            print(f"  {r['run']:44} {r['wall'] / plain['wall']:5.2f}x  builds {r['builds']}{note}")


def timeline(events: Path, began: float) -> list[str]:
    """Per module and process, seconds from the run's start: imported, build, built, last test."""
    if not events.exists():
        return []
    seen: dict[tuple[str, int], dict[str, float]] = {}
    for line in events.read_text().splitlines():
        module, what, pid, at = json.loads(line)
        marks = seen.setdefault((module, pid), {})
        if what.startswith("test "):
            marks.setdefault("first test done", at - began)
            what = "last test done"
        marks[what] = max(marks.get(what, 0.0), at - began)
    rows = []
    for (module, pid), marks in sorted(seen.items(), key=lambda kv: min(kv[1].values())):
        shown = ", ".join(f"{k} {v:.1f}" for k, v in marks.items())
        rows.append(f"{module} pid {pid}: {shown}")
    return rows


if __name__ == "__main__":
    main()
