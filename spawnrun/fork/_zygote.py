"""The zygote: a template process that imports libraries once, then forks one child per test.

Runs in the template, which the parent starts with the spawn method (it is never forked
from the parent), and in the children it forks. The template imports *libraries only*:
pytest, the modules of the plugins the parent loaded, ``spawn_preload``, and then (on
``Preload``) the third-party modules the parent's collection imported (how it imports
them, and what of them a later ``Preload`` finds stale: ``_importing``). It never
configures pytest, never imports the suite's conftests or test modules, and so never
runs the code that touches a GPU at import. Each child it forks gets its final
environment (its devices) first, then does what a spawned child does: configure pytest,
collect its test, say "booted", wait for the go (``_child.main``). CUDA initialized by a
conftest is initialized in that child, for that child.

Forking is refused, for good, when the template itself is unsafe to fork: a device
runtime is initialized in it (torch's CUDA state, or ``cuInit`` asked of the driver),
another thread runs in it (an OpenMP or MKL pool a forked child would wait on forever,
any thread holding a lock), or a plugin says so (``pytest_spawnrun_device_state``). The
parent then spawns from then on and says why.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
import time
import traceback
from multiprocessing import Pipe
from multiprocessing import reduction
from multiprocessing.connection import Connection
from multiprocessing.connection import wait
from typing import Any
from typing import NoReturn

from spawnrun.child import _availability
from spawnrun.child import _child
from spawnrun.child import _environ
from spawnrun.child import _leave
from spawnrun.child import _metadata
from spawnrun.child import _streams
from spawnrun.child import _threadwatch
from spawnrun.child._forksafe import unsafe_state
from spawnrun.fork import _configured
from spawnrun.fork import _importing
from spawnrun.proc import _fresh
from spawnrun.proc import _probe
from spawnrun.wire import _forking


def main(spec: _forking.ZygoteSpec, conn: Connection) -> NoReturn:
    _streams.arm()  # its forks, and the configured templates', keep what code seeded
    _threadwatch.arm()  # a refusal for a thread names the import that started it
    _probe.die_with_parent()  # and its children with it, through theirs
    os.setsid()
    fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(spec.invocation_dir)
    try:
        template = _Template(conn, spec.rewrite)
        template.load(spec.modules)
        template.serve()
    except BaseException:  # noqa: BLE001 - the parent must hear why, then spawns
        with contextlib.suppress(OSError):
            conn.send(_forking.ZygoteReady(os.getpid(), traceback.format_exc()))
    # The parent is done with us (its session's end waits for this exit): leave as a
    # child does, exit work and all, without the interpreter's teardown of everything
    # imported here (~75 ms with torch).
    _leave.leave(0)


class _Template:
    """Imports what it is told, checking after each package; then forks on request."""

    def __init__(self, conn: Connection, rewrite: _forking.Rewrite | None = None) -> None:
        self.conn = conn
        #: pytest's rewriting hook as the parent's is set up (None: nothing rewritten).
        self.rewriter = _importing.rewrite_hook(rewrite) if rewrite is not None else None
        self.marked = set(rewrite.names) if rewrite is not None else set()
        self.refusal = ""
        #: pidfd -> pid of each forked child still running: its exit wakes us at once.
        self.children: dict[int, int] = {}
        #: Templates that configured pytest once; their forks are tests' children too.
        self.pool = _configured.Pool()

    def load(
        self,
        modules: list[str],
        learned: bool = False,
        late: frozenset[str] = frozenset(),
        answers: _availability.WhileImporting | None = None,
    ) -> None:
        """Import ``modules`` in order, checking safety after each top-level package.

        The first package after whose import forking became unsafe is named as the
        culprit (the parent may then build a template without it); nothing after it
        is imported. What the imports read of the environment is noted
        (``_environ``): each fork is checked against it. ``learned``: the parent hears
        when each package starts, and when all are done, so that it can give up on an
        import that blocks.
        """
        failed: list[str] = []
        groups: dict[str, list[str]] = {}
        for name in modules:
            groups.setdefault(name.partition(".")[0], []).append(name)
        with (
            _importing.rewriting(self.rewriter),
            _importing.openmp_waits_passively(),
            _importing.collector_paused(),
        ):
            try:
                with _environ.observing():
                    imported, culprit, suspects = self._import(
                        groups, failed, learned, late, answers
                    )
            finally:
                if answers is not None:
                    answers.restore()  # its forks ask CUDA themselves
            if learned:
                self.conn.send(_forking.Importing("", time.monotonic()))
            _metadata.snapshot()  # each fork's pytest reads the installed packages from it
            # The garbage the imports left (cycles holding files, say) is collected once,
            # here, not at every threshold along the way (``_importing.collector_paused``). What is
            # left lives as long as the template: keep the collector off it, so children
            # neither scan it (pytest's final collections took ~0.3 s with torch) nor copy
            # its pages by touching object headers (the pre-fork idiom gc.freeze is made
            # for).
            if imported or not gc.get_freeze_count():  # nothing new: nothing to collect
                gc.collect()
                gc.freeze()
        self.conn.send(_forking.ZygoteReady(os.getpid(), self.refusal, culprit, failed, suspects))

    def _import(
        self,
        groups: dict[str, list[str]],
        failed: list[str],
        learned: bool,
        late: frozenset[str] = frozenset(),
        answers: _availability.WhileImporting | None = None,
    ) -> tuple[bool, str, list[str]]:
        """Import each package's modules; (whether any was imported, the culprit, the
        suspects: the packages imported with the one that made forking unsafe)."""
        imported = False
        for top, names in groups.items():
            if self.refusal:
                break
            names = [name for name in names if name not in sys.modules]
            if not names:
                continue  # imported already: nothing to check again
            imported = True
            if learned:
                self.conn.send(_forking.Importing(top, time.monotonic()))
            before = {m.partition(".")[0] for m in sys.modules}
            for name in names:
                if answers is not None:
                    answers.ensure()  # once torch is imported
                try:
                    with _environ.reading_late(name if name in late else ""):
                        importlib.import_module(name)
                except BaseException as exc:  # noqa: BLE001 - the children import it
                    failed.append(f"{name}: {exc!r}")
            self.refusal = unsafe_state()
            if self.refusal:
                # The package, and every package its import brought in, are suspects.
                now = {m.partition(".")[0] for m in sys.modules}
                return imported, top, sorted({top} | (now - before))
        return imported, "", []

    def update(self, path: list[str] | None, rewrite: _forking.Rewrite | None) -> str:
        """Take the parent's ``sys.path`` and rewriting as they are now; say what is
        stale ("" if nothing): a module imported before that would now be found
        elsewhere first, or is now marked for rewriting but was imported plain."""
        if rewrite is not None and set(rewrite.names) != self.marked:
            plain = _importing.imported_plain(set(rewrite.names) - self.marked)
            if plain:
                return f"{plain} was imported before it was marked for rewriting"
            self.rewriter = _importing.rewrite_hook(rewrite)
            self.marked = set(rewrite.names)
        if path is not None and path != sys.path:
            moved = _importing.found_elsewhere(path)
            if moved:
                return f"{moved} is found elsewhere first on the parent's sys.path now"
            sys.path[:] = path
        return ""

    def changes(self, preload: _forking.Preload) -> bool:
        """Whether ``preload`` would change what a configured template forks from: a
        module not imported yet (collection's preload lists everything it imported,
        torch's hundreds of modules too), another ``sys.path`` or other rewriting."""
        if preload.path is not None and preload.path != sys.path:
            return True
        if preload.rewrite is not None and set(preload.rewrite.names) != self.marked:
            return True
        return any(name not in sys.modules for name in preload.modules)

    def serve(self) -> None:
        while True:
            ready = wait([self.conn, *self.children, *self.pool.watched()])
            for fd in [r for r in ready if r in self.children]:
                self._reap(fd)
            self.pool.on_ready(ready)
            self._send_exits()
            if self.conn not in ready:
                continue
            try:
                request = self.conn.recv()
            except (EOFError, OSError):
                return  # the parent is done with us
            if isinstance(request, _forking.Preload):
                if self.changes(request):
                    self.pool.retire()  # configured before these imports, or another path
                stale = self.update(request.path, request.rewrite)
                if stale:
                    self.conn.send(_forking.ZygoteReady(os.getpid(), stale=stale))
                else:
                    answers = _availability.WhileImporting(
                        request.cuda_available, request.torch_config
                    )
                    self.load(request.modules, request.learned, request.late, answers)
            elif isinstance(request, _forking.Prime):
                if not self.refusal:
                    self.pool.prime(request.request, lambda r: self._configure(r, []), request.wait)
            elif isinstance(request, _forking.ForkRequest):
                fd = _fresh.kept(reduction.recv_handle(self.conn))
                # With -s the child writes where the parent does, not to our log.
                count = 2 if request.live else 0
                streams = [_fresh.kept(reduction.recv_handle(self.conn)) for _ in range(count)]
                self._fork(request, fd, streams)

    def _send_exits(self) -> None:
        exits, self.pool.exits = self.pool.exits, []
        for exited in exits:
            self.conn.send(exited)

    def _reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self.conn.send(_forking.Exited(pid, os.waitstatus_to_exitcode(status)))

    def _fork(self, request: _forking.ForkRequest, fd: int, streams: list[int]) -> None:
        handles = [fd, *streams]
        final = _environ.final_environment(request.env, request.unset)
        package, why = _environ.conflict(final)
        if not why:
            # No package to leave out: it asked CUDA, which most tests' devices answer so.
            why = _availability.differs(
                final.get("CUDA_VISIBLE_DEVICES"), request.spec.cuda_available
            )
        if why:  # its view of what was imported here would not be a spawned child's
            for handle in handles:
                os.close(handle)
            self.conn.send(_forking.Declined(why, package))
            return
        pid = None
        if not self.refusal:
            pid = self.pool.fork(request, handles, lambda r: self._configure(r, handles))
            self._send_exits()
        if pid is None and not self.refusal:
            self.refusal = unsafe_state()
        if self.refusal:
            for handle in handles:
                os.close(handle)
            self.conn.send(_forking.Refused(self.refusal))
            return
        if pid is None:
            template = os.getpid()
            _child.prebuild(request.spec.plugin_args)  # what each such fork would make
            pid = os.fork()
            if pid == 0:
                self.pool.close_in_child()
                for target, stream in zip((1, 2), streams, strict=False):
                    os.dup2(stream, target)
                _forked_child(request, fd, self.conn, list(self.children), template)
            self.children[os.pidfd_open(pid)] = pid
        for handle in handles:
            os.close(handle)
        self.conn.send(_forking.Forked(pid))

    def _configure(
        self, request: _forking.ForkRequest, handles: list[int]
    ) -> tuple[int, Connection] | None:
        """Fork a configured template for the kind of ``request`` (``_configured``);
        None where this process may not fork."""
        if unsafe_state():
            return None
        ours, theirs = Pipe(duplex=True)
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                self.conn.close()
                self.pool.close_in_child()
                for handle in (*handles, *self.children):
                    os.close(handle)  # the test's pipe end is its child's alone
                _configured.main(request, theirs, zygote)
            finally:
                os._exit(70)
        theirs.close()
        return pid, ours


def _forked_child(
    request: _forking.ForkRequest, fd: int, template: Connection, inherited: list[int], parent: int
) -> Any:
    try:
        template.close()
        for pidfd in inherited:  # the template's watches on its other children
            os.close(pidfd)
        # The parent's environment as it is now, with the child's devices and marks,
        # before any of the suite's code runs: as a spawned child would start.
        _configured.take_environment(request)
        # Its parent is the template, not the multiprocessing parent it inherited.
        _child.main(request.spec, Connection(fd), forked=True, parent=parent)
    finally:
        # Never run the template's code again, whatever happened.
        os._exit(70)
