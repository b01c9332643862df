"""The ``pytest11`` entry point: options, marker, and the decision "spawn or not".

Runs in the parent (and, inert, in every child: there it only registers the marker
and options so the child's configuration matches the parent's). Wiring only; process
code lives in ``_runner`` and ``_replay``.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import pytest

from spawnrun import _child
from spawnrun import _cudawatch
from spawnrun import _devices
from spawnrun import _replay
from spawnrun import _runner
from spawnrun import _settings

SETTINGS_KEY = pytest.StashKey[_settings.Settings]()
ITEM_KEY = pytest.StashKey[dict[str, Any]]()
SETTLE_WAITS_KEY = pytest.StashKey[list[tuple[str, float]]]()
#: Waits for device memory longer than this are listed in the terminal summary.
LONG_SETTLE = 1.0


@pytest.hookimpl
def pytest_addoption(parser: pytest.Parser) -> None:
    _settings.add_options(parser)


@pytest.hookimpl
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _settings.marker_doc())
    if _child.ACTIVE:
        return
    config.stash[SETTINGS_KEY] = _settings.resolve(config)
    config.stash[SETTLE_WAITS_KEY] = []
    _cudawatch.watch()
    _install_sigterm(config)


def _install_sigterm(config: pytest.Config) -> None:
    # Python dies on SIGTERM without running any cleanup, which would orphan the
    # children (each leads its own session). Turn it into an interrupt instead,
    # unless someone else already handles SIGTERM.
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        _runner.kill_all_live()
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)

    def restore() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    config.add_cleanup(restore)


@pytest.hookimpl
def pytest_collectstart() -> None:
    # torch may first be imported by a test module: watch its CUDA init from then on.
    _cudawatch.watch()


@pytest.hookimpl
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    waits = terminalreporter.config.stash.get(SETTLE_WAITS_KEY, [])
    if waits:
        terminalreporter.section("spawnrun: waits for device memory")
        for nodeid, seconds in waits:
            terminalreporter.write_line(f"{seconds:.1f}s after {nodeid}")


@pytest.hookimpl
def pytest_report_header(config: pytest.Config) -> list[str]:
    settings = config.stash.get(SETTINGS_KEY, None)
    if settings is None:
        return []
    if settings.forced_inprocess:
        return [settings.forced_inprocess]
    if settings.no_spawn:
        return ["spawnrun: --no-spawn given, every test runs in-process"]
    what = "every test" if settings.spawn_gpu else f"tests marked {_settings.MARKER}"
    return [f"spawnrun: {what} run in a fresh spawn child"]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Validate every selected test's marker now, so a typo is a usage error before
    # anything runs, not a surprise halfway through a GPU suite.
    if config.stash.get(SETTINGS_KEY, None) is None:
        return
    for item in items:
        item.stash[ITEM_KEY] = _settings.marker_overrides(item)


def _should_spawn(item: pytest.Item, settings: _settings.Settings) -> bool:
    if settings.no_spawn or settings.forced_inprocess:
        return False
    return settings.spawn_gpu or item.get_closest_marker(_settings.MARKER) is not None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    settings = item.config.stash.get(SETTINGS_KEY, None)
    if settings is None or not _should_spawn(item, settings):
        return None
    config = item.config
    if _replay.OPTIONS_KEY not in config.stash:
        config.stash[_replay.OPTIONS_KEY] = _runner.forwarded_options(config)
    overrides = item.stash.get(ITEM_KEY, None)
    if overrides is None:  # collected without our modifyitems (e.g. by another plugin)
        overrides = _settings.marker_overrides(item)
    timeout = overrides.get("timeout", settings.timeout)
    # Tests spawned only because of --spawn-gpu ask for no device.
    marked = item.get_closest_marker(_settings.MARKER) is not None
    uses_device = marked and overrides.get("count", settings.count) > 0
    _cudawatch.check(config)
    baseline = _devices.used_memory() if uses_device and settings.settle else None
    _replay.run_spawned(item, nextitem, timeout)
    if baseline:
        waited = _devices.settle(baseline, settings.settle or 0.0)
        if waited > LONG_SETTLE:
            config.stash[SETTLE_WAITS_KEY].append((item.nodeid, waited))
    return True


def _spawns(item: pytest.Item) -> bool:
    settings = item.config.stash.get(SETTINGS_KEY, None)
    return settings is not None and _should_spawn(item, settings)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item) -> bool | None:
    # pytest-timeout in the parent would fire its alarm inside spawnrun's own wait;
    # the child runs pytest-timeout for the test itself, so the parent stands aside.
    return True if _spawns(item) else None


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    return True if _spawns(item) else None
