"""What a test's child is started with: its options, environment and spec.

Runs in the parent. ``Shared`` is what every child of the run gets (worked out once, at
session start); ``child_env`` what one test's child gets on top (its devices, its
budget); ``start`` makes the child's spec and starts it, forked from the zygote in fast
mode, else spawned; ``start_early`` starts one for a file before its tests are known
(``_early``), and ``assign`` tells it its test.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pickle
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from spawnrun import CHILD_ENV
from spawnrun.child import _availability
from spawnrun.child._budget import BUDGET_ENV
from spawnrun.child._budget import INIT_LOCK_ENV
from spawnrun.child._budget import INIT_SLOTS
from spawnrun.child._budget import INIT_SLOTS_ENV
from spawnrun.child._budget import SOURCE_ENV
from spawnrun.child._budget import XLA_FRACTION_ENV
from spawnrun.child._budget import XLA_PREALLOCATE_ENV
from spawnrun.child._jaxcache import JAX_CACHE_ENV
from spawnrun.child._jaxcache import JAX_DIR_ENV
from spawnrun.config._plan import SETTINGS_KEY
from spawnrun.devices import _inventory
from spawnrun.devices import _ledger
from spawnrun.devices import _packing
from spawnrun.launch import _forkserver
from spawnrun.launch import _options
from spawnrun.launch import _runner
from spawnrun.proc import _coverage
from spawnrun.wire import _identity
from spawnrun.wire import _orders

_serial = count(1)


@dataclass(frozen=True)
class Shared:
    """What every child of the run gets from the parent, worked out once (session start)."""

    options: dict[str, Any]
    late_options: dict[str, bytes]
    plugin_args: list[str]
    workerinput: dict[str, Any] | None
    junit_family: str
    coverage: str
    #: Set in every child's environment (``_bytecode``'s directory).
    environ: dict[str, str] = field(default_factory=dict)
    #: The parent's arguments, for configured templates (``ChildSpec.run_args``).
    run_args: list[str] = field(default_factory=list)


def shared(config: pytest.Config, environ: Mapping[str, str], configured: bool) -> Shared:
    """``configured``: children may fork from a template that configured pytest once."""
    options, late = _options.forwarded_options(config)
    return Shared(
        options=options,
        late_options=late,
        plugin_args=_options.plugin_args(config),
        workerinput=_workerinput(config),
        junit_family=_junit_family(config),
        coverage=_coverage.parent_config(),
        environ=dict(environ),
        run_args=list(config.args) if configured else [],
    )


SHARED_KEY = pytest.StashKey[Shared]()
#: Set with --spawn-method forkserver.
ZYGOTE_KEY = pytest.StashKey[_forkserver.ZygoteHolder]()


def child_env(
    config: pytest.Config,
    plan: _packing.Plan,
    devices: list[str],
    capacity: Mapping[str, int | None],
) -> dict[str, str]:
    """What a test's child gets in its environment from its first instruction on."""
    # Its devices' tokens in the vendor's visibility variables (none: hidden).
    env = {CHILD_ENV: "1", **_inventory.child_env(devices, plan.every)}
    need = plan.need
    if need is not _packing.ALONE:
        # Its budget, before any of its code runs: torch gets it at CUDA's init
        # (``_budget``), JAX reads these itself.
        env[BUDGET_ENV] = str(need)
        env[SOURCE_ENV] = plan.budget_source
        env[XLA_PREALLOCATE_ENV] = "false"
        if devices:
            env[INIT_LOCK_ENV] = str(_init_lock(config, devices[0]))
            env[INIT_SLOTS_ENV] = os.environ.get(INIT_SLOTS_ENV, str(INIT_SLOTS))
        sizes = [capacity.get(d) for d in devices or capacity]
        known = [c for c in sizes if c]
        if known and len(known) == len(sizes):
            env[XLA_FRACTION_ENV] = f"{min(1.0, need / min(known)):.4f}"
    settings = config.stash.get(SETTINGS_KEY, None)
    if settings is None:
        return env
    cache = _jax_cache(config, settings.jax_cache)
    if cache:
        env[JAX_CACHE_ENV] = cache
    return env


#: Where JAX's compilation cache is kept in pytest's cache (``--spawn-jax-cache auto``).
JAX_KEPT = "spawnrun-jax-cache"
#: The most that cache holds at a run's start: past it, the least recently written
#: entries go until half is left (JAX's own limit is off by default).
JAX_KEPT_LIMIT = 1 << 30
#: The run's directory for JAX's compilation cache ("": none), made once.
_JAX_CACHE_KEY = pytest.StashKey[str]()


