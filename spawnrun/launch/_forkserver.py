"""The parent's handle on the zygote (``--spawn-method forkserver``).

Runs in the parent. Starts the template (with the spawn method: it is never forked
from the parent) at session start with the library modules the parent already has
(pytest and ``spawn_preload``, then the loaded plugins' modules), and, once collection is
done, asks it to import the third-party modules that collection imported (the automatic
preload): never a module of the suite, never its conftests. Then asks it to fork one
child per test, passing the child's end of a fresh pipe as a file handle and the
child's final environment (its devices); learns the child's exit code from the
template, which is its parent, and watches it through a pidfd.

If a plugin's or automatically preloaded package makes the template unsafe to fork (it
initializes CUDA or starts a thread at import), the template is rebuilt without that
package (up to ``RETRIES`` times), with a warning naming it. Any other failure or refusal,
an unsafe ``spawn_preload`` module included, turns the zygote off: the run spawns from
then on, with one warning.

What only pytest's cache names (learned preloads, the last template's modules) is a
guess: checked before it is imported (``_learned.check_cache``), imported last, and
given ``LEARNED_LIMIT`` in all; a template still importing one past that is killed and
rebuilt without them, with a warning naming the package, which is left out and
remembered like an unsafe one.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import signal
import time
import types
from collections.abc import Collection
from collections.abc import Mapping
from collections.abc import Set
from multiprocessing import reduction
from multiprocessing.connection import Connection
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from spawnrun.child import _availability
from spawnrun.config import _settings
from spawnrun.devices import _inventory
from spawnrun.devices import _vendors
from spawnrun.fork import _declared
from spawnrun.launch import _options
from spawnrun.launch import _runner
from spawnrun.launch import _stream
from spawnrun.learn import _learned
from spawnrun.proc import _bytecode
from spawnrun.proc import _coverage
from spawnrun.proc import _main
from spawnrun.proc import _probe
from spawnrun.proc._libraries import is_library
from spawnrun.proc._libraries import library_modules
from spawnrun.proc._libraries import project_dirs
from spawnrun.wire import _protocol as proto
from spawnrun.wire import _reports

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

OFF = "spawnrun: the forkserver is off and every test spawns from now on: {reason}"
NOT_IMPORTED = (
    "spawnrun: spawn_preload names {module} (from {source}), which the forkserver template "
    "could not import ({error}); fast mode goes on without it"
)
TRIMMED = (
    "spawnrun: the forkserver leaves {module} out of its template: {reason}; children "
    "import it themselves"
)
#: Where pytest's cache keeps what made a template unsafe, so the next run leaves it out
#: from the start instead of building the template again without it.
#: Why a package is left out that read, at import, a variable tests see otherwise.
LEFT_OUT_READ = (
    "it read the environment at import, and a test's differed (its devices, or a variable "
    "set since)"
)
EXCLUDED_KEY = "spawnrun/template-excluded"
REMEMBERED = " (an earlier run found this: `pytest --cache-clear` tries it again)"
SLOW = (
    "spawnrun: the forkserver leaves {module} out of its template: importing it, as "
    "pytest's cache asked (a learned preload), took over {limit:g} s; the template is "
    "rebuilt without learned preloads, and children import them themselves"
)
#: How a slow import is kept among the remembered exclusions (its reason starts so).
SLOW_REASON = "slow: importing it took over {limit:g} s"
SLOW_REMEMBERED = (
    "spawnrun: the forkserver leaves {module} out of its template: importing it took too long"
)
#: How many times a template is rebuilt without a package that made it unsafe.
RETRIES = 3


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
    nvml = _vendors.load_nvml()  # the driver's management library: no CUDA context
    try:
        return nvml is not None and int(nvml.nvmlDeviceGetCount()) > 0
    except Exception:  # noqa: BLE001 - no answer is no device
        return False


class Zygote:
    def __init__(self, spec: proto.ZygoteSpec, environ: Mapping[str, str]) -> None:
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
        rewrite: proto.Rewrite | None = None,
    ) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(proto.Preload(modules, path, rewrite, **_found()))
            self.pending += 1

    def preload_all(
        self,
        modules: list[str],
        learned: Collection[str],
        path: list[str] | None = None,
        rewrite: proto.Rewrite | None = None,
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
                self.conn.send(proto.Preload(guessed, learned=True, late=later, **_found()))
                self.pending += 1

    @property
    def listening(self) -> bool:
        """Whether the template can still be heard (the event loop waits on it then)."""
        return not (self.closed or self.stream.ended or self.stream.problem)

    def ready(
        self, limit: float = BOOT_LIMIT, learned_limit: float | None = None
    ) -> proto.ZygoteReady:
        """Wait for every pending answer; the first one with a problem, else the last.

        Learned preloads get ``learned_limit`` seconds in all (``LEARNED_LIMIT``): past
        it, an answer with ``slow`` set names the package the template was importing.
        """
        if learned_limit is None:
            learned_limit = LEARNED_LIMIT
        answer = proto.ZygoteReady(self.pid)
        end = time.monotonic() + limit
        while self.pending:
            learned_end = math.inf
            if self.importing and self.importing not in self.trusted:
                learned_end = self.importing_at + learned_limit - self.learned_spent
            # Polled even past the bound: its answer may be waiting, read late.
            reply = self._next(max(0.0, min(end, learned_end) - time.monotonic()))
            if isinstance(reply, proto.Importing):
                if self.importing and self.importing not in self.trusted:
                    self.learned_spent += reply.at - self.importing_at
                self.importing, self.importing_at = reply.top, reply.at
                continue
            if reply is None and self.listening and time.monotonic() >= learned_end:
                took = f"importing it took over {learned_limit:g} s"
                culprit = self.importing
                return proto.ZygoteReady(self.pid, took, culprit, suspects=[culprit], slow=True)
            if reply is None and not self.listening:
                self.proc.join(1.0)  # it is gone: only its exit status is left to read
                self.ended = (
                    f"the template ended before answering (exit status {self.proc.exitcode}; "
                    f"its output: {self.spec.log_path})"
                )
                return proto.ZygoteReady(self.pid, self.ended)
            self.pending -= 1
            if not isinstance(reply, proto.ZygoteReady):
                return proto.ZygoteReady(self.pid, f"it did not answer as expected: {reply!r}")
            self.failed += reply.failed
            if reply.problem or reply.stale:
                return reply
            answer = reply
        return answer

    def prime(self, spec: proto.ChildSpec, env: Mapping[str, str], wait: bool) -> None:
        """Have a template configured for tests like ``spec`` (no answer comes)."""
        with contextlib.suppress(OSError):
            self.conn.send(proto.Prime(self._request(spec, env), wait))

    def _request(self, spec: proto.ChildSpec, env: Mapping[str, str]) -> proto.ForkRequest:
        unset = [k for k in self.environ if k not in os.environ]
        return proto.ForkRequest(spec, {**os.environ, **env}, unset, spec.log_path is None)

    def fork(
        self, spec: proto.ChildSpec, env: Mapping[str, str]
    ) -> ForkedChild | proto.Declined | str:
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
        if isinstance(reply, proto.Forked):
            return ForkedChild(spec, parent_conn, reply.pid, self)
        parent_conn.close()
        if isinstance(reply, proto.Declined):
            return reply
        if isinstance(reply, proto.Refused):
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
        for msg in [m for m in self.inbox if isinstance(m, proto.Exited)]:
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

    def __init__(self, spec: proto.ChildSpec, conn: Connection, pid: int, zygote: Zygote) -> None:
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


def may_keep(
    config: Any, module: str, rewrite: proto.Rewrite | None, excluded: Collection[str]
) -> bool:
    """Whether a template may import ``module`` beyond its base: not left out by an
    earlier run (``excluded``), and a module pytest rewrites only where the template
    rewrites it the same way (``rewrite``)."""
    if _top(module) in excluded:
        return False
    return rewrite is not None or not rewritten(config, module)


#: What the zygote process runs.
ZYGOTE_MAIN = "spawnrun.fork._zygote:main"


class ZygoteHolder:
    """One zygote per run; rebuilt without packages that made it unsafe to fork."""

    def __init__(self, preload: list[str]) -> None:
        self.preload = preload
        self.zygote: Zygote | None = None
        #: Modules the template must have (pytest, spawn_preload): unsafe means off.
        self.base: list[str] = []
        #: Modules it may do without: plugins' modules, then the automatic preload.
        self.optional: list[str] = []
        #: Top-level packages left out because they made a template unsafe.
        self.excluded: list[str] = []
        #: What only pytest's cache named (imported last, bounded), and what of it the
        #: checks dropped (``_learned.check_cache``).
        self.learned: set[str] = set()
        #: Of those, what earlier runs' tests imported in their bodies (``Preload.late``).
        self.late: set[str] = set()
        self.rejected: set[str] = set()
        #: What something besides the cache names (plugins, the parent's imports, the
        #: test files' import lines): never bounded as learned.
        self.found: set[str] = set()
        #: Seconds earlier templates of this run spent on learned preloads.
        self.learned_spent = 0.0
        self.off = ""
        self.checked = False
        #: Set in the template's environment (``_bytecode``'s directory).
        self.child_environ: dict[str, str] = {}
        #: How the template imports what pytest rewrites (None: it leaves that out).
        self.rewrite: proto.Rewrite | None = None
        self.config: Any = None
        #: The head start (``_headstart.HeadStart``), told if its template was stale.
        self.early: Any = None
        #: Whether a template was asked to configure pytest ahead (``prime``).
        self.primed = False
        #: Why the template declined to fork tests (``_environ``) -> their node ids.
        self.declined: dict[str, list[str]] = {}

    def start(self, config: Any, early: Any = None) -> None:
        """Start the template now, so its imports overlap the parent's own collection;
        or take the one started early (``_headstart.HeadStart``), where it fits."""
        if self.zygote is not None or self.off:
            return
        if not _probe.proc_mounted():
            # The template could not check that forking it is safe.
            self._turn_off(config, _probe.NO_PROC)
            return
        self.workdir = _options.parent_basetemp(config) / "spawnrun" / "zygote"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.invocation_dir = str(config.invocation_params.dir)
        self.rootdir = Path(config.rootpath).resolve()
        self.config = config
        self.base = base_modules(config, self.preload)
        self._remembered(config)
        self.rewrite = rewrite_of(config)
        learned, self.rejected = _learned.check_cache(config)
        # Plugins' modules, what earlier runs' tests imported (learned preloads), the
        # libraries the conftests imported (torch, at once rather than after collection)
        # and those the test files import, read (a first run's learned preloads).
        args = [str(a) for a in config.args]
        plugins = plugin_modules(config, self.rootdir)
        found = [
            *library_modules(self.rootdir),
            *_declared.test_file_imports(config, self.rootdir, args),
        ]
        wanted = _dedupe([*plugins, *learned, *found])
        self.found = {*plugins, *found}
        self.learned = set(learned) - self.found
        # ``check_cache`` keeps the cache's preloads only (what tests imported in their
        # bodies); an early template adopted later adds template modules to ``learned``.
        self.late = set(self.learned)
        self.optional = [m for m in wanted if m not in self.base and self.may_keep(m)]
        self.early = early
        if early is not None:
            self.zygote = early.adopt(self)
        if self.zygote is None:
            self._fresh(config)

    def _fresh(self, config: Any) -> None:
        """A template from scratch: the base, then everything optional found so far."""
        self.zygote = self._make(config, self.base)
        modules = self.wanted()
        if self.zygote is not None and modules:
            self.zygote.preload_all(modules, self.learned, late=self.late)

    def wanted(self) -> list[str]:
        """The optional modules a new template imports: not left out, and learned
        preloads only while their time is not spent."""
        spent = self.learned_spent >= LEARNED_LIMIT
        return [
            m
            for m in self.optional
            if _top(m) not in self.excluded and not (spent and m in self.learned)
        ]

    def may_keep(self, module: str) -> bool:
        """Whether the template may import ``module`` (optional, not left out, not
        dropped from the cache)."""
        if module in self.rejected:
            return False
        return may_keep(self.config, module, self.rewrite, self.excluded)

    def _make(self, config: Any, modules: list[str]) -> Zygote | None:
        spec = proto.ZygoteSpec(
            modules=modules,
            invocation_dir=self.invocation_dir,
            log_path=str(self.workdir / "output.log"),
            rewrite=self.rewrite,
        )
        try:
            zygote = Zygote(spec, self.child_environ)
        except Exception as exc:  # noqa: BLE001 - fast mode off, never the run's end
            self._turn_off(config, f"the template could not be started ({exc!r})")
            return None
        zygote.trusted = self.trusted()
        return zygote

    def trusted(self) -> set[str]:
        """The top-level packages that more than pytest's cache names (``Zygote.trusted``)."""
        return {_top(m) for m in self.found}

    def collected(self, test_files: Set[Path] = frozenset()) -> None:
        """Collection is done: preload the libraries it imported, and the project's own
        packages below the rootdir (not where coverage measures children: what the
        template imports, a child's measurement would not see run)."""
        if self.zygote is None or self.off:
            return
        known = {*self.base, *self.optional}
        project = () if _coverage.parent_config() else project_dirs(self.rootdir, test_files)
        auto = [
            m for m in library_modules(self.rootdir, project) if m not in known and self.may_keep(m)
        ]
        self.optional += auto
        if auto:
            self.zygote.preload(auto)

    def fork(
        self, config: Any, spec: proto.ChildSpec, env: Mapping[str, str]
    ) -> ForkedChild | None:
        if self.zygote is None:
            self.start(config)
        if self.off:
            return None
        assert self.zygote is not None
        if not self.checked:
            self.checked = True
            self._check(config)
            if self.off:
                return None
        child = self.zygote.fork(spec, env)
        if isinstance(child, proto.Declined):
            self._declined(config, spec.nodeid, child)
            return None
        if isinstance(child, str):
            self._turn_off(config, child)
            return None
        return child

    def declined_lines(self) -> list[str]:
        """The summary's words for tests the template declined to fork."""
        lines = []
        for why, nodeids in self.declined.items():
            shown = ", ".join(nodeids[:3]) + (" ..." if len(nodeids) > 3 else "")
            count = f"{len(nodeids)} test{'s' if len(nodeids) != 1 else ''}"
            lines.append(f"{count} spawned, not forked: {why}: {shown}")
        return lines

    def _declined(self, config: Any, nodeid: str, declined: proto.Declined) -> None:
        """The test is spawned: the template's imports read its environment otherwise.
        The package that read it is left out of the next run's template (its forks
        import it themselves, in their own environment), unless it is one the template
        cannot do without (pytest, a plugin)."""
        tests = self.declined.setdefault(declined.reason, [])
        if nodeid not in tests:  # asked again for its fallback collection
            tests.append(nodeid)
        package = declined.package
        if package and package not in {_top(m) for m in self.base}:
            if package not in self.excluded:
                self.excluded.append(package)
                self._remember(config, [package], LEFT_OUT_READ)

    def prime(self, spec: proto.ChildSpec, env: Mapping[str, str], wait: bool) -> None:
        """While the parent collects: the template configures pytest for tests like
        ``spec`` (with ``env``) before the first comes, once per run. A wrong guess costs
        the template one configuration; a test of another kind starts its own, as before.
        ``wait``: the first test of its kind waits for it.
        """
        if not self.may_prime():
            return
        assert self.zygote is not None
        self.primed = True
        self.zygote.prime(spec, env, wait)

    def may_prime(self) -> bool:
        return not (self.primed or self.zygote is None or self.off)

    def _check(self, config: Any) -> None:
        assert self.zygote is not None
        end = time.monotonic() + BOOT_LIMIT
        ready = self.zygote.ready(BOOT_LIMIT, LEARNED_LIMIT)
        if ready.stale:  # the head start's template: built again, from scratch
            if self.early is not None:
                self.early.stale(ready.stale)
            self.learned_spent += self.zygote.spent()
            self.zygote.close()
            self._fresh(config)
            if self.zygote is None:
                return
            ready = self.zygote.ready(end - time.monotonic(), LEARNED_LIMIT - self.learned_spent)
        base_tops = {_top(m) for m in self.base}
        for _ in range(RETRIES):
            if not ready.problem or self.zygote.ended:
                break
            culprit = ready.culprit
            if not culprit or (culprit in base_tops and not ready.slow):
                break
            new = [p for p in ready.suspects or [culprit] if p not in base_tops]
            self.excluded += new
            left_out = ", ".join(ready.suspects or [culprit])
            self.learned_spent += self.zygote.spent()
            if ready.slow:
                # Given up on: every learned preload is, for this run (their time is
                # spent); the culprit is forgotten and, next time, left out.
                self.zygote.kill()
                text = SLOW.format(module=left_out, limit=LEARNED_LIMIT)
                reason = SLOW_REASON.format(limit=LEARNED_LIMIT)
                _learned.forget(config, new)
            else:
                self.zygote.close()
                text = TRIMMED.format(module=left_out, reason=_unsafe(ready.problem))
                reason = ready.problem
            _reports.record_warning(config, _reports.warning(text), "")
            self._remember(config, new, reason)
            self._fresh(config)
            if self.zygote is None:
                return
            ready = self.zygote.ready(end - time.monotonic(), LEARNED_LIMIT - self.learned_spent)
        self._not_imported(config)
        if self.zygote.ended:
            self._turn_off(config, self.zygote.ended)
        elif ready.problem:
            after = f" (after importing {ready.culprit})" if ready.culprit else ""
            self._turn_off(config, f"the template cannot fork safely: {ready.problem}{after}")

    def _remembered(self, config: Any) -> None:
        """Leave out what made an earlier run's template unsafe, and say so."""
        found = remembered_exclusions(config)
        base_tops = {_top(m) for m in self.base}
        by_reason: dict[str, list[str]] = {}
        for top, reason in found.items():
            if isinstance(top, str) and top not in base_tops and top not in self.excluded:
                self.excluded.append(top)
                by_reason.setdefault(str(reason), []).append(top)
        for reason, tops in by_reason.items():
            module = ", ".join(sorted(tops))
            if reason.startswith("slow: "):
                text = SLOW_REMEMBERED.format(module=module)
            else:
                text = TRIMMED.format(module=module, reason=_unsafe(reason))
            _reports.record_warning(config, _reports.warning(text + REMEMBERED), "")

    def _remember(self, config: Any, tops: list[str], reason: str) -> None:
        cache = getattr(config, "cache", None)
        if cache is None or not tops:
            return
        found = remembered_exclusions(config)
        found.update({top: reason for top in tops})
        with contextlib.suppress(Exception):  # a read-only cache: rebuild next time
            cache.set(EXCLUDED_KEY, found)

    def _not_imported(self, config: Any) -> None:
        """Warn of each spawn_preload module the template could not import.

        A warning, not an error: preloading only saves children an import (they import
        what they need themselves), and one ini file often serves machines where an
        optional library is not installed.
        """
        assert self.zygote is not None
        for entry in self.zygote.failed:
            name, _, error = entry.partition(": ")
            if name in self.preload:
                source = _settings.source_of(config, "preload")
                text = NOT_IMPORTED.format(module=name, source=source, error=error)
                _reports.record_warning(config, _reports.warning(text), "")

    def _turn_off(self, config: Any, reason: str) -> None:
        self.off = reason
        if self.zygote is not None:
            self.zygote.close()
        text = OFF.format(reason=reason)
        _reports.record_warning(config, _reports.warning(text), "")

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()


