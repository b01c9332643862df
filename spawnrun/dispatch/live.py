"""Liveness: what a waiting test waits for, and whether anything can still move.

Runs in the parent; pure. The dispatcher asks ``can_move`` whenever the head of the queue
is blocked: some child must be in a state that ends by itself (a live process that will
send or exit, or a deadline), or another xdist worker must hold a device (its claim is
polled). If nothing can move, the head is reported with ``dump``: what it waited for and
the state of every child and device, so that the report says why instead of hanging.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spawnrun.devices import _packing
from spawnrun.dispatch.state import PEER
from spawnrun.dispatch.units import MOVING

if TYPE_CHECKING:
    from spawnrun.dispatch.queries import Queries


def can_move(run: Queries, head: str) -> bool:
    """Whether an event will still come that may let ``head`` start."""
    if any(c.state in MOVING for c in run.not_gone()):
        return True
    return run.peers_hold()


def explain(run: Queries, test: str) -> str:
    """What ``test`` waits for, in a phrase."""
    entry = run.tests[test]
    plan = entry.test
    if plan.scope and (child := run.scope_child(plan.scope)) is not None:
        if child.state.value == "running":
            return f"its scope's child (child {child.id}) to finish {child.test}"
    if plan.template and plan.template not in run.refused:
        template = run.templates.get(plan.template)
        if template is not None and template.state.value != "ready":
            return f"its template (child {template.id}) to start"
    if run.in_slot() >= run.settings.jobs:
        return f"a free slot ({run.settings.jobs} tests run at once)"
    need = "alone" if plan.need is None else _packing.show(plan.need)
    holders = []
    for device in run.pool.ids:
        for claim in run.pool.held(device):
            who = "another worker" if claim.token == PEER else f"child {claim.token[1:]}"
            holders.append(f"gpu {device}: {who}")
    held = "; ".join(holders) or "nothing holds a device"
    return f"{run.wanted(plan)} device(s) {need} ({held})"


def dump(run: Queries, test: str) -> str:
    """The report of a test nothing could start: what it waited for, and the whole state."""
    lines = [
        f"spawnrun: nothing could start this test: it waited for {explain(run, test)}, "
        "and no child or timer could change that (a scheduling bug: please report it)",
        "state:",
    ]
    for child in run.not_gone():
        lines.append("  " + child.describe())
    for tid in run.queue:
        lines.append(f"  waiting: {tid}")
    return "\n".join(lines)
