"""Process lifecycle in the parent: build a child's spec, start it, stream its messages.

Runs in the parent. Children come from ``multiprocessing.get_context("spawn")`` (never
the process-wide start method), are non-daemonic (tests may start processes of their
own), lead their own session, and get their environment before the interpreter starts.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import struct
import sys
from collections.abc import Iterator
from collections.abc import Mapping
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import pytest

from spawnrun import CHILD_ENV
from spawnrun.child import _leave
from spawnrun.child import _stackhook
from spawnrun.proc import _bytecode
from spawnrun.proc import _main
from spawnrun.proc import _proctable
from spawnrun.wire import _orders
from spawnrun.wire import _protocol as proto
from spawnrun.wire import _replies

CTX = get_context("spawn")
#: What a spawned test child runs.
CHILD_MAIN = "spawnrun.child._child:main"

#: Options a child must not inherit: output files, session-level selection and
#: scheduling belong to the parent; the child runs exactly one given test.
_CHILD_OVERRIDES: dict[str, Any] = {
    "usepdb": False,
    "trace": False,
    "exitfirst": False,
    "maxfail": 0,
    "lf": False,
    "failedfirst": False,
    "newfirst": False,
    "stepwise": False,
    "stepwise_skip": False,
    "cacheclear": False,
    "cacheshow": False,
    "collectonly": False,
    "continue_on_collection_errors": True,
    "xmlpath": None,
    "report_log": None,
    "htmlpath": None,
    "numprocesses": None,
    "maxprocesses": None,
    "dist": "no",
    "looponfail": False,
    # pytest-split: the parent picked this shard's tests; a child that split its own
    # collection (one file) again would miss tests of its shard and fall back to a
    # second boot, and each child would rewrite the durations file the parent writes.
    "splits": None,
    "group": None,
    "store_durations": False,
    "clean_durations": False,
    # pytest-cov's controller is the parent's: in a child it would erase, combine and
    # rewrite the parent's data file while the parent writes it. The child's measurement
    # is spawnrun's (_coverage).
    "no_cov": True,
}
#: Given to the child as arguments instead of through the option namespace.
_NOT_FORWARDED = ("file_or_dir", "plugins")


def forwarded_options(config: pytest.Config) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The parent's option values for the child, with the child's overrides applied.

    Values of built-in and standard-library types travel as they are (the child decodes
    them before pytest starts). Others (a type a conftest defines) travel pickled apart
    and are decoded only once the child's pytest has loaded its conftests, so nothing of
    the suite is imported before pytest imports it, and the classes are pytest's own.
    Values that do not pickle at all stay behind.
    """
    options: dict[str, Any] = {}
    late: dict[str, bytes] = {}
    for name, value in vars(config.option).items():
        if name in _NOT_FORWARDED:
            continue
        if _plain(value):
            options[name] = value
            continue
        try:
            late[name] = pickle.dumps(value)
        except Exception:  # noqa: BLE001 - a plugin's exotic value stays behind
            continue
    options.update(_CHILD_OVERRIDES)
    # Pin rootdir, ini file and conftest cut-off: collecting one file alone must give
    # the same node ids, settings and conftests. With no ini file, an empty one keeps
    # the child from adopting one found next to the test (a nested sub/pytest.ini).
    options["rootdir"] = str(config.rootpath)
    options["inifilename"] = str(config.inipath) if config.inipath else str(_empty_ini(config))
    confcutdir = config.getoption("confcutdir", None)
    if confcutdir is None:
        confcutdir = config.inipath.parent if config.inipath else config.rootpath
    options["confcutdir"] = str(confcutdir)
    return options, late


