"""The zygote's head start: fast mode's template starts before the conftests are loaded.

Runs in the parent. The template used to start at session start, after pytest had loaded
the initial conftests, and a conftest that imports torch (kornia's, vLLM's) made it wait
for that import, then pay the same import again itself (seconds on a GPU image), before
the first test could fork. Started from ``pytest_load_initial_conftests`` instead, with
what the last run's template imported (kept in pytest's cache), its imports overlap the
parent's own. Without the cache (``-p no:cacheprovider``, ``--cache-clear``) it starts
all the same, with what the conftests and test files import; where children keep their
bytecode (``_bytecode``), it makes the run's directory for that, which the session takes.

What the template gets must be what it would have got at session start, since nothing
that a library may read while it is imported can be changed afterwards. At session start
the holder (``_forkserver.ZygoteHolder``) compares (``HeadStart.adopt``): the same
environment variables, working directory, bytecode directory and ``spawn_preload``, and
only more of pytest's own modules. Anything else, and the template is dropped and one
started as before. The parent's ``sys.path`` and assertion rewriting as they are then
are sent to the template, which answers ``stale`` if a module it imported would now be
another (found elsewhere first, or marked for rewriting after it was imported plain):
the holder then builds the template from scratch. Either way the next run does not
start one early (the reason is kept in the cache) until a run finds that it would have
fitted (``--cache-clear`` forgets it too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from spawnrun.child import _child
from spawnrun.config import _settings
from spawnrun.fork import _declared
from spawnrun.launch import _forkserver
from spawnrun.launch import _preloads
from spawnrun.launch import _starting
from spawnrun.launch import _zygoteproc
from spawnrun.learn import _learned
from spawnrun.proc import _bytecode
from spawnrun.proc import _probe
from spawnrun.proc._libraries import is_library
from spawnrun.wire import _forking

KEY = pytest.StashKey["HeadStart"]()
#: Where pytest's cache keeps the library modules the last run's template imported.
CACHE_MODULES = _learned.CACHE_TEMPLATE_MODULES
#: Where it keeps why the last head start did not fit ("" or absent: it may start).
CACHE_OFF = "spawnrun/head-start-off"
#: A reason kept until the cache is cleared: only a template can find it out.
STALE = "stale: "


@dataclass
class HeadStart:
    """What the early template was started with (``zygote`` None: it was not started)."""

    zygote: _zygoteproc.Zygote | None
    base: list[str]
    optional: list[str]
    rewrite: _forking.Rewrite | None
    child_environ: dict[str, str]
    environ: dict[str, str]
    path: list[str]
    invocation_dir: str
    workdir: str = ""
    #: Why an earlier run's head start did not fit (the cache's), or "".
    off: str = ""
    cache: Any = None
    #: What of ``optional`` only pytest's cache named (imported last, bounded).
    learned: set[str] = dataclasses.field(default_factory=set)
    #: Its SIGTERM handler until the session's own (``close_on_sigterm``), or None.
    on_sigterm: Any = None

    def misfit(self, holder: _forkserver.ZygoteHolder) -> str:
        """Why a template started with this would differ from the holder's ("": none)."""
        if self.invocation_dir != holder.invocation_dir:
            return "the working directory changed"
        if self.child_environ != holder.child_environ:
            return "the bytecode directory changed"
        changed = sorted(
            k for k in {*self.environ, *os.environ} if self.environ.get(k) != os.environ.get(k)
        )
        if changed:
            return f"a conftest or plugin set {', '.join(changed[:3])} in the environment"
        if not set(self.base) <= set(holder.base):
            return "the modules every template imports changed"
        if (self.rewrite is None) != (holder.rewrite is None):
            return "assertion rewriting changed"
        dropped = [m for m in self.optional if not holder.may_keep(m)]
        if dropped:
            return f"{dropped[0]} may not be preloaded any more"
        return ""

    def adopt(self, holder: _forkserver.ZygoteHolder) -> _zygoteproc.Zygote | None:
        """The early template, told what changed, if it fits the holder's; else None."""
        why = self.misfit(holder)
        if why:
            self.keep(why)
        elif not self.off.startswith(STALE):
            self.forget()  # it would have fitted: the next run starts one early again
        zygote, self.zygote = self.zygote, None
        if zygote is None or why:
            if zygote is not None:
                zygote.close()
            return None
        holder.optional = _dedupe([*self.optional, *holder.optional])
        holder.learned |= self.learned - holder.found
        zygote.trusted = holder.trusted()
        new = [m for m in [*holder.base, *holder.optional] if m not in {*self.base, *self.optional}]
        path = list(sys.path) if sys.path != self.path else None
        rewrite = holder.rewrite if holder.rewrite != self.rewrite else None
        zygote.preload_all(new, holder.learned, path, rewrite, late=holder.late)
        log = _move_log(zygote.spec.log_path, holder.workdir)
        zygote.spec = dataclasses.replace(zygote.spec, log_path=log)
        return zygote

    def stale(self, reason: str) -> None:
        """The adopted template found a module it imported stale."""
        self.keep(STALE + reason)

    def keep(self, why: str) -> None:
        if why and why != self.off:
            with contextlib.suppress(Exception):  # a read-only cache: found again next time
                self.cache.set(CACHE_OFF, why)

    def forget(self) -> None:
        if self.off:
            with contextlib.suppress(Exception):
                self.cache.set(CACHE_OFF, "")

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start(config: pytest.Config) -> None:
    """At ``pytest_load_initial_conftests``: start the template if fast mode will run."""
    if _child.owns(config):
        return
    early = _Early(config)
    if _settings.xdist_controller(early.getoption):
        return
    try:
        settings = _settings.resolve(early)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - pytest says what is wrong, after this hook
        return
    if settings.method != "forkserver" or not settings.runs_children(early.getoption):
        return
    if early.getoption("setupplan") or not _probe.proc_mounted():
        return
    workdir = ""
    child_environ = {}
    if _bytecode.wanted(settings.pycache):
        if early.cache is not None:
            directory, problem = _starting.private_cache_dir(early.cache)
            if directory is None or problem:
                return  # the session warns, and uses its own temporary directory
        else:
            # No cache to keep it in (-p no:cacheprovider, --cache-clear): this run's
            # own, as the session would make (it takes this one).
            workdir = tempfile.mkdtemp(prefix="spawnrun-zygote-")
            directory = Path(workdir, "pycache")
            directory.mkdir()
        child_environ[_bytecode.ENV] = str(directory)
    base = _preloads.base_modules(config, list(settings.preload))
    rootdir = Path(config.rootpath).resolve()
    excluded = set(_preloads.remembered_exclusions(early))
    rewrite = _preloads.rewrite_of(config)
    found = [
        *_preloads.plugin_modules(config, rootdir),
        *_declared.conftest_imports(config, rootdir),
        *_declared.test_file_imports(config, rootdir, _declared.paths_to_collect(config)),
    ]
    # Checked, not reported: the session does that (``_learned.check_cache``), once.
    preloads = _learned.preloads(early)  # type: ignore[arg-type]
    learned = [*preloads, *_learned.template_modules(early)]  # type: ignore[arg-type]
    optional = [
        m
        for m in _dedupe([*found, *learned])
        if m not in base and _preloads.may_keep(config, m, rewrite, excluded)
    ]
    off = early.cache.get(CACHE_OFF, "") if early.cache is not None else ""
    head = HeadStart(
        None,
        base,
        optional,
        rewrite,
        child_environ,
        dict(os.environ),
        list(sys.path),
        str(config.invocation_params.dir),
        workdir=workdir,
        off=off if isinstance(off, str) else "",
        cache=early.cache,
        learned=set(learned) - set(found),
    )
    config.stash[KEY] = head
    config.add_cleanup(head.close)
    close_on_sigterm(head)
    if head.off:
        return
    head.workdir = head.workdir or tempfile.mkdtemp(prefix="spawnrun-zygote-")
    spec = _forking.ZygoteSpec(base, head.invocation_dir, f"{head.workdir}/output.log", rewrite)
    try:
        head.zygote = _zygoteproc.Zygote(spec, child_environ)
    except Exception:  # noqa: BLE001 - the session starts one as before, and says why
        return
    head.zygote.preload_all(optional, head.learned, late=set(preloads) - set(found))


