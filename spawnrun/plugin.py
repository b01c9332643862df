"""The ``pytest11`` entry point: options, marker, and the decision "spawn or not".

Runs in the parent (and, inert, in every child: there it only registers the marker
and options so the child's configuration matches the parent's). Wiring only; process
code lives in ``_runner`` and ``_replay``.
"""

from __future__ import annotations

import pytest

from spawnrun import _child
from spawnrun import _replay
from spawnrun import _runner
from spawnrun import _settings

SETTINGS_KEY = pytest.StashKey[_settings.Settings]()
ITEM_KEY = pytest.StashKey[dict]()


@pytest.hookimpl
def pytest_addoption(parser: pytest.Parser) -> None:
    _settings.add_options(parser)


@pytest.hookimpl
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _settings.marker_doc())
    if _child.ACTIVE:
        return
    config.stash[SETTINGS_KEY] = _settings.resolve(config)


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
    _replay.run_spawned(item, nextitem, timeout)
    return True
