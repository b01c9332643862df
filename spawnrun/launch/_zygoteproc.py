"""The zygote process as the parent talks to it, and the children it forks.

Runs in the parent. ``Zygote`` starts the template (with the spawn method: it is never
forked from the parent), tells it what to import, waits for its answers (learned
preloads bounded by ``LEARNED_LIMIT``), and asks it to fork one child per test, passing
the child's end of a fresh pipe as a file handle and the child's final environment (its
devices). ``ForkedChild`` is such a child, driven like a spawned one: the parent learns
its exit code from the template, which is its parent, and watches it through a pidfd.
What the template imports, and when to rebuild it, is ``_forkserver.ZygoteHolder``'s.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import signal
import time
from collections.abc import Collection
from collections.abc import Mapping
from multiprocessing import reduction
from multiprocessing.connection import Connection
from multiprocessing.connection import wait
from typing import Any

from spawnrun.child import _availability
from spawnrun.devices import _inventory
from spawnrun.devices import _nvml
from spawnrun.launch import _runner
from spawnrun.launch import _stream
from spawnrun.proc import _bytecode
from spawnrun.proc import _main
from spawnrun.wire import _forking
from spawnrun.wire import _orders

#: How long the template may take to import what it is told (all of it, rebuilds too).
BOOT_LIMIT = 600.0
#: How long a fork request may take to be answered. Once the template has imported what
#: it was told (the first fork waits for that), its answer takes milliseconds; the event
#: loop stands still meanwhile, so a template that does not answer is given up soon.
FORK_LIMIT = 10.0
#: How long the template may take, in all, to import what only pytest's cache names
#: (learned preloads): a guess, never worth a stalled session. Imported beside the
#: parent's collection, torch takes 1-5 s of it on the images measured.
LEARNED_LIMIT = 60.0


def _found() -> dict[str, Any]:
    """What the template answers for CUDA while it imports (``Preload.cuda_available``):
    the parent's finding, where its collection asked; before that (a template started
    while pytest configures), the inventory's guess: NVIDIA devices were found. Each
    fork checks the answer against the parent's finding by then (``_availability.differs``
    with the test's spec): a wrong guess spawns tests, it never forks a wrong answer."""
    if _availability.known():
        found = _availability.in_parent()
        config = _availability.config_in_parent() if found else None
        return {"cuda_available": found, "torch_config": config}
    active = _inventory.active()
    if active.ids:
        guess = active.vendor == "nvidia"
    else:  # pytest is still configuring: the inventory is not taken yet
        guess = _nvml_lists_a_device()
    return {"cuda_available": guess, "torch_config": None}


def _nvml_lists_a_device() -> bool:
    nvml = _nvml.load_nvml()  # the driver's management library: no CUDA context
    try:
        return nvml is not None and int(nvml.nvmlDeviceGetCount()) > 0
    except Exception:  # noqa: BLE001 - no answer is no device
        return False


