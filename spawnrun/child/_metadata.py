"""The installed packages' metadata, read once by the template for every fork's pytest.

Each pytest configuration reads the metadata of every installed distribution twice:
pluggy loads the ``pytest11`` entry points of all of them, and pytest lists every file
of each plugin's distribution to mark its modules for assertion rewriting. On the H200
image (ten plugins, hypothesis's and jaxtyping's files among them) that was half of a
forked child's configuration (run 37: ``_mark_plugins_for_rewrite`` 66 ms and
``load_setuptools_entrypoints`` 38 ms of 146 ms per child, profiled on two cores).

The library template reads them once (``snapshot``), as the parent's pytest read them
at its start; a child forked from it configures pytest and collects with
``importlib.metadata.distributions()`` answered from that reading
(``while_configuring``), and gets the function back before its test runs.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

_snapshot: list[_Read] | None = None


class _Read(importlib.metadata.Distribution):
    """A distribution whose metadata, entry points and files are read once."""

    def __init__(self, dist: importlib.metadata.Distribution) -> None:
        self._dist = dist
        self._texts: dict[str, str | None] = {}

    def read_text(self, filename: str) -> str | None:
        if filename not in self._texts:
            self._texts[filename] = self._dist.read_text(filename)
        return self._texts[filename]

    def locate_file(self, path: Any) -> Any:
        return self._dist.locate_file(path)

    @functools.cached_property
    def metadata(self) -> Any:
        return self._dist.metadata

    @functools.cached_property
    def entry_points(self) -> Any:
        return self._dist.entry_points

    @functools.cached_property
    def files(self) -> Any:
        return self._dist.files


def snapshot() -> None:
    """Read every distribution's entry points, and each pytest plugin's files and
    metadata, as pytest and pluggy will ask them (once per process)."""
    global _snapshot
    if _snapshot is not None:
        return
    try:
        read = [_Read(dist) for dist in importlib.metadata.distributions()]
        for dist in read:
            if any(ep.group == "pytest11" for ep in dist.entry_points):
                _ = dist.metadata
                for file in dist.files or []:
                    str(file)  # a path keeps its string: pytest asks it of each file
    except Exception:  # noqa: BLE001 - a broken distribution: each child reads them all
        return
    _snapshot = read


def while_configuring() -> Callable[[], None]:
    """Answer ``importlib.metadata.distributions()`` from the snapshot until the result
    is called (nothing where this process has none: a spawned child)."""
    if _snapshot is None:
        return lambda: None
    original = importlib.metadata.distributions
    read = _snapshot

    def distributions(**kwargs: Any) -> Iterable[importlib.metadata.Distribution]:
        if kwargs:
            return original(**kwargs)
        return iter(read)

    importlib.metadata.distributions = distributions

    def restore() -> None:
        if importlib.metadata.distributions is distributions:
            importlib.metadata.distributions = original

    return restore
