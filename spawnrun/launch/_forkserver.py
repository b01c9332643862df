"""The parent's handle on the zygote (``--spawn-method forkserver``).

Runs in the parent. Starts the template (``_zygoteproc.Zygote``) at session start with
the library modules the parent already has (pytest and ``spawn_preload``, then the
loaded plugins' modules: ``_preloads``), and, once collection is done, asks it to import
the third-party modules that collection imported (the automatic preload): never a
module of the suite, never its conftests. Then asks it to fork one child per test
(``_zygoteproc.ForkedChild``).

If a plugin's or automatically preloaded package makes the template unsafe to fork (it
initializes CUDA or starts a thread at import), the template is rebuilt without that
package (up to ``RETRIES`` times), with a warning naming it. Any other failure or refusal,
an unsafe ``spawn_preload`` module included, turns the zygote off: the run spawns from
then on, with one warning.

What only pytest's cache names (learned preloads, the last template's modules) is a
guess: checked before it is imported (``_learned.check_cache``), imported last, and
given ``_zygoteproc.LEARNED_LIMIT`` in all; a template still importing one past that is
killed and rebuilt without them, with a warning naming the package, which is left out
and remembered like an unsafe one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from collections.abc import Set
from pathlib import Path
from typing import Any

from spawnrun.config import _settings
from spawnrun.fork import _declared
from spawnrun.launch import _options
from spawnrun.launch import _preloads
from spawnrun.launch import _zygoteproc
from spawnrun.learn import _learned
from spawnrun.proc import _coverage
from spawnrun.proc import _probe
from spawnrun.proc._libraries import library_modules
from spawnrun.proc._libraries import project_dirs
from spawnrun.wire import _forking
from spawnrun.wire import _orders
from spawnrun.wire import _reports

OFF = "spawnrun: the forkserver is off and every test spawns from now on: {reason}"
NOT_IMPORTED = (
    "spawnrun: spawn_preload names {module} (from {source}), which the forkserver template "
    "could not import ({error}); fast mode goes on without it"
)
TRIMMED = (
    "spawnrun: the forkserver leaves {module} out of its template: {reason}; children "
    "import it themselves"
)
#: Why a package is left out that read, at import, a variable tests see otherwise.
LEFT_OUT_READ = (
    "it read the environment at import, and a test's differed (its devices, or a variable "
    "set since)"
)
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


class ZygoteHolder:
    """One zygote per run; rebuilt without packages that made it unsafe to fork."""

    def __init__(self, preload: list[str]) -> None:
        self.preload = preload
        self.zygote: _zygoteproc.Zygote | None = None
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
        self.rewrite: _forking.Rewrite | None = None
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
        self.base = _preloads.base_modules(config, self.preload)
        self._remembered(config)
        self.rewrite = _preloads.rewrite_of(config)
        learned, self.rejected = _learned.check_cache(config)
        # Plugins' modules, what earlier runs' tests imported (learned preloads), the
        # libraries the conftests imported (torch, at once rather than after collection)
        # and those the test files import, read (a first run's learned preloads).
        args = [str(a) for a in config.args]
        plugins = _preloads.plugin_modules(config, self.rootdir)
        found = [
            *library_modules(self.rootdir),
            *_declared.test_file_imports(config, self.rootdir, args),
        ]
        wanted = _preloads.dedupe([*plugins, *learned, *found])
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
        spent = self.learned_spent >= _zygoteproc.LEARNED_LIMIT
        return [
            m
            for m in self.optional
            if _preloads.top(m) not in self.excluded and not (spent and m in self.learned)
        ]

    def may_keep(self, module: str) -> bool:
        """Whether the template may import ``module`` (optional, not left out, not
        dropped from the cache)."""
        if module in self.rejected:
            return False
        return _preloads.may_keep(self.config, module, self.rewrite, self.excluded)

    def _make(self, config: Any, modules: list[str]) -> _zygoteproc.Zygote | None:
        spec = _forking.ZygoteSpec(
            modules=modules,
            invocation_dir=self.invocation_dir,
            log_path=str(self.workdir / "output.log"),
            rewrite=self.rewrite,
        )
        try:
            zygote = _zygoteproc.Zygote(spec, self.child_environ)
        except Exception as exc:  # noqa: BLE001 - fast mode off, never the run's end
            self._turn_off(config, f"the template could not be started ({exc!r})")
            return None
        zygote.trusted = self.trusted()
        return zygote

    def trusted(self) -> set[str]:
        """The top-level packages that more than pytest's cache names
        (``_zygoteproc.Zygote.trusted``)."""
        return {_preloads.top(m) for m in self.found}

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
        self, config: Any, spec: _orders.ChildSpec, env: Mapping[str, str]
    ) -> _zygoteproc.ForkedChild | None:
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
        if isinstance(child, _forking.Declined):
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

    def _declined(self, config: Any, nodeid: str, declined: _forking.Declined) -> None:
        """The test is spawned: the template's imports read its environment otherwise.
        The package that read it is left out of the next run's template (its forks
        import it themselves, in their own environment), unless it is one the template
        cannot do without (pytest, a plugin)."""
        tests = self.declined.setdefault(declined.reason, [])
        if nodeid not in tests:  # asked again for its fallback collection
            tests.append(nodeid)
        package = declined.package
        if package and package not in {_preloads.top(m) for m in self.base}:
            if package not in self.excluded:
                self.excluded.append(package)
                _preloads.remember(config, [package], LEFT_OUT_READ)

    def prime(self, spec: _orders.ChildSpec, env: Mapping[str, str], wait: bool) -> None:
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
        end = time.monotonic() + _zygoteproc.BOOT_LIMIT
        ready = self.zygote.ready(_zygoteproc.BOOT_LIMIT, _zygoteproc.LEARNED_LIMIT)
        if ready.stale:  # the head start's template: built again, from scratch
            if self.early is not None:
                self.early.stale(ready.stale)
            self.learned_spent += self.zygote.spent()
            self.zygote.close()
            self._fresh(config)
            if self.zygote is None:
                return
            ready = self.zygote.ready(
                end - time.monotonic(), _zygoteproc.LEARNED_LIMIT - self.learned_spent
            )
        base_tops = {_preloads.top(m) for m in self.base}
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
                text = SLOW.format(module=left_out, limit=_zygoteproc.LEARNED_LIMIT)
                reason = SLOW_REASON.format(limit=_zygoteproc.LEARNED_LIMIT)
                _learned.forget(config, new)
            else:
                self.zygote.close()
                text = TRIMMED.format(module=left_out, reason=_unsafe(ready.problem))
                reason = ready.problem
            _reports.record_warning(config, _reports.warning(text), "")
            _preloads.remember(config, new, reason)
            self._fresh(config)
            if self.zygote is None:
                return
            ready = self.zygote.ready(
                end - time.monotonic(), _zygoteproc.LEARNED_LIMIT - self.learned_spent
            )
        self._not_imported(config)
        if self.zygote.ended:
            self._turn_off(config, self.zygote.ended)
        elif ready.problem:
            after = f" (after importing {ready.culprit})" if ready.culprit else ""
            self._turn_off(config, f"the template cannot fork safely: {ready.problem}{after}")

    def _remembered(self, config: Any) -> None:
        """Leave out what made an earlier run's template unsafe, and say so."""
        found = _preloads.remembered_exclusions(config)
        base_tops = {_preloads.top(m) for m in self.base}
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
