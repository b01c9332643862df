"""The parent's handle on the zygote (``--spawn-method forkserver``).

Runs in the parent. Starts the template (with the spawn method: it is never forked
from the parent), asks it to fork one child per test, passing the child's end of a
fresh pipe as a file handle, and learns the child's exit code from the template, which
is its parent. The parent watches a forked child through a pidfd. Any failure, or a
refusal because a device runtime got initialized in the template, turns the zygote
off: the run spawns from then on, with one warning.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Mapping
from multiprocessing import reduction
from multiprocessing.connection import Connection
from multiprocessing.connection import wait
from typing import Any

from spawnrun import _protocol as proto
from spawnrun import _reports
from spawnrun import _runner
from spawnrun import _zygote

#: How long the template may take to import, configure and collect.
BOOT_LIMIT = 600.0


class Zygote:
    def __init__(self, spec: proto.ZygoteSpec) -> None:
        self.conn, child_conn = _runner.CTX.Pipe(duplex=True)
        self.proc: Any = _runner.CTX.Process(
            target=_zygote.main, args=(spec, child_conn), name="spawnrun zygote", daemon=False
        )
        with _runner.child_environ({}):
            self.proc.start()
        child_conn.close()
        self.pid: int = self.proc.pid or 0
        self.exits: dict[int, int] = {}
        #: Why the zygote is off ("" while it serves).
        self.off = ""
        self.booted = False

    def fork(self, spec: proto.ChildSpec, env: Mapping[str, str]) -> ForkedChild | None:
        """A child forked for this test, or None (the zygote is off: spawn instead)."""
        if self.off:
            return None
        try:
            if not self.booted:
                ready = self._next(BOOT_LIMIT)
                self.booted = True
                if not isinstance(ready, proto.ZygoteReady) or ready.problem:
                    problem = getattr(ready, "problem", "") or "it did not start"
                    self._turn_off(f"the template could not be built: {problem}")
                    return None
            parent_conn, child_conn = _runner.CTX.Pipe(duplex=True)
            self.conn.send(proto.ForkRequest(spec, dict(env)))
            reduction.send_handle(self.conn, child_conn.fileno(), self.pid)
            child_conn.close()
            reply = self._next(60.0)
        except (OSError, EOFError) as exc:
            self._turn_off(f"the template stopped answering ({exc!r})")
            return None
        if isinstance(reply, proto.Forked):
            return ForkedChild(spec, parent_conn, reply.pid, self)
        parent_conn.close()
        self._turn_off(
            reply.reason
            if isinstance(reply, proto.Refused)
            else f"unexpected answer from the template: {reply!r}"
        )
        return None

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """The exit code of a forked child, as its parent (the template) saw it."""
        while pid not in self.exits:
            try:
                if not self.conn.poll(timeout):
                    return None
                msg = self.conn.recv()
            except (OSError, EOFError):
                return None
            if isinstance(msg, proto.Exited):
                self.exits[msg.pid] = msg.code
        return self.exits.pop(pid)

    def _next(self, timeout: float) -> Any:
        """The next answer that is not an exit notice (those are filed), or None."""
        while True:
            if not self.conn.poll(timeout):
                return None
            msg = self.conn.recv()
            if not isinstance(msg, proto.Exited):
                return msg
            self.exits[msg.pid] = msg.code

    def _turn_off(self, reason: str) -> None:
        self.off = reason
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()
        if self.proc is not None:
            self.proc.join(5)
            if self.proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.proc.join()
            self.proc.close()
            self.proc = None


class _PidHandle:
    """Enough of ``multiprocessing.Process`` for a process that is not our child."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.zygote = zygote
        self.sentinel = os.pidfd_open(pid)
        self.exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is not None:
            return
        if wait([self.sentinel], timeout):
            code = self.zygote.exit_code(self.pid, 5.0)
            self.exitcode = code if code is not None else -signal.SIGKILL

    def close(self) -> None:
        os.close(self.sentinel)


class ForkedChild(_runner.ChildProcess):
    """A child forked by the zygote, driven exactly like a spawned one."""

    def __init__(self, spec: proto.ChildSpec, conn: Connection, pid: int, zygote: Zygote) -> None:
        self._adopt(spec, conn, _PidHandle(pid, zygote), pid)


OFF = "spawnrun: the forkserver is off and every test spawns from now on: {reason}"


class ZygoteHolder:
    """One zygote per run, started at the first spawned test, turned off for good on failure."""

    def __init__(self, preload: list[str]) -> None:
        self.preload = preload
        self.zygote: Zygote | None = None
        self.warned = False

    def start(self, config: Any, options: dict[str, Any]) -> None:
        """Start the template now, so its boot overlaps the parent's own collection."""
        if self.zygote is not None:
            return
        workdir = _runner.parent_basetemp(config) / "spawnrun" / "zygote"
        workdir.mkdir(parents=True, exist_ok=True)
        self.zygote = Zygote(
            proto.ZygoteSpec(
                preload=self.preload,
                option_dict=dict(options, basetemp=str(workdir / "tmp")),
                plugin_args=_runner.plugin_args(config),
                args=[str(a) for a in config.args],
                invocation_dir=str(config.invocation_params.dir),
                log_path=str(workdir / "output.log"),
            )
        )

    def fork(
        self, config: Any, spec: proto.ChildSpec, env: Mapping[str, str]
    ) -> ForkedChild | None:
        self.start(config, spec.option_dict)
        assert self.zygote is not None
        child = self.zygote.fork(spec, env)
        if child is None and not self.warned:
            self.warned = True
            _reports.record_warning(
                config, _reports.warning(OFF.format(reason=self.zygote.off), "zygote"), ""
            )
        return child

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