def close_on_sigterm(head: HeadStart) -> None:
    """Until the session turns SIGTERM into an interrupt (at its configure), a SIGTERM
    (a conftest still loading, say) ended pytest here with no cleanup, and left the
    template's directory (``spawnrun-zygote-*`` in the temporary directory) behind:
    the head start is closed first, then the process dies of the signal as before. Not
    where something else already handles SIGTERM, nor off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        head.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    head.on_sigterm = on_sigterm


def remember(config: pytest.Config, holder: _forkserver.ZygoteHolder) -> None:
    """Keep the library modules this run's template imported, for the next head start."""
    cache = getattr(config, "cache", None)
    if cache is None or holder.zygote is None or holder.off:
        return
    failed = {entry.partition(": ")[0] for entry in holder.zygote.failed}
    rootdir = Path(config.rootpath).resolve()
    modules = [
        m
        for m in holder.optional
        if m not in failed
        and _learned.is_module_name(m)  # sysconfig's data module has hyphens
        and m.partition(".")[0] not in holder.excluded
        and (m not in sys.modules or is_library(sys.modules[m], rootdir))
    ][: _learned.MAX_PRELOADS]
    if modules != cache.get(CACHE_MODULES, None):
        with contextlib.suppress(Exception):
            cache.set(CACHE_MODULES, modules)


def _move_log(log: str, workdir: Path) -> str:
    """The early template's log, moved to where the session keeps the template's."""
    target = workdir / "output.log"
    try:
        os.replace(log, target)  # its open handle follows the file
    except OSError:
        return log
    return str(target)


def _dedupe(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


class _Early:
    """The config as ``pytest_load_initial_conftests`` has it: options from the known
    arguments (``config.option`` holds defaults until the command line is parsed in
    full) and pytest's cache read directly (its plugin makes ``config.cache`` later)."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self.cache: Any = None
        # Not with --cache-clear: nothing learned is wanted, and the cache is cleared
        # when pytest's plugin configures.
        if config.pluginmanager.has_plugin("cacheprovider") and not self.getoption("cacheclear"):
            from _pytest.cacheprovider import Cache

            with contextlib.suppress(Exception):  # pytest < 8.1 read its own options here
                self.cache = Cache.for_config(self, _ispytest=True)  # type: ignore[arg-type]

    def getoption(self, name: str, default: Any = None, skip: bool = False) -> Any:
        return getattr(self._config.known_args_namespace, name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)
