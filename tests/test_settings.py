"""Settings resolution and the option table, without processes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from spawnrun.config import _parse
from spawnrun.config import _settings
from spawnrun.config import _table
from spawnrun.devices import _inventory


class FakePluginManager:
    def __init__(self, plugins: set[str]) -> None:
        self.plugins = plugins

    def hasplugin(self, name: str) -> bool:
        return name in self.plugins


class FakeConfig:
    def __init__(
        self,
        ini: dict[str, str] | None = None,
        cli: dict[str, object] | None = None,
        plugins: set[str] | None = None,
        argv: list[str] | None = None,
    ):
        self.ini = ini or {}
        self.cli = cli or {}
        self.pluginmanager = FakePluginManager(plugins or set())
        #: What was typed: cli holds it merged with addopts, as config.getoption does.
        self.invocation_params = SimpleNamespace(args=tuple(argv or ()))

    def getini(self, name: str) -> object:
        return self.ini.get(name)

    def getoption(self, name: str, default: object = None) -> object:
        return self.cli.get(name.removeprefix("spawnrun_"), default)


def resolve(ini=None, cli=None, env=None, plugins=None, argv=None) -> _settings.Settings:
    config = FakeConfig(ini, cli, plugins, argv)
    return _settings.resolve(config, env or {})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "ini, env, cli, expected",
    [
        ({}, {}, {}, None),
        ({"spawn_timeout": "10"}, {}, {}, 10.0),
        ({"spawn_timeout": "10"}, {"SPAWNRUN_TIMEOUT": "20"}, {}, 20.0),
        ({"spawn_timeout": "10"}, {"SPAWNRUN_TIMEOUT": "20"}, {"timeout": "30"}, 30.0),
        ({"spawn_timeout": "10"}, {"SPAWNRUN_TIMEOUT": "none"}, {}, None),
        ({"spawn_timeout": "10"}, {}, {"timeout": "0"}, None),
    ],
)
def test_timeout_precedence(ini, env, cli, expected):
    assert resolve(ini, cli, env).timeout == expected


def test_an_empty_environment_value_counts_as_unset_as_documented():
    """docs/guide/configuration.md, Precedence: an empty value leaves the setting where the
    lower places put it (an empty CI matrix entry), never an empty setting."""
    assert resolve({"spawn_timeout": "10"}, {}, {"SPAWNRUN_TIMEOUT": ""}).timeout == 10.0
    assert resolve(env={"SPAWNRUN_GPUS": ""}).gpus == resolve().gpus
    assert (
        "An environment\nvariable or ini option set to an empty value counts as unset"
        in (Path(__file__).parent.parent / "docs" / "guide" / "configuration.md").read_text()
    )


def test_fast_mode_settings_without_fast_mode_say_they_do_nothing(pytester):
    pytester.makepyfile("import pytest\n\n@pytest.mark.gpu(count=0)\ndef test_x():\n    pass\n")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-template", "run", "-W", "default"
    )
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        ["*command line option --spawn-template does nothing here: it is read in fast mode*"]
    )
    fast = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-template", "run", "--spawn-method", "forkserver"
    )
    fast.assert_outcomes(passed=1)
    fast.stdout.no_fnmatch_line("*does nothing here*")


def test_spawn_gpu_from_each_source():
    assert resolve(ini={"spawn_gpu": "true"}).spawn_gpu is True
    assert resolve(env={"SPAWNRUN_SPAWN_GPU": "1"}).spawn_gpu is True
    assert resolve(cli={"spawn_gpu": True}).spawn_gpu is True
    assert resolve().spawn_gpu is False


@pytest.mark.parametrize(
    "ini, env, cli, message",
    [
        ({"spawn_timeout": "soon"}, {}, {}, "ini option 'spawn_timeout': expected seconds*"),
        (
            {},
            {"SPAWNRUN_TIMEOUT": "-3"},
            {},
            "environment variable SPAWNRUN_TIMEOUT: seconds must be >= 0*",
        ),
        ({}, {}, {"timeout": "nan"}, "command line option --spawn-timeout: seconds must be >= 0*"),
        ({"spawn_gpu": "maybe"}, {}, {}, "ini option 'spawn_gpu': expected a boolean*"),
        (
            {},
            {"SPAWNRUN_PYCACHE": "on"},
            {},
            "environment variable SPAWNRUN_PYCACHE: expected auto or off, got 'on'",
        ),
        ({"spawn_scope": "session"}, {}, {}, "ini option 'spawn_scope': expected test, class*"),
        (
            {},
            {},
            {"template": "module"},
            "command line option --spawn-template: expected file, run or library, got 'module'",
        ),
        (
            {"spawn_poison": "ok\n(unclosed"},
            {},
            {},
            "ini option 'spawn_poison': '(unclosed' is not a regular expression*",
        ),
    ],
)
def test_bad_values_name_their_source(ini, env, cli, message):
    with pytest.raises(pytest.UsageError) as excinfo:
        resolve(ini, cli, env)
    assert excinfo.match(message.replace("*", ".*").replace("(", r"\(").replace("'", "'"))


@pytest.mark.parametrize(
    "ini, env, cli, expected",
    [
        ({}, {}, {}, "gpu"),
        ({"spawn_marker": "isolated"}, {}, {}, "isolated"),
        ({"spawn_marker": "isolated"}, {"SPAWNRUN_MARKER": "spawned"}, {}, "spawned"),
        ({"spawn_marker": "isolated"}, {"SPAWNRUN_MARKER": "spawned"}, {"marker": "x"}, "x"),
    ],
)
def test_marker_name_precedence(ini, env, cli, expected):
    assert resolve(ini, cli, env).marker == expected
    config = FakeConfig(ini, cli)
    assert _settings.marker_name(config, env) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value, message",
    [
        ("not-a-name", "expected a marker name"),
        ("class", "expected a marker name"),
        ("_private", "expected a marker name"),
        ("", "expected a marker name"),
        ("skip", "one of pytest's own markers"),
        ("parametrize", "one of pytest's own markers"),
    ],
)
def test_bad_marker_names(value, message):
    with pytest.raises(pytest.UsageError, match=f"^ini option 'spawn_marker': .*{message}"):
        _parse.parse_marker(value, "ini option 'spawn_marker'")


@pytest.mark.parametrize(
    "plugins, marker, expected",
    [
        (set(), "gpu", True),
        ({"pytest_forked"}, "gpu", False),
        ({"forked"}, "gpu", False),
        (set(), "forked", False),  # forked is the spawn marker itself
    ],
)
def test_forked_stands_in_only_without_pytest_forked(plugins, marker, expected):
    env = {"SPAWNRUN_MARKER": marker}
    assert resolve(env=env, plugins=plugins).forked_alias is expected


def test_pdb_forces_in_process():
    assert "--pdb given" in resolve(cli={"usepdb": True}).forced_inprocess
    assert resolve().forced_inprocess == ""


def test_help_texts_come_from_one_table(pytester):
    result = pytester.runpytest_subprocess("--help")
    text = " ".join(result.stdout.str().split())
    markers = " ".join(pytester.runpytest_subprocess("--markers").stdout.str().split())
    for s in _table.SETTINGS:
        help_text = " ".join(s.help.split())
        assert help_text[0].isupper() and not help_text.endswith(".")
        if s.cli:
            assert s.cli in text and help_text in text
        if s.ini:
            assert f"{s.ini} " in text
        if s.marker_kwarg:
            assert f"{s.marker_kwarg}: {help_text}" in markers
    assert _settings.marker_doc("gpu").split(":")[0] in markers
    assert _settings.forked_doc("gpu").split(":")[0] in markers
    # Each setting's row reaches the documentation's configuration table too.
    page = (Path(__file__).parent.parent / "docs" / "guide" / "configuration.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ")]
    for s in _table.SETTINGS:
        names = [f"`{n}`" for n in (s.cli, s.ini, s.env) if n]
        names += [f"`{s.marker_kwarg}=`"] if s.marker_kwarg else []
        assert any(all(n in row for n in names) for row in rows), s.name


@pytest.mark.parametrize(
    "cpus, free_gib, expected",
    [(2, 20, 1), (1, 20, 1), (16, 100, 8), (64, 100, 8), (8, 100, 4), (16, 4, 2), (8, 1, 0)],
)
def test_default_lookahead_follows_cpus_and_memory(cpus, free_gib, expected):
    assert _parse.default_lookahead(cpus, free_gib * 2**30) == expected


@pytest.mark.parametrize("value", ["inf", "1e9", float("inf"), 1e12])
def test_huge_timeouts_mean_no_limit(value):
    # A deadline that far would overflow the event loop's waits (OverflowError).
    assert _parse.parse_timeout(value, "test") is None


BOTH = {"spawn_gpu": True, "no_spawn": True}


@pytest.mark.parametrize(
    "addopts, env_addopts, argv, spawns",
    [
        # The command line over addopts (ini) and PYTEST_ADDOPTS, as pytest itself orders them.
        ("--spawn-gpu", "", ["--no-spawn"], False),
        ("--no-spawn", "", ["--spawn-gpu", "tests"], True),
        ("", "--spawn-gpu", ["--no-spawn"], False),
        ("", "--no-spawn -q", ["-v", "--spawn-gpu"], True),
        # PYTEST_ADDOPTS over the ini's addopts.
        ("--no-spawn", "--spawn-gpu", [], True),
        ("--spawn-gpu", "--no-spawn", ["-v"], False),
        # After "--" come file names, not options.
        ("--no-spawn", "", ["--spawn-gpu", "--", "--no-spawn"], True),
    ],
)
def test_spawn_switches_from_addopts_yield_to_the_command_line(addopts, env_addopts, argv, spawns):
    ini = {"addopts": addopts.split()} if addopts else {}
    env = {"PYTEST_ADDOPTS": env_addopts} if env_addopts else {}
    settings = resolve(ini=ini, cli=BOTH, env=env, argv=argv)
    assert (settings.spawn_gpu and not settings.no_spawn) is spawns
    assert settings.no_spawn is not spawns


@pytest.mark.parametrize(
    "addopts, env_addopts, argv, where",
    [
        ("", "", ["--spawn-gpu", "--no-spawn"], "both in the command line"),
        ("--spawn-gpu --no-spawn", "", [], "both in the ini option addopts"),
        ("", "--no-spawn --spawn-gpu", [], "both in PYTEST_ADDOPTS"),
        ("--spawn-gpu --no-spawn", "", ["--spawn-gpu", "--no-spawn"], "both in the command line"),
        ("", "", [], "together$"),  # set some other way: nothing says which wins
    ],
)
def test_both_spawn_switches_in_one_place_are_a_usage_error(addopts, env_addopts, argv, where):
    ini = {"addopts": addopts.split()} if addopts else {}
    env = {"PYTEST_ADDOPTS": env_addopts} if env_addopts else {}
    with pytest.raises(pytest.UsageError, match=f"^--spawn-gpu and --no-spawn cannot .*{where}"):
        resolve(ini=ini, cli=BOTH, env=env, argv=argv)


def test_no_spawn_on_the_command_line_wins_over_addopts(pytester):
    pytester.makeini("[pytest]\naddopts = --spawn-gpu\n")
    pytester.makepyfile("import spawnrun\ndef test_x():\n    assert not spawnrun.is_child()\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--no-spawn")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["spawnrun: --no-spawn given, every test runs in-process"])


@pytest.mark.parametrize(
    "value, normal, ids",
    [
        ("0", "0", ()),  # a count: zero devices
        ("0,", "0,", ("0",)),  # device 0 alone
        (" 3 , ", "3,", ("3",)),
        ("0,1,", "0,1", ("0", "1")),
        ("GPU-ab,", "GPU-ab", ("GPU-ab",)),
    ],
)
def test_one_device_id_alone_is_written_with_a_trailing_comma(value, normal, ids):
    assert _inventory.parse_gpus(value, "--spawn-gpus") == normal
    assert _inventory.inventory(normal, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}).ids == ids


@pytest.mark.parametrize("bad", [",", "0,,", ",0", "0,1,,"])
def test_a_comma_without_a_device_is_refused(bad):
    with pytest.raises(pytest.UsageError, match=r"one index alone: 0,\), got"):
        _inventory.parse_gpus(bad, "--spawn-gpus")


def test_source_of_names_where_a_value_came_from():
    def source(ini=None, cli=None, env=None) -> str:
        config = FakeConfig(ini, cli)
        return _settings.source_of(config, "preload", env or {})  # type: ignore[arg-type]

    assert source() == "the default"
    assert source(ini={"spawn_preload": "a"}) == "ini option 'spawn_preload'"
    env = {"SPAWNRUN_PRELOAD": "b"}
    assert source(ini={"spawn_preload": "a"}, env=env) == "environment variable SPAWNRUN_PRELOAD"
    assert source(env=env, cli={"preload": "c"}) == "command line option --spawn-preload"
