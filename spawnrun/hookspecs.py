"""Hooks spawnrun offers to plugins and conftests."""

from __future__ import annotations

import pytest


@pytest.hookspec(firstresult=True)
def pytest_spawnrun_device_state(config: pytest.Config | None) -> str | None:
    """Name a fork-unsafe runtime initialized in this process, or return None.

    Called in the zygote's template (``--spawn-method forkserver``) before every fork,
    next to spawnrun's own checks for CUDA and threads. The template imports libraries
    only and has no pytest configuration: there, implementations found in the modules it
    imported (plugins, ``spawn_preload``) are called directly with ``config=None``, so
    declare ``def pytest_spawnrun_device_state(config=None)``. A non-empty answer makes
    the template refuse to fork and the run fall back to spawning, with a warning that
    quotes the answer. Implement it for device runtimes spawnrun does not know (a custom
    accelerator library).
    """
