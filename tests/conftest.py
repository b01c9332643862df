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
    # The parent only: not a spawned child, nor an xdist worker (its controller records).
    if os.environ.get("SPAWNRUN_CHILD") != "1" and not os.environ.get("PYTEST_XDIST_WORKER"):
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

    Without an inventory a gpu-marked test is skipped ("needs 1 GPU, 0 available"),
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


FAKE_TORCH = {
    "torch/__init__.py": "from torch import cuda\n",
    "torch/cuda.py": (
        "_init = False\n"
        "def is_initialized():\n    return _init\n"
        "def _lazy_init():\n    global _init\n    _init = True\n"
        "def device_count():\n    return 1\n"
        "def memory_reserved(i):\n    return 3 * 2**20\n"
        "def max_memory_reserved(i):\n    return 5 * 2**20\n"
        "def memory_allocated(i):\n    import os\n    return int(os.environ.get('FAKE_HELD', 0))\n"
        "def zeros(n):\n    _lazy_init()\n    return [0] * n\n"
    ),
}


@pytest.fixture
def fake_torch(pytester: pytest.Pytester) -> None:
    """A tiny ``torch`` package whose CUDA "initializes" like the real one's, for CPU tests.

    It shadows the real torch inside the inner suite (the suite's folder comes first on
    sys.path), so CUDA-in-the-parent and CUDA-while-booting logic can be tested here.
    """
    for name, text in FAKE_TORCH.items():
        path = pytester.path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
