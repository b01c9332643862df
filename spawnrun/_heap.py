"""The parent's objects at the session's end: frozen where no test ran in this process.

Runs in the parent. pytest (8.4 and later) collects garbage five times as its
configuration ends, so that what the session left behind reports its unraisable
exceptions. Each collection walks every object the process holds: with torch imported,
~250,000 of them, and the passes took 0.28-0.41 s of a 40-test run here, plain pytest
and spawnrun's parent alike. That time is serial: nothing else runs at a session's end.

Where every test ran in a child, the parent's objects are its collection's and
spawnrun's own. One collection here finalizes what of them is garbage (its unraisable
exceptions are reported as pytest's first pass would report them); freezing what is
left (``gc.freeze``) leaves pytest's passes only the objects made after it.

Nothing changes where a test ran in this process (``--no-spawn``, a test that does not
spawn): its garbage is collected as plain pytest collects it. Nor where pytest makes no
such passes (before 8.4, or an in-process pytester run, which turns them off): then
there is nothing to spare, and the process may go on to run other sessions.
"""

from __future__ import annotations

import gc

import pytest

#: Whether a test ran in this process (set by the first one).
RAN_HERE_KEY = pytest.StashKey[bool]()


def ran_here(config: pytest.Config) -> None:
    """A test's protocol runs in this process."""
    config.stash[RAN_HERE_KEY] = True


def freeze_if_spared(config: pytest.Config) -> bool:
    """At unconfigure: collect once and freeze, where no test ran here and pytest is
    about to make its passes. Whether it did."""
    if config.stash.get(RAN_HERE_KEY, False) or not _pytest_collects_at_end(config):
        return False
    gc.collect()
    gc.freeze()
    return True


def _pytest_collects_at_end(config: pytest.Config) -> bool:
    """Whether pytest's cleanup will collect garbage (its stash key, 8.4 and later; an
    in-process pytester run sets it to 0). A private name, read only here."""
    if not config.pluginmanager.has_plugin("unraisableexception"):
        return False  # -p no:unraisableexception
    try:
        from _pytest.unraisableexception import gc_collect_iterations_key
    except ImportError:
        return False
    return config.stash.get(gc_collect_iterations_key, 5) > 0
