"""The scheduling core: a pure dispatcher (events in, actions out) and its state machines.

Runs in the parent and does no I/O: ``events`` (the data), ``units`` (a child's life),
``state`` (tests, children, claims), ``queries`` (what is asked of them), ``live`` (what
waits for what), ``ends`` (how children end), ``starts`` (placing and starting tests),
``core`` (the events and the decisions). The driver performs the actions and turns what
happens into events.
"""

from __future__ import annotations

from spawnrun.dispatch.core import Dispatcher

__all__ = ["Dispatcher"]