def _unsafe(reason: str) -> str:
    """Why a package is left out, as the warning words it."""
    if reason == LEFT_OUT_READ:
        return reason
    return f"importing it made the template unsafe to fork ({reason})"


def rewritten(config: Any, module: str) -> bool:
    """Whether pytest rewrites asserts in ``module`` (plugins' packages, ``-p`` modules).

    Such a module must be imported by the child's own pytest, which rewrites it on
    import: preloaded, it would keep plain asserts, and pytest warns "Module already
    imported so cannot be rewritten" (an error under ``filterwarnings = error``).
    pytest keeps those names on its import hook, privately; without them nothing is
    left out.
    """
    hook = getattr(config.pluginmanager, "rewrite_hook", None)
    names = getattr(hook, "_must_rewrite", ()) or ()
    return any(module == n or module.startswith(n + ".") for n in names)


def rewrite_of(config: Any) -> proto.Rewrite | None:
    """How the parent's pytest rewrites asserts, for the template (None: it does not).

    The names marked for rewriting are kept on pytest's import hook, privately; without
    them (``--assert=plain``, another pytest) nothing that pytest rewrites is preloaded.
    """
    hook = getattr(config.pluginmanager, "rewrite_hook", None)
    names = getattr(hook, "_must_rewrite", None)
    if not isinstance(names, set):
        return None
    try:
        python_files = [str(p) for p in config.getini("python_files")]
        pass_hook = bool(config.getini("enable_assertion_pass_hook"))
    except (ValueError, KeyError):
        return None
    return proto.Rewrite(sorted(str(n) for n in names), python_files, pass_hook)


