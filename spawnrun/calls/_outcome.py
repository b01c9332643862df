"""What came of a ``spawnrun.call``, for its caller: the exceptions it raises, the
child's answer turned into the result or the exception the function raised, and a child
that died or ran out of time turned into a ``CallFailed`` with its stacks and output.

Runs wherever a user calls ``spawnrun.call`` (the caller's side only). Imports neither
pytest nor torch at import time (``_reports``, which brings pytest, only once a child
failed), nor cloudpickle: it reads the answer with ``pickle``.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from pathlib import Path
from typing import Any

STACKS = "Python stacks of all threads of the child"
OUTPUT = "child stdout/stderr (tail)"


class ChildTraceback(Exception):
    """The formatted traceback of an exception raised in the child (set as ``__cause__``)."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]) if self.args else ""


class CallError(Exception):
    """What came of the call cannot be brought to the caller.

    The function raised an exception that cannot be rebuilt here, or returned a result
    that cannot be pickled in the child or unpickled here.
    """


class CallFailed(RuntimeError):
    """The child ended without an answer: it crashed or was timed out."""

    def __init__(
        self, message: str, *, function: str, exitcode: int | None, stacks: str, output: str
    ) -> None:
        super().__init__(message)
        self.function = function
        self.exitcode = exitcode
        self.stacks = stacks
        self.output = output


class CallCrashed(CallFailed):
    """The child died (a signal, ``os._exit``) before returning."""


class CallTimeout(CallFailed):
    """The function did not return within the timeout; the child was killed."""


# Shown (and pickled) by their public names.
for _cls in (ChildTraceback, CallError, CallFailed, CallCrashed, CallTimeout):
    _cls.__module__ = "spawnrun"


def failure(
    name: str, limit: float | None, code: int | None, stacks_path: str, output_path: str
) -> CallFailed:
    """The exception for a child that timed out (``limit``) or died without an answer."""
    if limit is not None:
        kind: type[CallFailed] = CallTimeout
        text = f"spawnrun.call: {name} did not return within the timeout ({limit:g} s); killed"
    else:
        kind = CallCrashed
        text = f"spawnrun.call: the child running {name} {_death(code)} before returning"
    from spawnrun.wire._reports import tail

    stacks = tail(Path(stacks_path))
    output = tail(Path(output_path))
    for title, body in ((STACKS, stacks), (OUTPUT, output)):
        if body:
            text += f"\n--- {title} ---\n{body}"
    return kind(text, function=name, exitcode=code, stacks=stacks, output=output)


def _death(code: int | None) -> str:
    from spawnrun.wire._reports import killed_by

    killed = killed_by(code)
    return f"was {killed}" if killed else f"exited with status {code}"


def replay_output(path: str) -> None:
    """What the child printed, onto the caller's stdout (captured by pytest in a test)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return
    if text and sys.stdout is not None:
        sys.stdout.write(text)
        sys.stdout.flush()


def unpack(name: str, answer: tuple[Any, ...]) -> Any:
    __tracebackhide__ = True
    if answer[0] == "returned":
        try:
            return pickle.loads(answer[1])
        except Exception as exc:
            raise CallError(
                f"spawnrun.call: the result of {name} cannot be unpickled here"
            ) from exc
    if answer[0] == "unsendable":
        _, type_name, problem = answer
        raise CallError(
            f"spawnrun.call: {name} returned, but its result (a {type_name}) could not be "
            f"sent back to the caller: pickling it failed with {problem}"
        )
    _, data, type_name, message, text = answer
    error: object = None
    with contextlib.suppress(Exception):
        error = pickle.loads(data) if data is not None else None
    if not isinstance(error, BaseException):
        error = CallError(f"{name} raised {type_name}: {message} (it cannot be rebuilt here)")
    error.__cause__ = ChildTraceback(text)
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(f"spawnrun.call: raised in the child running {name} (traceback above)")
    raise error
