"""Configuration: one table of settings, resolved once per run into a frozen ``Settings``.

Runs in the parent. Precedence: default < ini < environment < command line < marker.
CLI help, ini help and the marker's doc line are all generated from ``SETTINGS`` so
they cannot drift apart. Every validator names where a bad value came from.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from spawnrun.config._parse import FORKED
from spawnrun.config._parse import parse_bool
from spawnrun.config._parse import parse_bool_strict
from spawnrun.config._parse import parse_capacity
from spawnrun.config._parse import parse_count
from spawnrun.config._parse import parse_group
from spawnrun.config._parse import parse_jobs
from spawnrun.config._parse import parse_lookahead
from spawnrun.config._parse import parse_marker
from spawnrun.config._parse import parse_memory
from spawnrun.config._parse import parse_method
from spawnrun.config._parse import parse_modules
from spawnrun.config._parse import parse_pack
from spawnrun.config._parse import parse_per_gpu
from spawnrun.config._parse import parse_poison
from spawnrun.config._parse import parse_pycache
from spawnrun.config._parse import parse_scope
from spawnrun.config._parse import parse_template
from spawnrun.config._parse import parse_timeout
from spawnrun.devices import _inventory
from spawnrun.devices import _vendors


@dataclass(frozen=True)
class Setting:
    name: str
    cli: str | None
    ini: str | None
    env: str | None
    marker_kwarg: str | None
    default: Any
    parse: Callable[[object, str], Any]
    help: str
    #: How the value reads in help texts and the marker doc line.
    metavar: str = ""
    #: The reference table's first column: what the setting is, in a few words.
    title: str = ""
    #: The reference table's default, where the value itself does not say it (auto, None).
    default_doc: str = ""

    @property
    def dest(self) -> str:
        # Prefixed: other plugins own plain names such as "timeout" (pytest-timeout).
        return f"spawnrun_{self.name}"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        name="marker",
        cli="--spawn-marker",
        ini="spawn_marker",
        env="SPAWNRUN_MARKER",
        marker_kwarg=None,
        default="gpu",
        parse=parse_marker,
        help="Marker that sends a test to a spawn child (change it when the project has "
        "a gpu marker of its own)",
        metavar="NAME",
        title="the spawn marker's name",
    ),
    Setting(
        name="spawn_gpu",
        cli="--spawn-gpu",
        ini="spawn_gpu",
        env="SPAWNRUN_SPAWN_GPU",
        marker_kwarg=None,
        default=False,
        parse=parse_bool,
        help="Run every collected test in a fresh spawn child, marked or not",
        title="spawn every test",
    ),
    Setting(
        name="no_spawn",
        cli="--no-spawn",
        ini=None,
        env=None,
        marker_kwarg=None,
        default=False,
        parse=parse_bool,
        help="Run every test in-process, spawning nothing (for pdb and breakpoints)",
        title="spawn nothing",
    ),
    Setting(
        name="explain",
        cli="--spawn-explain",
        ini=None,
        env=None,
        marker_kwarg=None,
        default=False,
        parse=parse_bool,
        help="Say, for each selected test, where and how it would run (spawned or not, "
        "devices, budget and its source, why alone, scope or template, whether its child "
        "boots unclaimed), and run nothing",
        title="say where each test would run, run nothing",
    ),
    Setting(
        name="count",
        cli=None,
        ini=None,
        env=None,
        marker_kwarg="count",
        default=1,
        parse=parse_count,
        help="Number of GPUs the test needs (0: isolate without a device)",
        metavar="N",
        title="GPUs the test needs",
    ),
    Setting(
        name="memory",
        cli="--spawn-memory",
        ini="spawn_memory",
        env="SPAWNRUN_MEMORY",
        marker_kwarg="memory",
        default=None,
        parse=parse_memory,
        help="GPU memory the test needs on each of its devices (e.g. 6GiB): tests with "
        "budgets share a device within its memory",
        metavar="SIZE",
        title="GPU memory the test needs on each of its devices (its budget)",
        default_doc="none: alone on its devices",
    ),
    Setting(
        name="exclusive",
        cli=None,
        ini=None,
        env=None,
        marker_kwarg="exclusive",
        default=False,
        parse=parse_bool_strict,
        help="Run alone on its devices, whatever budgets allow",
        title="run alone on its devices, whatever budgets allow",
        default_doc="False",
    ),
    Setting(
        name="timeout",
        cli="--spawn-timeout",
        ini="spawn_timeout",
        env="SPAWNRUN_TIMEOUT",
        marker_kwarg="timeout",
        default=None,
        parse=parse_timeout,
        help="Seconds a spawned test may run before its stacks are dumped and it is "
        "killed (0 or none: no limit)",
        metavar="SECONDS",
        title="timeout (s; 0/none/inf: no limit)",
    ),
    Setting(
        name="gpus",
        cli="--spawn-gpus",
        ini="spawn_gpus",
        env="SPAWNRUN_GPUS",
        marker_kwarg=None,
        default="auto",
        parse=_inventory.parse_gpus,
        help="GPUs to hand out: auto (CUDA_VISIBLE_DEVICES, NVML, nvidia-smi), none, "
        "a count, or ids such as 0,1,3 (device 0 alone: 0,)",
        metavar="GPUS",
        title="GPUs to hand out",
    ),
    Setting(
        name="gpu_vendor",
        cli="--spawn-gpu-vendor",
        ini="spawn_gpu_vendor",
        env="SPAWNRUN_GPU_VENDOR",
        marker_kwarg=None,
        default="auto",
        parse=_vendors.parse_vendor,
        help="Whose accelerators to hand out and which variable pins them: auto (an outer "
        "visibility variable, else the first vendor whose NVML or tool is found), nvidia, "
        "amd, intel or ascend",
        metavar="VENDOR",
        title="whose accelerators, and which variable pins them "
        "(see [Vendors](gpu-scheduling.md#vendors))",
    ),
    Setting(
        name="jobs",
        cli="--spawn-jobs",
        ini="spawn_jobs",
        env="SPAWNRUN_JOBS",
        marker_kwarg=None,
        default=None,
        parse=parse_jobs,
        help="Most spawned tests at once (auto: every GPU filled to its cap, at most one per "
        "core, at least one per GPU; without GPUs one per core, at most 8; 1 under xdist)",
        metavar="N",
        title="children at once",
        default_doc="every GPU filled to its cap, at most one per core, at least one per GPU; "
        "without GPUs one per core, at most 8 (1 under xdist)",
    ),
    Setting(
        name="method",
        cli="--spawn-method",
        ini="spawn_method",
        env="SPAWNRUN_METHOD",
        marker_kwarg=None,
        default="spawn",
        parse=parse_method,
        help="How children start: spawn (a fresh interpreter each) or forkserver (forked "
        "from a template that imported spawn_preload, guarded against CUDA)",
        metavar="METHOD",
        title="start method",
    ),
    Setting(
        name="preload",
        cli="--spawn-preload",
        ini="spawn_preload",
        env="SPAWNRUN_PRELOAD",
        marker_kwarg=None,
        default=(),
        parse=parse_modules,
        help="Modules the forkserver template imports first, e.g. torch transformers",
        metavar="MODULES",
        title="modules the zygote must preload",
        default_doc="none (libraries are preloaded automatically)",
    ),
    Setting(
        name="lookahead",
        cli="--spawn-lookahead",
        ini="spawn_lookahead",
        env="SPAWNRUN_LOOKAHEAD",
        marker_kwarg=None,
        default=None,
        parse=parse_lookahead,
        help="Children booted ahead for the next spawned tests (auto: from CPUs and "
        "memory; 0: none)",
        metavar="N",
        title="children booted ahead",
        default_doc="CPUs/2, 1 to 8, one per 2 GiB free",
    ),
    Setting(
        name="pack",
        cli="--spawn-pack",
        ini="spawn_pack",
        env="SPAWNRUN_PACK",
        marker_kwarg=None,
        default="auto",
        parse=parse_pack,
        help="Which tests share a device: off (one per device), declared (those with a "
        "memory budget) or auto (also those whose peak an earlier run measured, and on a "
        "first run those --spawn-gpu spawns unmarked, in equal shares; a test that fails "
        "on such a guess runs again alone)",
        metavar="MODE",
        title="which tests share a device",
        default_doc="auto (declared budgets, and peaks earlier runs measured)",
    ),
    Setting(
        name="per_gpu",
        cli="--spawn-per-gpu",
        ini="spawn_per_gpu",
        env="SPAWNRUN_PER_GPU",
        marker_kwarg=None,
        default=None,
        parse=parse_per_gpu,
        help="Most tests at once on one device (auto: cores per GPU, 2 to 8)",
        metavar="N",
        title="tests at once on one GPU",
        default_doc="cores per GPU, 2 to 8",
    ),
    Setting(
        name="gpu_memory",
        cli="--spawn-gpu-memory",
        ini="spawn_gpu_memory",
        env="SPAWNRUN_GPU_MEMORY",
        marker_kwarg=None,
        default=None,
        parse=parse_capacity,
        help="Memory of each device where NVML cannot tell, and at most what NVML says "
        "(e.g. 80GiB; auto: NVML's)",
        metavar="SIZE",
        title="memory of each GPU",
        default_doc="NVML's (at most this when both)",
    ),
    Setting(
        name="scope",
        cli="--spawn-scope",
        ini="spawn_scope",
        env="SPAWNRUN_SCOPE",
        marker_kwarg="scope",
        default="test",
        parse=parse_scope,
        help="Tests one child runs: test (a fresh child each), class or module (one child "
        "per class or module, its fixtures shared as in-process)",
        metavar="SCOPE",
        title="tests one child runs, in order, sharing their fixtures",
        default_doc="test (a fresh child each)",
    ),
    Setting(
        name="group",
        cli=None,
        ini=None,
        env=None,
        marker_kwarg="group",
        default=None,
        parse=parse_group,
        help="Tests with the same group run in one child, wherever they are collected",
        title="tests that share one child wherever they are collected",
    ),
    Setting(
        name="poison",
        cli=None,
        ini="spawn_poison",
        env=None,
        marker_kwarg=None,
        default=(),
        parse=parse_poison,
        help="Regular expressions, one per line, for failures after which a scope's child "
        "is replaced (besides the built-in sticky CUDA, cuBLAS, cuDNN and NCCL errors)",
        title="failures after which a scope's child is replaced "
        "(regular expressions, one per line)",
        default_doc="the built-in sticky CUDA, cuBLAS, cuDNN and NCCL errors",
    ),
    Setting(
        name="scope_memory",
        cli="--spawn-scope-memory",
        ini="spawn_scope_memory",
        env="SPAWNRUN_SCOPE_MEMORY",
        marker_kwarg=None,
        default=None,
        parse=parse_memory,
        help="A scope's child that still holds more device memory than this after a test "
        "(torch's allocated memory, or NVML's figure for its processes) is replaced "
        "(none: never)",
        metavar="SIZE",
        title="a scope's child holding more device memory than this after a test is replaced",
        default_doc="none (never)",
    ),
    Setting(
        name="pycache",
        cli="--spawn-pycache",
        ini="spawn_pycache",
        env="SPAWNRUN_PYCACHE",
        marker_kwarg=None,
        default="auto",
        parse=parse_pycache,
        help="Where bytecode may not be written (PYTHONDONTWRITEBYTECODE, -B), auto lets "
        "children keep what they compile while booting in pytest's cache, so the next one "
        "loads it instead of compiling torch again; off: compile in every child",
        metavar="MODE",
        title="children keep compiled bytecode where writing it is off (`PYTHONDONTWRITEBYTECODE`)",
    ),
    Setting(
        name="template",
        cli="--spawn-template",
        ini="spawn_template",
        env="SPAWNRUN_TEMPLATE",
        marker_kwarg=None,
        default="file",
        parse=parse_template,
        help="What fast mode forks a test from: file (a process that collected its file, "
        "where that left it fork-safe; else as library), run (a process that collected its "
        "share of the run's files: a fork has imported them all, as in-process) or library "
        "(a process that imported only libraries: each child collects its file)",
        metavar="FROM",
        title="what fast mode forks a test from",
    ),
    Setting(
        name="settle",
        cli="--spawn-settle",
        ini="spawn_settle",
        env="SPAWNRUN_SETTLE",
        marker_kwarg=None,
        default=5.0,
        parse=parse_timeout,
        help="Seconds to wait at most, after a GPU test's child exits, for NVML to "
        "report its device memory freed (0: do not wait)",
        metavar="SECONDS",
        title="wait for freed device memory (s)",
    ),
)

MARKER_KWARGS = tuple(s.marker_kwarg for s in SETTINGS if s.marker_kwarg)


def marker_doc(marker: str) -> str:
    kwargs = ", ".join(f"{s.marker_kwarg}={s.default!r}" for s in SETTINGS if s.marker_kwarg)
    details = "; ".join(f"{s.marker_kwarg}: {s.help}" for s in SETTINGS if s.marker_kwarg)
    return f"{marker}({kwargs}): run the test in a fresh spawn child process (spawnrun); {details}"


def forked_doc(marker: str) -> str:
    return (
        f"{FORKED}: run the test in a fresh spawn child process without a device, "
        f"as {marker}(count=0) (spawnrun, standing in for pytest-forked)"
    )


def _default_text(s: Setting) -> str:
    if s.default_doc:
        return s.default_doc
    if isinstance(s.default, bool):
        return str(s.default).lower()
    if s.default is None or s.default == ():
        return "none"
    if isinstance(s.default, float) and s.default.is_integer():
        return str(int(s.default))
    return str(s.default)


def reference_table() -> str:
    """The configuration reference as a Markdown table, one row per setting.

    docs/configuration.md holds this between its settings-table markers
    (``python docs/gen_reference.py`` rewrites it; a test checks that they agree),
    as ``--help`` holds the same help texts.
    """

    def cell(text: str | None, code: str = "{}") -> str:
        return code.format(text).replace("|", "\\|") if text else ""

    rows = [
        "| setting | marker kwarg | CLI | ini | env | default | what it does |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        cells = (
            cell(s.title),
            cell(s.marker_kwarg, "`{}=`"),
            cell(s.cli, "`{}`"),
            cell(s.ini, "`{}`"),
            cell(s.env, "`{}`"),
            cell(_default_text(s)),
            cell(s.help),
        )
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("spawnrun", "run tests in fresh spawn children")
    for s in SETTINGS:
        if s.cli is not None:
            if s.parse is parse_bool:
                group.addoption(s.cli, action="store_true", default=None, dest=s.dest, help=s.help)
            else:
                group.addoption(
                    s.cli,
                    action="store",
                    default=None,
                    dest=s.dest,
                    metavar=s.metavar,
                    help=s.help,
                )
        if s.ini is not None:
            parser.addini(s.ini, help=s.help, default=None)


@dataclass(frozen=True)
class Settings:
    marker: str
    spawn_gpu: bool
    no_spawn: bool
    count: int
    timeout: float | None
    gpus: str
    jobs: int | None
    method: str
    preload: tuple[str, ...]
    lookahead: int | None
    settle: float | None
    memory: int | None = None
    exclusive: bool = False
    pack: str = "auto"
    per_gpu: int | None = None
    gpu_memory: int | None = None
    gpu_vendor: str = "auto"
    pycache: str = "auto"
    template: str = "file"
    scope: str = "test"
    group: str | None = None
    poison: tuple[str, ...] = ()
    scope_memory: int | None = None
    explain: bool = False
    #: Why spawning is off although it was not asked for (e.g. --pdb), or "".
    forced_inprocess: str = ""
    #: Whether ``@pytest.mark.forked`` spawns (pytest-forked is not there to own it).
    forked_alias: bool = False

    def runs_children(self, getoption: Callable[..., Any]) -> bool:
        """Whether this run may run a test in a child: not where it runs them in-process,
        nor where pytest only lists or prints (``getoption``: the config's, or the early
        view's before the command line is parsed in full)."""
        if self.no_spawn or self.forced_inprocess or self.explain:
            return False
        return not any(getoption(name, False) for name in NOTHING_RUNS)


#: Options under which pytest runs no test (``--setup-plan`` runs children: they show
#: the fixtures they would set up).
NOTHING_RUNS = (
    "help",
    "version",
    "collectonly",
    "markers",
    "showfixtures",
    "show_fixtures_per_test",
)


def xdist_controller(
    getoption: Callable[..., Any], environ: Mapping[str, str] = os.environ
) -> bool:
    """Whether this process is an xdist controller: its workers run the tests, it runs
    none itself. ``-n`` is read too: xdist sets ``--dist`` from it only when it starts."""
    if environ.get("PYTEST_XDIST_WORKER"):
        return False
    dist = getoption("dist", "no")
    return dist not in (None, "no") or bool(getoption("numprocesses", 0))


def _value(s: Setting, config: pytest.Config, environ: Mapping[str, str]) -> Any:
    value = s.default
    if s.ini is not None:
        raw = config.getini(s.ini)
        if raw not in (None, "", []):
            value = s.parse(raw, f"ini option {s.ini!r}")
    if s.env is not None and environ.get(s.env, "") != "":
        value = s.parse(environ[s.env], f"environment variable {s.env}")
    if s.cli is not None:
        raw = config.getoption(s.dest)
        if raw is not None:
            value = s.parse(raw, f"command line option {s.cli}")
    return value


def marker_name(config: pytest.Config, environ: Mapping[str, str] | None = None) -> str:
    """The spawn marker's name alone (a child needs it to register the marker)."""
    by_name = {s.name: s for s in SETTINGS}
    name: str = _value(by_name["marker"], config, os.environ if environ is None else environ)
    return name


def forked_alias(config: pytest.Config, marker: str) -> bool:
    """Whether ``forked`` is free to stand for spawning: pytest-forked is not loaded.

    pytest-forked registers itself as ``pytest_forked`` (its entry point); ``forked``
    covers a ``-p forked`` spelling of a local copy.
    """
    if marker == FORKED:
        return False
    return not any(config.pluginmanager.hasplugin(n) for n in ("pytest_forked", FORKED))


def resolve(config: pytest.Config, environ: Mapping[str, str] | None = None) -> Settings:
    """Resolve every setting once: default < ini < environment < command line."""
    environ = os.environ if environ is None else environ
    values = {s.name: _value(s, config, environ) for s in SETTINGS}
    # --no-spawn over an ini or environment spawn_gpu is the debugging escape hatch and
    # wins. Both as options: the one given where pytest gives precedence wins (addopts
    # are options too); both in one place is a contradiction.
    if config.getoption("spawnrun_spawn_gpu") and config.getoption("spawnrun_no_spawn"):
        if _switch_given_last(config, environ) == "--spawn-gpu":
            values["no_spawn"] = False
    forced = ""
    for opt, flag in (("usepdb", "--pdb"), ("trace", "--trace")):
        if config.getoption(opt, False):
            forced = (
                f"spawnrun: {flag} given, so every test runs in-process: "
                "a debugger can only stop a test that runs in this process"
            )
            break
    alias = forked_alias(config, values["marker"])
    return Settings(forced_inprocess=forced, forked_alias=alias, **values)


def _option_sources(config: pytest.Config, environ: Mapping[str, str]) -> list[tuple[str, Any]]:
    """Where pytest's options come from, in the order pytest joins them (the last wins)."""
    try:
        env = shlex.split(environ.get("PYTEST_ADDOPTS", ""))
    except ValueError:  # pytest read it already; unreadable here means not there
        env = []
    return [
        ("the ini option addopts", config.getini("addopts") or []),
        ("PYTEST_ADDOPTS", env),
        ("the command line", config.invocation_params.args),
    ]


def _switch_given_last(config: pytest.Config, environ: Mapping[str, str]) -> str:
    """Of --spawn-gpu and --no-spawn, both set, the one given at the highest level."""
    for source, args in reversed(_option_sources(config, environ)):
        args = [str(a) for a in args]
        options = args[: args.index("--")] if "--" in args else args
        given = [s for s in ("--spawn-gpu", "--no-spawn") if s in options]
        if len(given) == 2:
            raise pytest.UsageError(
                f"--spawn-gpu and --no-spawn cannot be used together (both in {source})"
            )
        if given:
            return given[0]
    # Set some other way (an @file of arguments, a plugin): nothing says which wins.
    raise pytest.UsageError("--spawn-gpu and --no-spawn cannot be used together")


def source_of(config: pytest.Config, name: str, environ: Mapping[str, str] | None = None) -> str:
    """Where the value of setting ``name`` came from, as its errors name it."""
    environ = os.environ if environ is None else environ
    s = {s.name: s for s in SETTINGS}[name]
    if s.cli is not None and config.getoption(s.dest) is not None:
        return f"command line option {s.cli}"
    if s.env is not None and environ.get(s.env, "") != "":
        return f"environment variable {s.env}"
    if s.ini is not None and config.getini(s.ini) not in (None, "", []):
        return f"ini option {s.ini!r}"
    return "the default"


def marked(item: pytest.Item, settings: Settings) -> bool:
    """Whether the test carries the spawn marker (or ``forked``, standing in for it).

    Under ``--spawn-gpu`` every test is spawned: ``forked`` then stands in for nothing,
    and its tests are planned as unmarked ones (seeing what the parent sees, as under
    pytest-forked), so they share a scope's child with them.
    """
    if item.get_closest_marker(settings.marker) is not None:
        return True
    if settings.spawn_gpu:
        return False
    return settings.forked_alias and item.get_closest_marker(FORKED) is not None


#: Appended to errors about the marker's shape: the name may be the project's own.
OWN_MARKER_HINT = (
    "if this marker is your project's own, set spawn_marker (ini) or SPAWNRUN_MARKER "
    "to another name for spawnrun's"
)


def marker_overrides(item: pytest.Item, settings: Settings) -> dict[str, Any]:
    """Validated keyword arguments of the closest spawn marker (empty if none)."""
    mark = item.get_closest_marker(settings.marker)
    if mark is None:
        if marked(item, settings):
            return {"count": 0}  # forked: isolate, no device
        return {}
    source = f"{item.nodeid}: @pytest.mark.{settings.marker}"
    if mark.args:
        raise pytest.UsageError(
            f"{source}: takes keyword arguments only "
            f"({', '.join(MARKER_KWARGS)}), got positional {mark.args!r}; {OWN_MARKER_HINT}"
        )
    unknown = sorted(set(mark.kwargs) - set(MARKER_KWARGS))
    if unknown:
        raise pytest.UsageError(
            f"{source}: unknown keyword argument(s) {', '.join(unknown)}; "
            f"known: {', '.join(MARKER_KWARGS)}; {OWN_MARKER_HINT}"
        )
    by_kwarg = {s.marker_kwarg: s for s in SETTINGS if s.marker_kwarg}
    overrides = {
        by_kwarg[k].name: by_kwarg[k].parse(v, f"{source}({k}={v!r})")
        for k, v in mark.kwargs.items()
    }
    if overrides.get("exclusive") and overrides.get("memory") is not None:
        raise pytest.UsageError(
            f"{source}: memory= and exclusive=True contradict each other (a budget is "
            "for sharing a device; exclusive runs alone): give one"
        )
    return overrides