def base_modules(config: Any, preload: list[str]) -> list[str]:
    """What every template imports, in order (unsafe to fork after any: fast mode off).

    spawnrun's own plugin too: each fork's pytest loads it (30 ms to import).
    """
    return _dedupe(["pytest", *pytest_modules(config), "spawnrun.plugin", *preload])


def _top(module: str) -> str:
    return module.partition(".")[0]


def _dedupe(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


def remembered_exclusions(config: Any) -> dict[str, Any]:
    """What earlier runs found unsafe in a template, by top-level package ({}: nothing)."""
    cache = getattr(config, "cache", None)
    found = cache.get(EXCLUDED_KEY, {}) if cache is not None else {}
    return dict(found) if isinstance(found, dict) else {}


#: Imported by every child's pytest at configure time (its debugging plugin) and by the
#: child's guard against debuggers.
CONFIGURE_IMPORTS = ["pdb"]


def pytest_modules(config: Any) -> list[str]:
    """pytest's own plugin modules that the parent's pytest loaded, and what they import
    when a child configures.

    ``import pytest`` leaves most of its built-in plugins (junitxml, debugging, skipping,
    unittest...) to the configuration, which imported them in each fork again (~7 ms of
    CPU per fork). A plugin the parent's pytest blocked (``-p no:junitxml``) is not
    loaded by the child's either, and is left out.
    """
    names = [
        plugin.__name__
        for _, plugin in config.pluginmanager.list_name_plugin()
        if isinstance(plugin, types.ModuleType) and plugin.__name__.startswith("_pytest.")
    ]
    return [*names, *CONFIGURE_IMPORTS]


def plugin_modules(config: Any, rootdir: Path) -> list[str]:
    """Modules of the plugins the parent loaded, outside the suite's own folder."""
    names = []
    for _, plugin in config.pluginmanager.list_name_plugin():
        if isinstance(plugin, types.ModuleType) and is_library(plugin, rootdir):
            names.append(plugin.__name__)
    return names