def _plain(value: Any) -> bool:
    """Whether unpickling ``value`` imports nothing but the standard library."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    top = type(value).__module__.partition(".")[0]
    return top == "builtins" or top in getattr(sys, "stdlib_module_names", ())


def _empty_ini(config: pytest.Config) -> Path:
    path = parent_basetemp(config) / "spawnrun" / "no-inifile" / "pytest.ini"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[pytest]\n")
    return path


def plugin_args(config: pytest.Config) -> list[str]:
    return [f"-p{name}" for name in config.option.plugins]


def parent_basetemp(config: pytest.Config) -> Path:
    # pytest offers no public accessor for the session's base temp dir outside a
    # fixture; children get their own --basetemp below it.
    factory = config._tmp_path_factory  # type: ignore[attr-defined]
    return Path(factory.getbasetemp())


def child_dir(config: pytest.Config, nodeid: str, serial: int) -> Path:
    name = re.sub(r"[^\w.-]+", "_", nodeid.rsplit("/", 1)[-1])[:48]
    return parent_basetemp(config) / "spawnrun" / f"{serial:04d}-{name}"


@contextlib.contextmanager
def child_environ(overrides: Mapping[str, str]) -> Iterator[None]:
    """The environment a child starts with: ours, marked as a child's, plus ``overrides``.

    And a working directory that exists: the spawn launcher hands the child
    ``os.getcwd()``, which fails once a test deleted the directory it made current.
    """
    with _environ({CHILD_ENV: "1", **overrides}), _existing_cwd():
        yield


@contextlib.contextmanager
def _existing_cwd() -> Iterator[None]:
    """Start from ``/`` while our working directory is deleted, and come back to it after.

    The child goes to the invocation directory itself; this process stays where the test
    left it (a deleted directory is still one to return to, through a descriptor).
    """
    try:
        os.getcwd()
    except OSError:
        pass
    else:
        yield
        return
    here = os.open(".", os.O_RDONLY)
    try:
        os.chdir("/")
        yield
    finally:
        os.fchdir(here)
        os.close(here)


@contextlib.contextmanager
def _environ(overrides: Mapping[str, str]) -> Iterator[None]:
    # The spawn launcher execs the interpreter with os.environ as it is at start():
    # setting it around start() is how a child gets CUDA_VISIBLE_DEVICES & co. before
    # any import can read them.
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def no_main_reimport() -> Iterator[None]:
    """Keep the spawn launcher from running the parent's ``__main__`` in the child.

    multiprocessing's spawn imports the parent's main module in the child (by path for a
    script, by name under ``-m``) so that functions defined there unpickle. A child needs
    nothing from it, and a script that calls ``pytest.main()`` without a ``__main__``
    guard would start a whole nested session in every child; the console script's
    re-import alone costs ~150 ms per child. Hidden from the launcher while it starts.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved: dict[str, Any] = {
        k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__
    }
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


#: Children alive right now, so a SIGTERM to the parent can take them down too.
LIVE: set[ChildProcess] = set()


def group_members(pgid: int) -> list[int]:
    """Pids in process group or session ``pgid`` (Linux /proc), excluding zombies.

    None can be found without /proc (the run warns of it once: ``_reports.NO_PROC``).
    """
    return [
        pid for pid, (_, pgrp, sid) in _proctable.live_processes().items() if pgid in (pgrp, sid)
    ]


def process_tree(root: int) -> list[tuple[int, int]]:
    """(pid, parent pid) of every live process below ``root`` (Linux /proc), root excluded.

    Its descendants, also those that left its session (``setsid``), and the members of
    its group or session whose parent died (re-parented to init): tree order first.
    """
    procs = _proctable.live_processes()
    order: list[int] = []
    level = [root]
    while level:
        level = sorted(p for p, (ppid, _, _) in procs.items() if ppid in level)
        order += level
    order += sorted(p for p, (_, pgrp, sid) in procs.items() if root in (pgrp, sid))
    seen = {root}
    tree = []
    for pid in order:
        if pid not in seen:
            seen.add(pid)
            tree.append((pid, procs[pid][0]))
    return tree


def command_line(pid: int, limit: int = 120) -> str:
    """A process's command line on one line (a forked one shows its parent's)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return "?"
    text = " ".join(raw.decode("utf-8", "replace").replace("\0", " ").split()) or "?"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def signal_pids(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def kill_all_live() -> None:
    for child in list(LIVE):
        child.kill()


class Died:
    """The child's pipe ended, or can no longer be read (``cause``: why not)."""

    def __init__(self, cause: str = "") -> None:
        self.cause = cause