class Zygote:
    def __init__(self, spec: _forking.ZygoteSpec, environ: Mapping[str, str]) -> None:
        self.spec = spec
        self.conn, child_conn = _runner.CTX.Pipe(duplex=True)
        self.proc: Any = _runner.CTX.Process(
            target=_bytecode.boot,
            args=(
                pickle.dumps((spec,)),
                child_conn,
                "spawnrun.fork._zygote:main",
                _main.describe(),
            ),
            name="spawnrun zygote",
            daemon=False,
        )
        #: The environment the template started with.
        self.environ = dict(os.environ)
        try:
            with _runner.child_environ(environ), _runner.no_main_reimport():
                self.proc.start()
        except BaseException:
            self.conn.close()
            raise
        finally:
            child_conn.close()
        self.pid: int = self.proc.pid or 0
        self.exits: dict[int, int] = {}
        #: The template's messages, read without blocking; answers not yet taken.
        self.stream = _stream.Stream()
        self.inbox: list[Any] = []
        #: ZygoteReady answers still to come (one for the spec, one per Preload).
        self.pending = 1
        #: Modules the template could not import ("name: error"), from every answer.
        self.failed: list[str] = []
        self.closed = False
        #: How the template ended before answering ("" while it answers).
        self.ended = ""
        #: The learned preload's package it imports now ("": none), since when (its
        #: clock), and the seconds its learned preloads took before it.
        self.importing = ""
        self.importing_at = 0.0
        self.learned_spent = 0.0
        #: Top-level packages that more than the cache names (the parent imported them,
        #: a test file's import line names them): their import is not bounded, as the
        #: parent's own is not.
        self.trusted: set[str] = set()

    def preload(
        self,
        modules: list[str],
        path: list[str] | None = None,
        rewrite: _forking.Rewrite | None = None,
    ) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(_forking.Preload(modules, path, rewrite, **_found()))
            self.pending += 1

    def preload_all(
        self,
        modules: list[str],
        learned: Collection[str],
        path: list[str] | None = None,
        rewrite: _forking.Rewrite | None = None,
        late: Collection[str] = (),
    ) -> None:
        """Preload ``modules``, those of ``learned`` last and bounded (``ready``);
        ``late``: those tests imported in their bodies (``Preload.late``)."""
        plain = [m for m in modules if m not in learned]
        guessed = [m for m in modules if m in learned]
        if plain or path is not None or rewrite is not None:
            self.preload(plain, path, rewrite)
        if guessed:
            with contextlib.suppress(OSError):
                later = frozenset(m for m in guessed if m in late)
                self.conn.send(_forking.Preload(guessed, learned=True, late=later, **_found()))
                self.pending += 1

    @property
    def listening(self) -> bool:
        """Whether the template can still be heard (the event loop waits on it then)."""
        return not (self.closed or self.stream.ended or self.stream.problem)

    def ready(
        self, limit: float = BOOT_LIMIT, learned_limit: float | None = None
    ) -> _forking.ZygoteReady:
        """Wait for every pending answer; the first one with a problem, else the last.

        Learned preloads get ``learned_limit`` seconds in all (``LEARNED_LIMIT``): past
        it, an answer with ``slow`` set names the package the template was importing.
        """
        if learned_limit is None:
            learned_limit = LEARNED_LIMIT
        answer = _forking.ZygoteReady(self.pid)
        end = time.monotonic() + limit
        while self.pending:
            learned_end = math.inf
            if self.importing and self.importing not in self.trusted:
                learned_end = self.importing_at + learned_limit - self.learned_spent
            # Polled even past the bound: its answer may be waiting, read late.
            reply = self._next(max(0.0, min(end, learned_end) - time.monotonic()))
            if isinstance(reply, _forking.Importing):
                if self.importing and self.importing not in self.trusted:
                    self.learned_spent += reply.at - self.importing_at
                self.importing, self.importing_at = reply.top, reply.at
                continue
            if reply is None and self.listening and time.monotonic() >= learned_end:
                took = f"importing it took over {learned_limit:g} s"
                culprit = self.importing
                return _forking.ZygoteReady(self.pid, took, culprit, suspects=[culprit], slow=True)
            if reply is None and not self.listening:
                self.proc.join(1.0)  # it is gone: only its exit status is left to read
                self.ended = (
                    f"the template ended before answering (exit status {self.proc.exitcode}; "
                    f"its output: {self.spec.log_path})"
                )
                return _forking.ZygoteReady(self.pid, self.ended)
            self.pending -= 1
            if not isinstance(reply, _forking.ZygoteReady):
                return _forking.ZygoteReady(self.pid, f"it did not answer as expected: {reply!r}")
            self.failed += reply.failed
            if reply.problem or reply.stale:
                return reply
            answer = reply
        return answer

    def prime(self, spec: _orders.ChildSpec, env: Mapping[str, str], wait: bool) -> None:
        """Have a template configured for tests like ``spec`` (no answer comes)."""
        with contextlib.suppress(OSError):
            self.conn.send(_forking.Prime(self._request(spec, env), wait))

    def _request(self, spec: _orders.ChildSpec, env: Mapping[str, str]) -> _forking.ForkRequest:
        unset = [k for k in self.environ if k not in os.environ]
        return _forking.ForkRequest(spec, {**os.environ, **env}, unset, spec.log_path is None)

    def fork(
        self, spec: _orders.ChildSpec, env: Mapping[str, str]
    ) -> ForkedChild | _forking.Declined | str:
        """A forked child, why the template would not fork this test (``Declined``: it
        is spawned), or why it would not fork at all.

        The child gets the parent's environment as it is now (as a spawned child would),
        not the template's from the session's start, plus ``env``.
        """
        request = self._request(spec, env)
        try:
            parent_conn, child_conn = _runner.CTX.Pipe(duplex=True)
            self.conn.send(request)
            reduction.send_handle(self.conn, child_conn.fileno(), self.pid)
            if request.live:  # with -s the child writes where the parent does
                for stream in (1, 2):
                    reduction.send_handle(self.conn, stream, self.pid)
            child_conn.close()
            reply = self._next(FORK_LIMIT)
        except (OSError, EOFError) as exc:
            return f"the template stopped answering ({exc!r})"
        if isinstance(reply, _forking.Forked):
            return ForkedChild(spec, parent_conn, reply.pid, self)
        parent_conn.close()
        if isinstance(reply, _forking.Declined):
            return reply
        if isinstance(reply, _forking.Refused):
            return reply.reason
        return f"unexpected answer from the template: {reply!r}"

    def drain(self) -> None:
        """File the exit notices that arrived (the scheduler's loop calls this)."""
        if self.listening:
            self.inbox += self.stream.read(self.conn.fileno())
        self._file_exits()

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """The exit code of a forked child, as its parent (the template) saw it."""
        end = time.monotonic() + timeout
        while pid not in self.exits:
            if not self._receive(end):
                return None
        return self.exits.pop(pid)

    def _next(self, timeout: float) -> Any:
        """The next answer that is not an exit notice (those are filed), or None."""
        end = time.monotonic() + timeout
        while not self.inbox:
            if not self._receive(end):
                return None
        return self.inbox.pop(0)

    def _receive(self, end: float) -> bool:
        """Read what arrives until ``end`` (a partial message waits for its rest)."""
        remaining = end - time.monotonic()
        if not self.listening or remaining < 0 or not wait([self.conn], remaining):
            return False
        self.inbox += self.stream.read(self.conn.fileno())
        self._file_exits()
        return True

    def _file_exits(self) -> None:
        for msg in [m for m in self.inbox if isinstance(m, _forking.Exited)]:
            self.exits[msg.pid] = msg.code
            self.inbox.remove(msg)

    def spent(self) -> float:
        """Seconds its learned preloads took, the one it imports now included."""
        bounded = self.importing and self.importing not in self.trusted
        now = time.monotonic() - self.importing_at if bounded else 0.0
        return self.learned_spent + now

    def kill(self) -> None:
        """End it at once (it is stuck in an import: it would not leave when told)."""
        if not self.closed and self.proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self.conn.close()
        self.proc.join(5)
        if self.proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.proc.join(5)
        with contextlib.suppress(ValueError):  # not reaped after all: left to the kernel
            self.proc.close()


class ForkedChild(_runner.ChildProcess):
    """A child forked by the zygote, driven exactly like a spawned one.

    It is the template's child, not ours: the parent watches it through a pidfd and
    learns its exit code from the template.
    """

    forked = True

    def __init__(self, spec: _orders.ChildSpec, conn: Connection, pid: int, zygote: Zygote) -> None:
        self._proc = None
        self.zygote = zygote
        self._code: int | None = None
        self._adopt(spec, conn, pid, os.pidfd_open(pid))

    @property
    def exitcode(self) -> int | None:
        if self._code is None and self.pid in self.zygote.exits:
            self._code = self.zygote.exits.pop(self.pid)
        return self._code

    def wait_exitcode(self, timeout: float) -> int | None:
        if self.exitcode is None and wait([self.sentinel], timeout):
            self._code = self.zygote.exit_code(self.pid, timeout)
        return self._code

    def reaped(self) -> None:
        if not self.gone:
            with contextlib.suppress(OSError):
                os.close(self.sentinel)
        super().reaped()


#: What the zygote process runs.
ZYGOTE_MAIN = "spawnrun.fork._zygote:main"
