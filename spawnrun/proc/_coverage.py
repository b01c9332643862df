"""Coverage measurement in children: the parent's coverage, continued in each child.

Runs in both processes and imports only the standard library: ``coverage`` is imported
only where it is already loaded (the parent) or asked for (a child of a measured parent),
so children of an unmeasured run pay nothing.

The parent, when it runs under coverage (``coverage run``, or pytest-cov's ``--cov``),
hands each child its coverage configuration. The child then measures itself from its
start, into a data file of its own (a ``.coverage.<host>.pid<N>.<random>`` suffix, as
coverage's parallel mode names them), and saves it when it leaves (``_child.leave``:
children end with ``os._exit``, which skips the interpreter's own exit). ``coverage
combine`` (or pytest-cov, which combines at the end of the run) picks the files up.

A child that already measures itself, through the user's own configuration (coverage's
``patch = ["subprocess"]`` or ``concurrency = ["multiprocessing"]``), is left alone. A
child forked from the template is not: what it inherited measured the template (which
never runs a test) and would save the template's data under the child's name, so it is
stopped and a fresh measurement started.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

#: coverage's prefix for configuration given as serialized data instead of a file name.
_DATA_PREFIX = ":data:"

#: The measurement this process started (a child's), saved by ``save``.
_started: Any = None


def parent_config() -> str:
    """The configuration of the coverage measuring this process ("" if none).

    Only with a coverage that can serialize its configuration (7.10 and later); with an
    older one, children are measured only through the user's own configuration.
    """
    if "coverage" not in sys.modules:
        return ""
    try:
        current = sys.modules["coverage"].Coverage.current()
        if current is None:
            return ""
        return _DATA_PREFIX + str(current.config.serialize())
    except Exception:  # noqa: BLE001 - an unexpected coverage: measure nothing more
        return ""


def start(config: str, forked: bool) -> None:
    """Measure this child with the parent's ``config``; ``forked``: a fork of the template."""
    global _started
    if not config:
        return
    try:
        from coverage import Coverage

        inherited = Coverage.current()
        if inherited is not None:
            if not forked:
                return  # the user's configuration measures this process already
            _discard(inherited)
        cov = Coverage(config_file=config, data_suffix=True)
        cov.start()
        _started = cov
    except Exception:  # noqa: BLE001 - coverage's trouble must not fail the test
        return


def _discard(inherited: Any) -> None:
    """Stop the template's measurement in a forked child, and keep it from saving at exit.

    Coverage offers no public "forget this measurement"; its own fork support
    (``patch = ["fork"]``) clears this flag for the same reason.
    """
    inherited.stop()
    with contextlib.suppress(AttributeError):
        inherited._auto_save = False


def save() -> None:
    """Stop and save the measurement ``start`` began (the child is about to leave)."""
    global _started
    cov, _started = _started, None
    if cov is None:
        return
    with contextlib.suppress(Exception):
        cov.stop()
        cov.save()
