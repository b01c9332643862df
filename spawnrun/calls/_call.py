"""``spawnrun.call``: run one function in a fresh spawn child and bring back its result.

Runs in both processes. The caller side (``call``, ``in_child``, their options checked,
the child started, waited for, timed out and reaped) runs wherever a user calls it: the
pytest parent, a spawned test, a plain script; what came of the call (the exceptions,
the answer unpacked) is ``_outcome``'s. ``_main`` is the child's entry point, in
``_call_child``. None of them imports pytest or torch at import time; the caller loads
``_runner`` (and so pytest) and cloudpickle (the ``call`` extra) only once a call is made.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait
from typing import Any
from typing import ParamSpec
from typing import TypeVar
from typing import overload

from spawnrun.calls import _call_child
from spawnrun.calls import _outcome

P = ParamSpec("P")
R = TypeVar("R")
Devices = str | int | Sequence[int | str] | None

INSTALL_HINT = 'spawnrun.call needs cloudpickle: pip install "spawnrun[call]"'
#: How long a timed-out child may take to write its stacks before it is killed.
_DUMP_LIMIT = 2.0
#: How long a child that has answered may take to exit before it is killed.
_EXIT_GRACE = 10.0
#: Longest single wait: poll() takes milliseconds in a C int, a huge timeout overflows it.
_WAIT_SLICE = 3600.0
# Changing os.environ around start() is how a child gets its devices before its
# interpreter starts; calls from several threads take turns at it.
_START_LOCK = threading.Lock()


def call(
    fn: Callable[..., R] | None = None,
    /,
    *args: Any,
    devices: Devices = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> R:
    """Run ``fn(*args, **kwargs)`` in a fresh spawn child now and return its result.

    It always runs ``fn``, also with no arguments (``call(fn)`` is ``fn()`` in a child):
    the decorator is ``in_child``. ``devices``: None keeps the caller's
    ``CUDA_VISIBLE_DEVICES``; a str, an int or a sequence of device ids sets it for the
    child (an empty one: no device). ``timeout``: seconds; None, 0 or inf for no limit.
    """
    __tracebackhide__ = True
    visible = _visible_devices(devices)
    limit = _limit(timeout)
    if fn is None:
        raise TypeError(
            "spawnrun.call: no function to call; to decorate a function, use "
            "@spawnrun.in_child or @spawnrun.in_child(devices=..., timeout=...)"
        )
    if not callable(fn):
        raise TypeError(f"spawnrun.call: {fn!r} is not callable")
    result: R = _run(fn, args, kwargs, visible, limit)
    return result


@overload
def in_child(fn: Callable[P, R], /) -> Callable[P, R]: ...
@overload
def in_child(
    *, devices: Devices = None, timeout: float | None = None
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...
def in_child(fn: Any = None, /, *, devices: Devices = None, timeout: float | None = None) -> Any:
    """Decorate a function so that each call of it runs in a fresh spawn child.

    ``@spawnrun.in_child`` or, with options, ``@spawnrun.in_child(devices=0, timeout=60)``
    (the options of ``call``). Decorating runs nothing; calling the decorated function
    is ``spawnrun.call(fn, *args, **kwargs)`` with those options.
    """
    visible = _visible_devices(devices, "spawnrun.in_child")
    limit = _limit(timeout, "spawnrun.in_child")
    if fn is None:
        return functools.partial(_decorate, visible=visible, limit=limit)
    if not callable(fn):
        raise TypeError(
            f"spawnrun.in_child: {fn!r} is not callable; it takes the function to decorate, "
            "or keyword options only (devices=, timeout=)"
        )
    return _decorate(fn, visible, limit)


def _decorate(fn: Callable[P, R], visible: str | None, limit: float | None) -> Callable[P, R]:
    # functools.wraps stores fn as __wrapped__; the module attribute now names the
    # wrapper, so cloudpickle ships fn by value, never as a reference to the wrapper.
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        __tracebackhide__ = True
        result: R = _run(fn, args, kwargs, visible, limit)
        return result

    return wrapper


def _visible_devices(devices: object, who: str = "spawnrun.call") -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for the child, or None to keep the caller's.

    Each item is a device id as ``--spawn-gpus`` takes one: an index or a ``GPU-``/``MIG-``
    UUID, each once (a device listed twice is a mistake CUDA would not report).
    """
    if devices is None:
        return None
    if isinstance(devices, str):
        items: list[object] = [] if devices.strip() == "" else list(devices.split(","))
    elif isinstance(devices, Sequence) and not isinstance(devices, (bytes, bytearray)):
        items = list(devices)
    elif isinstance(devices, int) and not isinstance(devices, bool):
        items = [devices]
    else:
        raise TypeError(
            f"{who}: devices= takes None, a str such as '0,1', an int or a list/tuple "
            f"of ints and device names, not {type(devices).__name__}"
        )
    from spawnrun.devices._inventory import _is_device_id as is_device_id

    names: list[str] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise TypeError(f"{who}: devices= item {item!r} is not an int or a str")
        if isinstance(item, int) and item < 0:
            raise ValueError(f"{who}: devices= item {item} is negative")
        text = str(item).strip()
        if not is_device_id(text):
            raise ValueError(
                f"{who}: devices= item {item!r} is not a device (an index such as 0, or a "
                "GPU-/MIG- UUID)"
            )
        if text in names:
            raise ValueError(f"{who}: devices= lists device {text} more than once")
        names.append(text)
    return ",".join(names)


