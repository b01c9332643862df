from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).parent

# Records every report the *parent* pytest process sees, so runs can be compared per
# (node id, phase). Children load the same conftest but never write the file.
RECORDER = """
import json, os
_seen = []

def pytest_runtest_logreport(report):
    _seen.append([report.nodeid, report.when, report.outcome, hasattr(report, "wasxfail")])

def pytest_sessionfinish(session):
    if os.environ.get("SPAWNRUN_CHILD") != "1":
        with open(os.environ["SPAWNRUN_TEST_OUTCOMES"], "w") as f:
            json.dump(_seen, f)
"""


class Outcomes:
    """Run an inner suite and read back the (node id, phase) outcomes the parent saw."""

    def __init__(self, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pytester = pytester
        self.path = pytester.path / "outcomes.json"
        monkeypatch.setenv("SPAWNRUN_TEST_OUTCOMES", str(self.path))
        monkeypatch.delenv("SPAWNRUN_CHILD", raising=False)
        self.conftest("")

    def conftest(self, extra: str) -> None:
        self.pytester.makeconftest(RECORDER + "\n" + extra)

    def run(self, *args: str) -> tuple[pytest.RunResult, list[tuple[str, str, str, bool]]]:
        if self.path.exists():
            self.path.unlink()
        result = self.pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
        seen = json.loads(self.path.read_text()) if self.path.exists() else []
        return result, [tuple(x) for x in seen]


@pytest.fixture(autouse=True)
def declared_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner runs get two declared GPUs: gpu-marked tests run, two at a time.

    Without an inventory a gpu-marked test is skipped ("needs 1 GPUs, 0 available"),
    as on any machine without GPUs; CUDA_VISIBLE_DEVICES set for the children is
    harmless on CPU.
    """
    monkeypatch.setenv("SPAWNRUN_GPUS", "0,1")
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID", "SPAWNRUN_JOBS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def outcomes(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Outcomes:
    return Outcomes(pytester, monkeypatch)


@pytest.fixture
def fakedevice(pytester: pytest.Pytester) -> None:
    """Make the demo's fork-unsafe fake device importable by the inner suite."""
    pytester.makepyfile(fakedevice=(HERE.parent / "examples" / "fakedevice.py").read_text())
