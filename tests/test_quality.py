"""Lint, format and strict typing are part of the suite, so CI enforces them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "tool, args",
    [
        ("ruff", ["check", "spawnrun", "tests", "examples", "benchmarks", "docs"]),
        ("ruff", ["format", "--check", "spawnrun", "tests", "examples", "benchmarks", "docs"]),
        ("mypy", []),
    ],
    ids=["ruff-check", "ruff-format", "mypy-strict"],
)
def test_tool_is_clean(tool, args):
    pytest.importorskip(tool)
    out = subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
