"""Hooks spawnrun offers to plugins and conftests."""

from __future__ import annotations

import pytest


@pytest.hookspec(firstresult=True)
def pytest_spawnrun_device_state(config: pytest.Config) -> str | None:
    """Name a fork-unsafe runtime initialized in this process, or return None.

    Called in the zygote (``--spawn-method forkserver``) before every fork, next to
    spawnrun's own checks for CUDA. A non-empty answer makes the zygote refuse to fork
    and the run fall back to spawning, with a warning that quotes the answer. Implement
    it for device runtimes spawnrun does not know (a custom accelerator library).
    """