def _limit(timeout: object, who: str = "spawnrun.call") -> float | None:
    """The timeout in seconds, or None for no limit."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{who}: timeout= takes seconds, not {type(timeout).__name__}")
    try:
        seconds = float(timeout)
    except OverflowError:  # an int beyond float: no limit in practice
        return None
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{who}: timeout={timeout!r} is not a number of seconds >= 0")
    return None if seconds == 0 or math.isinf(seconds) else seconds


def _cloudpickle() -> Any:
    try:
        import cloudpickle
    except ImportError as exc:
        raise ImportError(INSTALL_HINT, name="cloudpickle") from exc
    return cloudpickle


def _describe(fn: Any) -> str:
    qualname = getattr(fn, "__qualname__", None)
    return f"{getattr(fn, '__module__', '?')}.{qualname}" if qualname else repr(fn)


def _run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    visible: str | None,
    limit: float | None,
) -> Any:
    __tracebackhide__ = True
    # cloudpickle ships code by value with the file name "<dynamic-code>"; the child puts
    # the real one back, so its tracebacks and stacks name the file and show its lines.
    filename = getattr(getattr(fn, "__code__", None), "co_filename", "")
    payload = _cloudpickle().dumps((fn, args, kwargs, filename))
    # Loaded here, not at import: _runner brings pytest, which the child never needs.
    from spawnrun.launch import _runner

    name = _describe(fn)
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    workdir = tempfile.mkdtemp(prefix="spawnrun-call-")
    files = _Files(workdir)
    reader, writer = _runner.CTX.Pipe(duplex=False)
    proc: Any = _runner.CTX.Process(
        target=_call_child.main,
        args=(payload, writer, workdir, files.unlink),
        name=f"spawnrun.call {name}",
    )
    try:
        with _START_LOCK, _runner.child_environ(env), _runner.no_main_reimport():
            proc.start()
        writer.close()
        deadline = None if limit is None else time.monotonic() + limit
        answer = _wait_answer(proc, reader, deadline)
        if answer is None:  # the deadline passed
            _dump_stacks(proc.pid, files.stacks)
        elif answer is not _DIED:
            wait([proc.sentinel], _EXIT_GRACE)
        # The child is gone or a zombie until join(): its pid cannot be reused yet.
        _runner.signal_pids([proc.pid, *_runner.group_members(proc.pid)], signal.SIGKILL)
        proc.join()
        if answer is None or answer is _DIED:
            raise _outcome.failure(
                name, limit if answer is None else None, proc.exitcode, files.stacks, files.output
            )
        _outcome.replay_output(files.output)
        return _outcome.unpack(name, answer)
    finally:
        if proc.pid is not None and proc.exitcode is None:  # interrupted: end it
            _runner.signal_pids([proc.pid, *_runner.group_members(proc.pid)], signal.SIGKILL)
            proc.join()
        for end in (reader, writer):
            end.close()
        with contextlib.suppress(ValueError):
            proc.close()
        files.close()
        shutil.rmtree(workdir, ignore_errors=True)


_DIED = ("died",)


class _Files:
    """The child's output and stacks files, which the caller holds open from the start.

    Once the child has opened them it unlinks them and their directory (``unlink``,
    where ``/proc/self/fd`` can reopen a file that has no name), so a caller killed with
    SIGKILL, whose child dies with it, leaves nothing in the temporary directory; the
    caller reads them through its own descriptors.
    """

    def __init__(self, workdir: str) -> None:
        self.unlink = os.path.isdir("/proc/self/fd")
        self.fds: list[int] = []
        paths = []
        for name in ("output.log", "stacks.txt"):
            path = os.path.join(workdir, name)
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o600)
            self.fds.append(fd)
            paths.append(f"/proc/self/fd/{fd}" if self.unlink else path)
        self.output, self.stacks = paths

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def _wait_answer(proc: Any, reader: Connection, deadline: float | None) -> Any:
    """The child's answer, ``_DIED`` if it ended without one, None at the deadline."""
    while True:
        remaining = _WAIT_SLICE if deadline is None else deadline - time.monotonic()
        if remaining <= 0:
            return None
        ready = wait([reader, proc.sentinel], min(remaining, _WAIT_SLICE))
        if reader in ready:  # checked first: an answer and the exit can come together
            try:
                return reader.recv()
            except (EOFError, OSError):
                wait([proc.sentinel], _EXIT_GRACE)
                return _DIED
        if proc.sentinel in ready:
            return _DIED


def _dump_stacks(pid: int, path: str) -> None:
    """Ask the child's faulthandler for every thread's stack; wait until it is written."""
    from spawnrun.wire._reports import size_of

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR1)
    end = time.monotonic() + _DUMP_LIMIT
    size = -1
    while time.monotonic() < end:
        time.sleep(0.05)
        now = size_of(path)
        if now and now == size:
            return
        size = now
