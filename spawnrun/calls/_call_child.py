"""``spawnrun.call``'s child: isolate, run the function, send back what came of it.

Runs in the child only; imports neither pytest nor torch (of spawnrun, only the
stdlib-only ``_probe``), so the child boots with only what the function itself needs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import traceback
import types
from multiprocessing.connection import Connection
from typing import Any

from spawnrun.proc import _probe


def main(payload: bytes, conn: Connection, workdir: str, unlink: bool = False) -> None:
    """The child: isolate, run the function, send what came of it, exit normally.

    Returning lets multiprocessing end the interpreter the normal way, so the function's
    libraries get their exit work (threads joined, ``atexit`` handlers).
    """
    _probe.die_with_parent()
    # Own session: the caller can kill everything the function started with one signal.
    os.setsid()
    # Processes the function starts (os.system, posix_spawn) must not hold the answer
    # pipe or multiprocessing's exit sentinel open: the caller would miss this exit.
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if int(name) > 2:
                    os.set_inheritable(int(name), False)
    fd = os.open(os.path.join(workdir, "output.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # A bare descriptor, never closed: a file object would warn at exit under -X dev.
    stacks = os.open(os.path.join(workdir, "stacks.txt"), os.O_WRONLY | os.O_CREAT, 0o600)
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
    if unlink:  # the caller holds them open: nothing is left if both are killed
        with contextlib.suppress(OSError):
            for name in ("output.log", "stacks.txt"):
                os.unlink(os.path.join(workdir, name))
            os.rmdir(workdir)
    answer: tuple[Any, ...]
    try:
        fn, args, kwargs, filename = pickle.loads(payload)
        _refile(fn, filename)
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the caller gets every failure
        answer = _raised(exc)
    else:
        answer = _returned(result)
    with conn:
        conn.send(answer)


def _refile(fn: Any, filename: str) -> None:
    """Give ``fn``, and the functions of its module shipped with it, their file back."""
    module = getattr(fn, "__module__", None)
    globals_ = getattr(fn, "__globals__", {})
    for f in [fn, *globals_.values()]:
        code = getattr(f, "__code__", None)
        if isinstance(code, types.CodeType) and code.co_filename == _DYNAMIC:
            if f is fn or getattr(f, "__module__", None) == module:
                f.__code__ = _with_filename(code, filename)


_DYNAMIC = "<dynamic-code>"


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(
        _with_filename(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    return code.replace(co_filename=filename, co_consts=consts)


def _returned(result: object) -> tuple[Any, ...]:
    """The result, pickled; or, if it cannot be, what it was and why it cannot travel."""
    import cloudpickle

    try:
        return ("returned", cloudpickle.dumps(result))
    except BaseException as exc:  # noqa: BLE001 - the function did return: say so
        try:
            problem = f"{_type_name(exc)}: {exc}"
        except Exception:  # noqa: BLE001 - a str() that fails too
            problem = _type_name(exc)
        return ("unsendable", _type_name(result), problem)


def _type_name(obj: object) -> str:
    kind = type(obj)
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def _raised(exc: BaseException) -> tuple[Any, ...]:
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is main.__code__:
        tb = tb.tb_next  # the caller knows it called the function; this frame is noise
    text = "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()
    data = None
    with contextlib.suppress(Exception):
        import cloudpickle

        data = cloudpickle.dumps(exc)
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001
        message = "<str() failed>"
    kind = type(exc)
    return ("raised", data, f"{kind.__module__}.{kind.__qualname__}", message, text)
