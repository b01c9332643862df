"""The order a batch of the dispatcher's actions is performed in: one rule, for the
driver (``spawnrun.driver._perform``) and the simulator (``tests/sim``) alike.

Pure: no I/O. A test that may go now goes before children for later tests are started
(a fork request waits for the template's answer, and the test must not); a child that
another action of the batch names (its ``Go``, a ``Dismiss``, a ``Kill``) is started
where it stands, so that what names it finds it started. Otherwise the batch's order
stays.
"""

from __future__ import annotations

from spawnrun.dispatch import events as ev


def performed(actions: list[ev.Action]) -> list[ev.Action]:
    """``actions`` in the order they are performed."""
    named = {a.child for a in actions if isinstance(a, (ev.Go, ev.Dismiss, ev.Kill))}

    def later(action: ev.Action) -> bool:
        return isinstance(action, ev.Start) and action.child not in named

    return sorted(actions, key=later)  # stable: the order within each stays