#: How much one read of a pipe takes at most, so that a child sending without end does
#: not keep the event loop from its other events (the rest is read on the next turn).
_READ_CHUNK = 1 << 16
_READS_PER_TURN = 64
#: A message longer than this is taken for a corrupt stream: a child cuts what it sends
#: to ``_protocol.MESSAGE_LIMIT`` (``_protocol.frame``), so each child's partial message
#: held here stays bounded.
MAX_MESSAGE = 4 * proto.MESSAGE_LIMIT


class Stream:
    """The messages in a pipe of ``multiprocessing.Connection``'s framing, never blocking.

    ``Connection.recv`` waits for a whole message: after ``poll`` says a byte is there,
    a partial one (a test that wrote to the pipe, a child killed mid-send) would stall
    the event loop. This reads only what is there, keeps a partial message for later,
    and decodes whole ones with ``_protocol.decode``. ``problem`` says why the stream
    cannot be read on (corrupt, or ended inside a message); nothing is read after it.
    """

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.ended = False
        self.problem = ""

    def read(self, fd: int) -> list[Any]:
        """The messages that arrived whole; ``ended`` or ``problem`` tell the rest."""
        for _ in range(_READS_PER_TURN):
            if self.ended or self.problem or not wait([fd], 0):
                break
            try:
                data = os.read(fd, _READ_CHUNK)
            except OSError:
                data = b""  # ECONNRESET and the like: the other end is gone
            if not data:
                self.ended = True
                break
            self.buffer += data
        out = self._messages()
        if self.ended and self.buffer and not self.problem:
            self.problem = (
                f"the stream ended inside a message ({len(self.buffer)} bytes of it "
                "arrived): a message cut short, or bytes the test wrote into the pipe"
            )
        return out

    def _messages(self) -> list[Any]:
        out = []
        while not self.problem:
            buf = self.buffer
            if len(buf) < 4:
                break
            (size,) = struct.unpack("!i", buf[:4])
            start = 4
            if size == -1:  # a message longer than 2 GiB announces its size in 8 bytes
                if len(buf) < 12:
                    break
                (size,) = struct.unpack("!Q", buf[4:12])
                start = 12
            if not 0 <= size <= MAX_MESSAGE:
                self.problem = f"a message announced a size of {size} bytes (a corrupt stream)"
                break
            if len(buf) < start + size:
                break
            frame = bytes(buf[start : start + size])
            del buf[: start + size]
            try:
                out.append(proto.decode(frame))
            except Exception as exc:  # noqa: BLE001 - whatever the bytes were
                self.problem = f"a message could not be decoded: {exc}"
        return out