def _jax_cache(config: pytest.Config, mode: str) -> str:
    """Where the run's children share JAX's compilation cache, where JAX is installed
    and the environment names no cache of JAX's ("" otherwise, or ``mode`` off).

    auto: in pytest's cache, kept for the next run, where it is a directory of this
    user's that nobody else may write (compiled programs are code the devices run, as
    bytecode is: ``pycache_dir``); else, and with run, in the run's own directory.
    """
    known = config.stash.get(_JAX_CACHE_KEY, None)
    if known is not None:
        return known
    path = ""
    if mode != "off" and not os.environ.get(JAX_DIR_ENV) and _has_jax():
        cache = getattr(config, "cache", None)
        kept, problem = None, ""
        if mode == "auto" and cache is not None:
            kept, problem = private_cache_dir(cache, JAX_KEPT)
        if kept is not None and not problem:
            directory = kept
            prune(directory, JAX_KEPT_LIMIT)
        else:
            directory = _run_directory(config) / "jax-cache"
            directory.mkdir(parents=True, exist_ok=True)
        path = str(directory)
    config.stash[_JAX_CACHE_KEY] = path
    return path


def prune(directory: Path, limit: int) -> None:
    """Remove the oldest files of ``directory`` (by when they were written) until they
    take half of ``limit``, where they take more than ``limit``; never raises."""
    try:
        files = [(s.st_mtime, s.st_size, p) for p in directory.iterdir() for s in [p.stat()]]
    except OSError:
        return
    total = sum(size for _, size, _ in files)
    if total <= limit:
        return
    for _, size, path in sorted(files, key=lambda f: f[0]):
        if total <= limit // 2:
            break
        try:
            path.unlink()
            total -= size
        except OSError:
            continue


def _has_jax() -> bool:
    try:
        return importlib.util.find_spec("jax") is not None
    except (ImportError, ValueError):
        return False


def _run_directory(config: pytest.Config) -> Path:
    """The run's own directory, shared by its xdist workers (the ledger's private
    directory), else below the session's basetemp."""
    shared = getattr(config, "workerinput", {}).get("spawnrun_ledger")
    return Path(shared) if shared else _options.parent_basetemp(config) / "spawnrun"


def _init_lock(config: pytest.Config, device: str) -> Path:
    """The lock children sharing ``device`` create their CUDA contexts under.

    In the run's own directory (``_run_directory``).
    """
    directory = _run_directory(config)
    directory.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c == "-" else "_" for c in device)
    return directory / f"cuda-init-{safe}.lock"  # slots: <this>-0, <this>-1, ...


def _junit_family(config: pytest.Config) -> str:
    """The family of the junitxml file this process writes ("" when it writes none)."""
    if not config.option.xmlpath or hasattr(config, "workerinput"):
        return ""  # an xdist worker: the controller writes it, as in-process
    return str(config.getini("junit_family"))


def _workerinput(config: pytest.Config) -> dict[str, Any] | None:
    workerinput = getattr(config, "workerinput", None)
    if not isinstance(workerinput, dict):
        return None
    plain = {}
    for key, value in workerinput.items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - what does not pickle stays behind
            continue
        plain[key] = value
    return plain


def candidate_args(item: pytest.Item, then: Sequence[str] = ()) -> list[list[str]]:
    """The test's file alone first (cheap), with those of its scope's later tests; what
    the parent collected on fallback."""
    first = [str(item.path)]
    for nodeid in then:
        path = str(item.config.rootpath / nodeid.split("::")[0])
        if path not in first:
            first.append(path)
    fallback = list(item.config.args)
    return [first] if fallback == first else [first, fallback]


def _spec(config: pytest.Config, name: str, args: list[str], **test: Any) -> _orders.ChildSpec:
    workdir = _options.child_dir(config, name, next(_serial))
    workdir.mkdir(parents=True, exist_ok=True)
    run = config.stash[SHARED_KEY]
    live = config.getoption("capture") == "no"
    found = _availability.in_parent()  # asked once: it may look at the driver
    return _orders.ChildSpec(
        args=args,
        plugin_args=run.plugin_args,
        option_dict=dict(run.options, basetemp=str(workdir / "tmp")),
        invocation_dir=str(config.invocation_params.dir),
        log_path=None if live else str(workdir / "output.log"),
        stacks_path=str(workdir / "stacks.txt"),
        workerinput=run.workerinput,
        late_options=run.late_options,
        junit_family=run.junit_family,
        coverage=run.coverage,
        cuda_available=found,
        torch_config=_availability.config_in_parent() if found else None,
        deviceless=not _inventory.active().ids,
        run_args=run.run_args,
        **test,
    )


