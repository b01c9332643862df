"""The settings table: one ``Setting`` row per setting, with its command-line option, ini
option, environment variable and marker keyword, its default, its validator and its help.

Runs in the parent. Data only: resolving the table for a run (default < ini <
environment < command line < marker), and the help texts, the marker's doc line and the
reference table rendered from it, are ``_settings``'s. Imports nothing but the
validators (``_parse``, and the device and vendor parsers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spawnrun.config import _parse
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
        parse=_parse.parse_marker,
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
        parse=_parse.parse_bool,
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
        parse=_parse.parse_bool,
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
        parse=_parse.parse_bool,
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
        parse=_parse.parse_count,
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
        parse=_parse.parse_memory,
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
        parse=_parse.parse_bool_strict,
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
        parse=_parse.parse_timeout,
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
        parse=_parse.parse_jobs,
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
        parse=_parse.parse_method,
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
        parse=_parse.parse_modules,
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
        parse=_parse.parse_lookahead,
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
        parse=_parse.parse_pack,
        help="Which tests share a device: off (one per device), declared (those with a "
        "memory budget) or auto (also those whose peak an earlier run measured, and on a "
        "first run those --spawn-gpu spawns unmarked, in equal shares; a test that runs "
        "out of memory on such a guess runs again alone)",
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
        parse=_parse.parse_per_gpu,
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
        parse=_parse.parse_capacity,
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
        parse=_parse.parse_scope,
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
        parse=_parse.parse_group,
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
        parse=_parse.parse_poison,
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
        parse=_parse.parse_memory,
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
        parse=_parse.parse_pycache,
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
        parse=_parse.parse_template,
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
        parse=_parse.parse_timeout,
        help="Seconds to wait at most, after a GPU test's child exits, for NVML to "
        "report its device memory freed (0: do not wait)",
        metavar="SECONDS",
        title="wait for freed device memory (s)",
    ),
    Setting(
        name="jax_cache",
        cli="--spawn-jax-cache",
        ini="spawn_jax_cache",
        env="SPAWNRUN_JAX_CACHE",
        marker_kwarg=None,
        default="auto",
        parse=_parse.parse_jax_cache,
        help="Where children share JAX's persistent compilation cache, so a function one "
        "test compiled is loaded, not compiled again, in the next test's process (not "
        "where JAX_COMPILATION_CACHE_DIR is set): auto, in pytest's cache, kept for the "
        "next run (where the cache provider is off: as run); run, in a directory of the "
        "run's own; off, each child compiles for itself",
        metavar="auto|run|off",
        title="JAX compilations shared by a run's children",
    ),
    Setting(
        name="confirm",
        cli="--spawn-confirm",
        ini="spawn_confirm",
        env="SPAWNRUN_CONFIRM",
        marker_kwarg=None,
        default="rerun",
        parse=_parse.parse_confirm,
        help="What counts for a test whose first run failed where a guess of the run's "
        "may be to blame (out of memory on a guessed budget, an error that names forking "
        "or a death in a fork) and that ran again: rerun, the second run's outcome (both "
        "runs shown); strict, a test that passed only when run again fails",
        metavar="rerun|strict",
        title="a test run again after its first run's failure",
    ),
)

MARKER_KWARGS = tuple(s.marker_kwarg for s in SETTINGS if s.marker_kwarg)
