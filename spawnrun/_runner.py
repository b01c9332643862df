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
import time
from collections.abc import Iterator
from collections.abc import Mapping
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import pytest

from spawnrun import CHILD_ENV
from spawnrun import _child
from spawnrun import _protocol as proto

CTX = get_context("spawn")

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
}
#: Given to the child as arguments instead of through the option namespace.
_NOT_FORWARDED = ("file_or_dir", "plugins")


def forwarded_options(config: pytest.Config) -> dict[str, Any]:
    """The parent's option values that pickle, with the child's overrides applied."""
    options: dict[str, Any] = {}
    for name, value in vars(config.option).items():
        if name in _NOT_FORWARDED:
            continue
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - a plugin's exotic value stays behind
            continue
        options[name] = value
    options.update(_CHILD_OVERRIDES)
    # Pin rootdir and ini file: collecting one file alone must give the same node ids.
    options["rootdir"] = str(config.rootpath)
    options["inifilename"] = str(config.inipath) if config.inipath else None
    return options


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


def child_environ(overrides: Mapping[str, str]) -> contextlib.AbstractContextManager[None]:
    """The environment a child starts with: ours, marked as a child's, plus ``overrides``."""
    return _environ({CHILD_ENV: "1", **overrides})


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


#: Children alive right now, so a SIGTERM to the parent can take them down too.
LIVE: set[ChildProcess] = set()

#: How long processes left behind by a test get between SIGTERM and SIGKILL.
REAP_GRACE = 2.0


def group_members(pgid: int) -> list[int]:
    """Pids in process group or session ``pgid`` (Linux /proc), excluding zombies."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        # Fields after the parenthesized command: state ppid pgrp session ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z" and pgid in (int(fields[2]), int(fields[3])):
            members.append(int(entry.name))
    return members


def reap(pgid: int, grace: float = REAP_GRACE) -> int:
    """End every process left in the child's group or session; return how many there were."""
    deadline = time.monotonic() + 0.3
    members = group_members(pgid)
    while members and time.monotonic() < deadline:
        time.sleep(0.02)  # let processes that are already on their way out finish
        members = group_members(pgid)
    if not members:
        return 0
    for pid in members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and group_members(pgid):
        time.sleep(0.05)
    for pid in group_members(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return len(members)


def kill_all_live() -> None:
    for child in list(LIVE):
        child.kill()


class Died:
    """The child's pipe ended before its ``Done``."""


DIED = Died()


class ChildProcess:
    def __init__(self, spec: proto.ChildSpec, env: Mapping[str, str]) -> None:
        conn, child_conn = CTX.Pipe(duplex=True)
        proc = CTX.Process(
            target=_child.main,
            args=(spec, child_conn),
            name=f"spawnrun {spec.nodeid}",
            daemon=False,
        )
        with child_environ(env):
            proc.start()
        child_conn.close()
        self._adopt(spec, conn, proc, proc.pid)  # type: ignore[arg-type]

    def _adopt(self, spec: proto.ChildSpec, conn: Connection, proc: Any, pid: int) -> None:
        self.spec = spec
        self.conn = conn
        #: multiprocessing.Process, or what stands in for one (sentinel, join, exitcode).
        self.proc: Any = proc
        self.pid = pid
        LIVE.add(self)
        self.exitcode: int | None = None
        #: How many processes the test left behind (known after ``finish``).
        self.reaped = 0
        self.killed_others = 0

    def recv(self, timeout: float | None = None) -> proto.Message | Died | None:
        """Next message; ``DIED`` once the child is gone; None on timeout."""
        ready = wait([self.conn, self.proc.sentinel], timeout)
        if not ready:
            return None
        # A dead child may still have messages in the pipe: read them first.
        if self.conn in ready or self.conn.poll(0):
            try:
                msg: proto.Message = self.conn.recv()
                return msg
            except (EOFError, OSError):
                return DIED
        return DIED

    def go(self, env: Mapping[str, str]) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(proto.Go(dict(env)))

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def dump_stacks(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, _child.DUMP_SIGNAL)

    def finish(self, grace: float = 30.0) -> int | None:
        """Wait for the child to exit (killing it after ``grace``); return its exit code.

        Idempotent: later calls return the first call's exit code.
        """
        if self.exitcode is not None or self.proc is None:
            return self.exitcode
        self.conn.close()
        self.proc.join(min(grace, 1.0))
        left = 0
        if self.proc.exitcode is None:
            # A child that does not exit may be waiting for what the test left behind
            # (multiprocessing joins non-daemonic children at exit): end those first.
            others = self._left_behind()
            for pid in others:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM)
            left = len(others)
            self.proc.join(grace)
        if self.proc.exitcode is None:
            self.kill()
            self.proc.join()
        self.exitcode = self.proc.exitcode
        self.proc.close()
        self.proc = None
        LIVE.discard(self)
        self.reaped = reap(self.pid) + left + self.killed_others
        return self.exitcode

    def kill(self) -> None:
        if self.proc is not None and self.exitcode is None and not self.killed_others:
            # Count what the test left behind before the group dies with the child.
            self.killed_others = len(self._left_behind())
        self.signal_group(signal.SIGKILL)

    def _left_behind(self) -> list[int]:
        """Processes of the child's group or session other than the child itself."""
        return [p for p in group_members(self.pid) if p != self.pid]
