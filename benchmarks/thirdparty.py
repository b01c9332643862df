"""A project's own test suite, plain and under spawnrun, side by side in one run.

Runs the given test paths in ``--root`` (a checkout of the project, its package first on
``PYTHONPATH``) under plain pytest (spawnrun off), then under spawnrun with
``--spawn-args`` (fast mode and ``--spawn-gpu`` by default) ``--runs`` times, pytest's
cache kept between them (a second run has the first one's records). Each run writes a
junit XML; the report gives each run's wall time, its ratio to plain, and every test id
whose outcome differs from plain's (the parity check: isolation must not change what a
test does).

    python benchmarks/thirdparty.py --root .thirdparty/timm tests/test_layers.py
    python benchmarks/thirdparty.py --root ../peft --ids-file peft_ids.txt --forked \
        --pytest-args "-o addopts="

Nothing is fetched at run time: the project's checkout and its dependencies must be
there (``fetch`` gives the sources; ``docs/validation/performance.md`` says which were measured).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from speed import run_session


def outcomes(xml: Path) -> dict[str, str]:
    """Each test id's outcome in a junit XML (passed, failed, error, skipped)."""
    found: dict[str, str] = {}
    if not xml.exists():
        return found
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        how = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                how = {"failure": "failed"}.get(child.tag, child.tag)
                break
        found[name] = how
    return found


def run(root: Path, args: list[str], xml: Path, limit: float, log: Path | None, label: str) -> dict:
    command = [sys.executable, "-m", "pytest", *args, f"--junitxml={xml}", "-q"]
    print(f"  $ {shlex.join(command[1:])}", flush=True)
    # Which run this is, for a plugin given with --pytest-args that records per run.
    env = {**os.environ, "BENCH_RUN": label}
    start = time.monotonic()
    stdout, stderr, code, timed_out = run_session(command, cwd=root, env=env, timeout=limit)
    text = stdout + stderr
    if timed_out:
        code = -1
    wall = time.monotonic() - start
    if log is not None:
        log.write_text(text)
    tail = [line for line in text.splitlines() if line.strip()][-1:] or [""]
    print(f"    {wall:6.1f}s rc {code}: {tail[0]}", flush=True)
    return {"wall": wall, "rc": code, "tail": tail[0], "outcomes": outcomes(xml)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="test paths or ids, relative to --root")
    parser.add_argument("--ids-file", type=Path, help="more test ids, one per line")
    parser.add_argument(
        "--forked", action="store_true", help="a pytest-forked run too (--forked, spawnrun off)"
    )
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--spawn-args", default="--spawn-method forkserver --spawn-gpu")
    parser.add_argument(
        "--pytest-args", default="", help="given to every run, plain too (-p a_plugin, -k ...)"
    )
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--run-timeout", type=float, default=150)
    parser.add_argument("--logs", type=Path)
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args()
    root = opts.root.resolve()
    if opts.ids_file:
        lines = opts.ids_file.read_text().splitlines()
        opts.paths += [line.strip() for line in lines if line.strip()]
    if not opts.paths:
        parser.error("no test paths or ids given")
    configs = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
    if not any((root / name).exists() for name in configs):
        # pytest would look further up for one, and run the project's tests under
        # another project's settings (filterwarnings = error, say).
        parser.error(f"{root} has no pytest configuration of its own: carry the project's")
    shutil.rmtree(root / ".pytest_cache", ignore_errors=True)
    if opts.logs:
        opts.logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    rows = [("plain", ["-p", "no:spawnrun", "-p", "no:cacheprovider"])]
    if opts.forked:
        rows.append(("pytest-forked", ["-p", "no:spawnrun", "-p", "no:cacheprovider", "--forked"]))
    rows += [(f"spawnrun, run {i}", shlex.split(opts.spawn_args)) for i in range(1, opts.runs + 1)]
    for label, extra in rows:
        slug = label.replace(" ", "").replace(",", "_")
        log = opts.logs / f"{slug}.txt" if opts.logs else None
        print(f"{label}:", flush=True)
        args = [*opts.paths, f"--rootdir={root}", *shlex.split(opts.pytest_args), *extra]
        results[label] = run(root, args, root / f"{slug}.xml", opts.run_timeout, log, slug)
    plain = results["plain"]
    print(f"\n{len(plain['outcomes'])} test ids")
    print(f"  {'run':18} {'wall':>7} {'vs plain':>9}  differing ids")
    for label, r in results.items():
        ratio = r["wall"] / plain["wall"] if plain["wall"] else float("nan")
        differ = sorted(
            t for t in plain["outcomes"] if r["outcomes"].get(t) != plain["outcomes"][t]
        )
        r["differ"] = differ
        print(f"  {label:18} {r['wall']:6.1f}s {ratio:8.2f}x  {len(differ)}")
        for t in differ[:10]:
            print(f"      {t}: {plain['outcomes'][t]} -> {r['outcomes'].get(t, 'missing')}")
    counts: dict[str, int] = {}
    for how in plain["outcomes"].values():
        counts[how] = counts.get(how, 0) + 1
    print(f"  plain outcomes: {counts}")
    if opts.out:
        slim = {k: {**v, "outcomes": len(v["outcomes"])} for k, v in results.items()}
        opts.out.write_text(json.dumps({"ids": len(opts.paths), "runs": slim}, indent=1))


if __name__ == "__main__":
    main()
