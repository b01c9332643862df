"""Configuration: the settings table (``_table``) resolved once per run into a frozen
``Settings``, and the spawn marker's arguments read off each test.

Runs in the parent. Precedence: default < ini < environment < command line < marker.
CLI help, ini help, the marker's doc line and the configuration reference are all
generated here from ``_table.SETTINGS`` so they cannot drift apart. Every validator
names where a bad value came from.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from spawnrun.config import _parse
from spawnrun.config import _table
from spawnrun.config._parse import FORKED


def marker_doc(marker: str) -> str:
    kwargs = ", ".join(f"{s.marker_kwarg}={s.default!r}" for s in _table.SETTINGS if s.marker_kwarg)
    details = "; ".join(f"{s.marker_kwarg}: {s.help}" for s in _table.SETTINGS if s.marker_kwarg)
    return f"{marker}({kwargs}): run the test in a fresh spawn child process (spawnrun); {details}"


def forked_doc(marker: str) -> str:
    return (
        f"{FORKED}: run the test in a fresh spawn child process without a device, "
        f"as {marker}(count=0) (spawnrun, standing in for pytest-forked)"
    )


def register_markers(config: pytest.Config, marker: str, forked_alias: bool) -> None:
    # Only the configured name: a project's own gpu marker stays untouched when
    # spawn_marker names another.
    config.addinivalue_line("markers", marker_doc(marker))
    if forked_alias:
        config.addinivalue_line("markers", forked_doc(marker))


def _default_text(s: _table.Setting) -> str:
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

    docs/guide/configuration.md holds this between its settings-table markers
    (``python docs/gen_reference.py`` rewrites it; a test checks that they agree),
    as ``--help`` holds the same help texts.
    """

    def cell(text: str | None, code: str = "{}") -> str:
        return code.format(text).replace("|", "\\|") if text else ""

    rows = [
        "| setting | marker kwarg | CLI | ini | env | default | what it does |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in _table.SETTINGS:
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
    for s in _table.SETTINGS:
        if s.cli is not None:
            if s.parse is _parse.parse_bool:
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
    jax_cache: str = "auto"
    confirm: str = "rerun"
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


def _value(s: _table.Setting, config: pytest.Config, environ: Mapping[str, str]) -> Any:
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
    by_name = {s.name: s for s in _table.SETTINGS}
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
    values = {s.name: _value(s, config, environ) for s in _table.SETTINGS}
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
    s = {s.name: s for s in _table.SETTINGS}[name]
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
            f"({', '.join(_table.MARKER_KWARGS)}), got positional {mark.args!r}; {OWN_MARKER_HINT}"
        )
    unknown = sorted(set(mark.kwargs) - set(_table.MARKER_KWARGS))
    if unknown:
        raise pytest.UsageError(
            f"{source}: unknown keyword argument(s) {', '.join(unknown)}; "
            f"known: {', '.join(_table.MARKER_KWARGS)}; {OWN_MARKER_HINT}"
        )
    by_kwarg = {s.marker_kwarg: s for s in _table.SETTINGS if s.marker_kwarg}
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
