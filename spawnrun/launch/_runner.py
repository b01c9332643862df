"""Process lifecycle in the parent: start a child, watch its exit, read its messages,
signal its process group and the tree below it.

Runs in the parent. Children come from ``multiprocessing.get_context("spawn")`` (never
the process-wide start method), are non-daemonic (tests may start processes of their
own), lead their own session, and get their environment before the interpreter starts.
The options a child inherits are ``_options``'; its pipe is read by ``_stream``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
from collections.abc import Iterator
from collections.abc import Mapping
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.connection import wait
from typing import Any

from spawnrun import CHILD_ENV
from spawnrun.child import _leave
from spawnrun.child import _stackhook
from spawnrun.launch import _stream
from spawnrun.proc import _bytecode
from spawnrun.proc import _main
from spawnrun.proc import _proctable
from spawnrun.wire import _orders
from spawnrun.wire import _replies

CTX = get_context("spawn")
#: What a spawned test child runs.
CHILD_MAIN = "spawnrun.child._child:main"


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


class ChildProcess:
    """A child as the parent's event loop sees it: a pipe, an exit to watch, a group.

    Nothing here blocks: ``messages`` reads what is already in the pipe, ``exitcode``
    asks without waiting, and the scheduler's loop waits on ``conn`` and ``sentinel``.
    The sentinel is a pidfd, readable once the process has exited: multiprocessing's own
    is a pipe that a test closing its file descriptors (or a process it forked and left
    running) makes ready, or keeps from ever being ready, while the child lives.
    """

    #: Forked from the zygote (``_zygoteproc.ForkedChild``), not spawned.
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
        self._stream = _stream.Stream()
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

    def messages(self) -> list[_replies.Message | _stream.Died]:
        """Everything the child has sent so far; a ``_stream.Died`` last once the pipe ended.

        Never waits: a partial message stays buffered until the rest arrives. A stream
        that cannot be read on (corrupt, or ended inside a message) ends the pipe with
        the cause.
        """
        conn = self.conn
        if conn is None:
            return []
        stream = self._stream
        out: list[_replies.Message | _stream.Died] = list(stream.read(conn.fileno()))
        if stream.problem or stream.ended:
            out.append(_stream.Died(stream.problem))
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