class ChildProcess:
    """A child as the parent's event loop sees it: a pipe, an exit to watch, a group.

    Nothing here blocks: ``messages`` reads what is already in the pipe, ``exitcode``
    asks without waiting, and the scheduler's loop waits on ``conn`` and ``sentinel``.
    The sentinel is a pidfd, readable once the process has exited: multiprocessing's own
    is a pipe that a test closing its file descriptors (or a process it forked and left
    running) makes ready, or keeps from ever being ready, while the child lives.
    """

    #: Forked from the zygote (``_forkserver.ForkedChild``), not spawned.
    forked = False

    def __init__(self, spec: _orders.ChildSpec, env: Mapping[str, str]) -> None:
        conn, child_conn = CTX.Pipe(duplex=True)
        proc = CTX.Process(
            target=_bytecode.boot,
            args=(
                pickle.dumps((spec,)),
                child_conn,
                "spawnrun.child._child:main",
                _main.describe(),
            ),
            name=f"spawnrun {spec.nodeid}",
            daemon=False,
        )
        try:
            with child_environ(env), no_main_reimport():
                proc.start()
        except BaseException:
            conn.close()
            raise
        finally:
            child_conn.close()
        self._proc: Any = proc
        pidfd = _pidfd(proc.pid or 0)
        self._adopt(spec, conn, proc.pid or 0, proc.sentinel if pidfd is None else pidfd)
        self._pidfd = pidfd

    def _adopt(self, spec: _orders.ChildSpec, conn: Connection, pid: int, sentinel: int) -> None:
        self.spec = spec
        self.conn: Connection | None = conn
        self.pid = pid
        #: Readable once the process has exited.
        self.sentinel = sentinel
        self.gone = False
        self._code: int | None = None
        self._stream = Stream()
        self._pidfd = None
        LIVE.add(self)

    @property
    def exitcode(self) -> int | None:
        """The exit code once the process is gone (-N: signal N), else None."""
        if self.gone or self._proc is None:
            return self._code
        code: int | None = self._proc.exitcode
        return code

    def running(self) -> bool:
        """Whether the process has not exited yet (asked without waiting)."""
        if self.gone:
            return False
        if self._proc is not None:
            return bool(self._proc.exitcode is None)
        return not wait([self.sentinel], 0)

    def wait_exitcode(self, timeout: float) -> int | None:
        """The exit code, waiting at most ``timeout`` for a process known to be ending."""
        # Not Process.join(timeout): once multiprocessing's sentinel is ready (the child
        # closed it) join waits for the exit without a bound.
        if not self.gone and self.exitcode is None and self._pidfd is not None:
            wait([self._pidfd], timeout)
        return self.exitcode

    def messages(self) -> list[_replies.Message | Died]:
        """Everything the child has sent so far; a ``Died`` last once the pipe ended.

        Never waits: a partial message stays buffered until the rest arrives. A stream
        that cannot be read on (corrupt, or ended inside a message) ends the pipe with
        the cause.
        """
        conn = self.conn
        if conn is None:
            return []
        stream = self._stream
        out: list[_replies.Message | Died] = list(stream.read(conn.fileno()))
        if stream.problem or stream.ended:
            out.append(Died(stream.problem))
            self.close_pipe()
        return out

    def assign(self, msg: _orders.Assign) -> None:
        """Tell a child started before its test was known which one it is for."""
        self.spec = msg.onto(self.spec)
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.send(msg)

    def go(
        self,
        env_set: Mapping[str, str],
        env_unset: list[str],
        nodeid: str = "",
        params: Mapping[str, _orders.Binding] | None = None,
    ) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.send(
                    _orders.Go(dict(env_set), list(env_unset), nodeid, dict(params or {}))
                )

    def stop(self) -> None:
        """No more tests for it (a scope's child): it tears down and ends."""
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.send(_orders.Stop())

    def close_pipe(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.close()
            self.conn = None

    def dump_stacks(self, skip: int = 0) -> list[tuple[int, int, str, str]]:
        """Ask the child, and every process below it that can be asked, for its stacks.

        Returns the processes below the child as they are now (pid, parent pid, command
        line, the file its stacks go to or "" if it cannot be asked): once killed, they
        are gone from /proc.
        """
        if self.gone:
            return []
        signal_pids([self.pid], _leave.DUMP_SIGNAL)
        directory = _stackhook.stacks_dir(os.path.dirname(self.spec.stacks_path))
        below = []
        for pid, ppid in process_tree(self.pid):
            if pid == skip:
                continue  # a template's fork: the child passes the request on to it
            path = os.path.join(directory, f"{pid}.txt")
            if not os.path.exists(path):
                path = ""
            below.append((pid, ppid, command_line(pid), path))
        signal_pids([pid for pid, _, _, path in below if path], _stackhook.SIGNAL)
        return below

    def others(self) -> list[int]:
        """Processes of the child's group or session other than the child itself."""
        return [p for p in group_members(self.pid) if p != self.pid]

    def kill(self) -> None:
        """SIGKILL the child's group, and the child by pid in case it has no group yet.

        A child killed before its ``setsid`` is not yet the leader of its own group; a
        child already reaped is never signalled (its pid may be someone else's now).
        """
        if self.gone:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        signal_pids([self.pid], signal.SIGKILL)

    def reaped(self) -> None:
        """The process is gone and its exit code known: release what watched it."""
        if self.gone:
            return
        self.close_pipe()
        if self._proc is not None:
            self._code = self._proc.exitcode  # waitpid(WNOHANG): it has exited
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
        self.gone = True
        if self._proc is not None:
            with contextlib.suppress(ValueError):
                self._proc.close()
        LIVE.discard(self)


def _pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (Linux 5.3+), or None where the kernel has none."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None
