"""The wire between parent and child: how its messages travel, and what they may hold.

Runs in both processes; imports nothing from the rest of spawnrun but the wire's message
modules. The messages are frozen dataclasses, one per message: what the parent tells a
child (``_orders``), what a child tells the parent (``_replies``), and the zygote's
(``_forking``). Messages travel pickled over a ``multiprocessing`` pipe. Reports travel
as the JSON-safe dicts of ``pytest_report_to_serializable`` so structured tracebacks
survive.

Life of a child: it boots (imports, configures pytest, collects its node id; a child
started before its test was known reads ``Assign`` first) and sends ``Booted``; it then
waits for ``Go``, runs setup/call/teardown and streams ``Report`` / ``WarningRecord``
messages, then ``Interrupted`` if the test stopped the session, and always ``Done`` once
the test's teardown is over; ``After`` may follow with errors of the child's session end.
EOF before ``Done`` means the child died.

The parent decodes what a child sends with ``decode``, which builds the classes of the
message modules and plain data only: a child's message never makes the parent import
anything. The child sends test-made values (user properties, a report's extra
attributes) as plain data or as text (``plain``), and its messages cut to a size the
parent takes (``frame``).
"""

from __future__ import annotations

import builtins
import io
import pickle
from dataclasses import replace
from typing import Any

from spawnrun.wire import _forking
from spawnrun.wire import _orders
from spawnrun.wire import _replies

# Decoding and plain data ------------------------------------------------------------

#: The modules whose classes messages are, by name: a message is built of their
#: dataclasses and plain data only.
_MESSAGES = {module.__name__: module for module in (_orders, _replies, _forking)}
#: What a message may be built of besides the classes of the message modules: the builtins
#: that pickle by name (sets, tuples, dicts and the rest have opcodes of their own).
_WIRE_BUILTINS = frozenset({"complex", "bytearray", "frozenset", "set"})


class _WireUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _MESSAGES and isinstance(getattr(_MESSAGES[module], name, None), type):
            cls = getattr(_MESSAGES[module], name)
            if getattr(cls, "__dataclass_fields__", None) is not None:
                return cls
        if module == "builtins" and name in _WIRE_BUILTINS:
            return getattr(builtins, name)
        raise pickle.UnpicklingError(
            f"it holds a {module}.{name}, which is not part of spawnrun's protocol "
            "(the parent imports nothing a child names)"
        )


def decode(data: bytes) -> Any:
    """A message from its pickle, made of the message modules' classes and plain data only."""
    msg = _WireUnpickler(io.BytesIO(data)).load()
    kind = type(msg)
    if getattr(kind, "__dataclass_fields__", None) is None or kind.__module__ not in _MESSAGES:
        raise pickle.UnpicklingError(f"it is a {type(msg).__qualname__}, not a message")
    return msg


_PLAIN_LEAVES = (str, int, float, bool, type(None), bytes)
#: Deeper than this, a value travels as its repr (a structure that contains itself).
_PLAIN_DEPTH = 64


def plain(value: Any, text: Any = repr, depth: int = 0) -> Any:
    """``value`` as data any Python reads without imports: containers of plain leaves.

    A leaf of another type (a tensor, an instance of a class of the test's) becomes
    ``text(value)``; ``str`` subclasses become plain strings, tuple and list subclasses
    (named tuples) plain tuples and lists, mapping keys strings.
    """
    kind = type(value)
    if kind in _PLAIN_LEAVES:
        return value
    if depth < _PLAIN_DEPTH:
        if isinstance(value, dict):
            return {
                k if type(k) is str else _text(k, repr): plain(v, text, depth + 1)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [plain(v, text, depth + 1) for v in value]
        if isinstance(value, tuple):
            return tuple(plain(v, text, depth + 1) for v in value)
        if isinstance(value, str):
            return str.__str__(value)
    return _text(value, text)


def _text(value: Any, text: Any) -> str:
    for how in (text, repr):
        try:
            made = how(value)
        except Exception:  # noqa: BLE001 - a broken __str__ / __repr__ of the test's
            continue
        if type(made) is str:
            return made
        if isinstance(made, str):
            return str.__str__(made)
    return f"<unrepresentable {type(value).__qualname__}>"


# The size of what a child sends ------------------------------------------------------------

#: A child's message whose pickle is larger is cut before it is sent (``frame``): the
#: parent holds each child's message whole until it has arrived.
MESSAGE_LIMIT = 16 * 2**20
#: In a message being cut, a text keeps its last this many characters, and a list, tuple
#: or mapping its first this many entries.
CUT_TEXT = 64 * 1024
CUT_ITEMS = 1000


def frame(msg: Any) -> bytes:
    """``msg``'s pickle, from its plain data cut where the whole is over MESSAGE_LIMIT.

    A report whose traceback explains a 30 MB string, or a test that records a huge
    property, still reaches the parent, with the marker ``[spawnrun: ... cut`` where
    something was cut. Values over the limit without one long text or sequence (which
    nothing a test makes is) travel as they are, and the parent refuses them.
    """
    data = pickle.dumps(msg)
    if len(data) <= MESSAGE_LIMIT:
        return data
    fields = {f: _cut(getattr(msg, f), len(data)) for f in msg.__dataclass_fields__}
    return pickle.dumps(replace(msg, **fields))


def _cut(value: Any, size: int) -> Any:
    kind = type(value)
    if kind is str and len(value) > CUT_TEXT:
        cut = len(value) - CUT_TEXT
        return (
            f"[spawnrun: {cut} characters cut from a message of {size} bytes, over the "
            f"{MESSAGE_LIMIT} sent; the last {CUT_TEXT} follow]\n" + value[cut:]
        )
    if kind is dict:
        items = list(value.items())
        out = {k: _cut(v, size) for k, v in items[:CUT_ITEMS]}
        if len(items) > CUT_ITEMS:
            out["spawnrun"] = f"[spawnrun: {len(items) - CUT_ITEMS} entries cut]"
        return out
    if kind in (list, tuple):
        out_items = [_cut(v, size) for v in value[:CUT_ITEMS]]
        if len(value) > CUT_ITEMS:
            out_items.append(f"[spawnrun: {len(value) - CUT_ITEMS} entries cut]")
        return out_items if kind is list else tuple(out_items)
    return value