def start_early(config: pytest.Config, path: str, env: Mapping[str, str]) -> _runner.ChildProcess:
    """A child that collects ``path`` and then waits to be told its test (``assign``).

    Spawned, not forked: it starts while the parent collects, before the zygote (fast
    mode) has imported what it forks from.
    """
    spec = _spec(config, os.path.basename(path), [path], nodeid="")
    return _runner.ChildProcess(spec, env={**config.stash[SHARED_KEY].environ, **env})


def prime(config: pytest.Config, path: str, env: Mapping[str, str], wait: bool) -> None:
    """Fast mode, while the parent collects: the zygote configures a template for tests
    like ``path``'s (``env``: their guessed devices) before the first is asked for, so
    that it forks from one sooner (``wait``: the first waits for it rather than
    configuring pytest in its own process). Once per run; nothing where children
    configure pytest themselves."""
    if not may_prime(config):
        return
    spec = _spec(config, "template", [path], nodeid=path)
    run = config.stash[SHARED_KEY]
    config.stash[ZYGOTE_KEY].prime(spec, {**run.environ, **env}, wait)


def may_prime(config: pytest.Config) -> bool:
    """Whether ``prime`` would still ask for a template: fast mode, its zygote on, not
    asked yet, and children that fork from configured templates."""
    holder = config.stash.get(ZYGOTE_KEY, None)
    run = config.stash.get(SHARED_KEY, None)
    return holder is not None and holder.may_prime() and run is not None and bool(run.run_args)


def assign(
    child: _runner.ChildProcess,
    item: pytest.Item,
    executions: int = 0,
    then: Sequence[str] = (),
    template: bool = False,
) -> _runner.ChildProcess:
    """Tell a child started early (``start_early``) which test it is for."""
    holder = item.config.stash.get(ZYGOTE_KEY, None)
    # A template where a fresh fork of it would have been one: fast mode, not turned off.
    fork_each = template and holder is not None and not holder.off
    msg = _orders.Assign(
        item.nodeid,
        _identity.bindings(item),
        list(then) if fork_each or not template else [],
        executions,
        fork_each,
    )
    child.assign(msg)
    return child


def start(
    item: pytest.Item,
    args: list[str],
    env: Mapping[str, str],
    executions: int = 0,
    then: Sequence[str] = (),
    template: bool = False,
    fresh: bool = False,
) -> _runner.ChildProcess:
    """The test's child: forked from the zygote in fast mode, else (or ``fresh``: a
    fork's outcome is in doubt) spawned."""
    config = item.config
    run = config.stash[SHARED_KEY]
    spec = _spec(
        config,
        item.nodeid,
        args,
        nodeid=item.nodeid,
        params=_identity.bindings(item),
        executions=executions,
        then=list(then),
        fork_each=template,
    )
    env = {**run.environ, **env}
    holder = config.stash.get(ZYGOTE_KEY, None)
    if holder is not None and not fresh:
        forked = holder.fork(config, spec, env)
        if forked is not None:
            return forked
    if spec.fork_each and (fresh or holder is None or holder.off):
        # The forkserver is off: every test spawns, this one alone in its child.
        spec = dataclasses.replace(spec, fork_each=False, then=[])
    return _runner.ChildProcess(spec, env=env)


def private_cache_dir(cache: Any, name: str = "spawnrun-pycache") -> tuple[Path | None, str]:
    """The directory ``name`` in pytest's ``cache`` (children's bytecode by default, JAX's
    compilations), and what makes it unsafe ("": it is a real directory of this user
    that nobody else may write; None: none could be made)."""
    try:
        directory = cache.mkdir(name)
    except OSError:
        return None, ""
    return directory, _ledger.not_private(directory)


def pycache_dir(config: pytest.Config) -> str:
    """Where children keep their bytecode: pytest's cache, else this run's temp dir.

    Bytecode is code every child runs: the cache's directory is used only if it is a
    real directory of this user that nobody else may write (a link, another owner or
    write access for others could plant code), as the ledger's directory is checked
    (``_ledger.not_private``).
    """
    cache = getattr(config, "cache", None)
    if cache is not None:
        directory, problem = private_cache_dir(cache)
        if directory is not None and not problem:
            return str(directory)
        if directory is not None:
            config.issue_config_time_warning(
                pytest.PytestWarning(
                    f"spawnrun: not keeping children's bytecode in {directory}: it {problem}; "
                    "this run's own temporary directory is used instead"
                ),
                stacklevel=2,
            )
    directory = _options.parent_basetemp(config) / "spawnrun" / "pycache"
    directory.mkdir(parents=True, exist_ok=True)
    return str(directory)
