"""Fast mode is faithful: a forked test observes what a spawned one observes.

The differential oracle: generated suites (``faithful_suites``) record what each test
sees at configure, collection, import and run time; each runs plainly (outcomes only),
spawned, in fast mode twice (the second with the first's cache, after the spawned run
wrote its own), and with ``--spawn-scope module`` both ways. Every test's observations
in fast mode must equal the spawned run's, first and second run.
"""

from __future__ import annotations

import os
from pathlib import Path

import faithful_suites
import pytest

#: Suites run in CI; ``SPAWNRUN_ORACLE_SEEDS=0-40`` runs more (a range or a list).
SEEDS = os.environ.get("SPAWNRUN_ORACLE_SEEDS", "1,2,3")


def _seeds(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",") if s]


def _run(
    pytester: pytest.Pytester, out: Path, name: str, *args: str
) -> tuple[pytest.RunResult, dict[str, dict[str, object]]]:
    path = out / f"{name}.jsonl"
    os.environ["ORACLE_OUT"] = str(path)
    result = pytester.runpytest_subprocess("--spawn-gpus", "2", "-p", "no:randomly", *args)
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    return result, faithful_suites.observations(path)


def _outcomes(result: pytest.RunResult) -> dict[str, int]:
    kept = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")
    return {k: v for k, v in result.parseoutcomes().items() if k in kept}


@pytest.mark.parametrize("seed", _seeds(SEEDS))
def test_fast_mode_observes_what_a_spawned_child_observes(
    pytester: pytest.Pytester,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
) -> None:
    site = tmp_path_factory.mktemp("site")
    out = tmp_path_factory.mktemp("observed")
    shape = faithful_suites.write(pytester.path, site, seed)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site)])))
    monkeypatch.setenv("ORACLE_OUTER", "outer")
    monkeypatch.setenv("ORACLE_OUT", "")
    plain, _ = _run(pytester, out, "plain", "--no-spawn")
    outcomes = _outcomes(plain)
    assert outcomes.get("passed") and set(outcomes) == {"passed"}, shape
    fast = ("--spawn-method", "forkserver")
    modes = {
        "spawned": (),
        "fast, first run": fast,
        "fast, second run": fast,
    }
    seen = {}
    for name, args in modes.items():
        result, seen[name] = _run(pytester, out, name.replace(" ", "_"), *args)
        assert _outcomes(result) == outcomes, (name, shape, result.stdout.str())
    module = ("--spawn-scope", "module")
    _, seen["spawned, module scope"] = _run(pytester, out, "module", *module)
    _, seen["fast, module scope"] = _run(pytester, out, "fast_module", *module, *fast)
    assert len(seen["spawned"]) == outcomes["passed"], shape
    for name in ("fast, first run", "fast, second run"):
        differ = _differences(seen["spawned"], seen[name])
        assert not differ, f"{name}: {shape}: {differ}"
    differ = _differences(seen["spawned, module scope"], seen["fast, module scope"])
    assert not differ, f"module scope: {shape}: {differ}"


def _differences(
    spawned: dict[str, dict[str, object]], fast: dict[str, dict[str, object]]
) -> dict[str, object]:
    """Per node id, what fast mode saw otherwise: {key: (spawned, fast)}."""
    out: dict[str, object] = {}
    for nodeid in sorted(spawned.keys() | fast.keys()):
        if nodeid not in spawned or nodeid not in fast:
            out[nodeid] = "recorded in one run only"
            continue
        keys = spawned[nodeid].keys() | fast[nodeid].keys()
        differ = {
            k: (spawned[nodeid].get(k), fast[nodeid].get(k))
            for k in sorted(keys)
            if spawned[nodeid].get(k) != fast[nodeid].get(k)
        }
        if differ:
            out[nodeid] = differ
    return out
