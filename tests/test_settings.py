"""Settings resolution and the option table, without processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from spawnrun import _settings


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
    ):
        self.ini = ini or {}
        self.cli = cli or {}
        self.pluginmanager = FakePluginManager(plugins or set())

    def getini(self, name: str) -> object:
        return self.ini.get(name)

    def getoption(self, name: str, default: object = None) -> object:
        return self.cli.get(name.removeprefix("spawnrun_"), default)


def resolve(ini=None, cli=None, env=None, plugins=None) -> _settings.Settings:
    return _settings.resolve(FakeConfig(ini, cli, plugins), env or {})  # type: ignore[arg-type]


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
        _settings.parse_marker(value, "ini option 'spawn_marker'")


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
    for s in _settings.SETTINGS:
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
    # The row for the marker's name reaches the README's configuration table too.
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ")]
    for s in _settings.SETTINGS:
        names = [f"`{n}`" for n in (s.cli, s.ini, s.env) if n]
        names += [f"`{s.marker_kwarg}=`"] if s.marker_kwarg else []
        assert any(all(n in row for n in names) for row in rows), s.name


@pytest.mark.parametrize(
    "cpus, free_gib, expected",
    [(2, 20, 1), (1, 20, 1), (16, 100, 8), (64, 100, 8), (8, 100, 4), (16, 4, 2), (8, 1, 0)],
)
def test_default_lookahead_follows_cpus_and_memory(cpus, free_gib, expected):
    assert _settings.default_lookahead(cpus, free_gib * 2**30) == expected


@pytest.mark.parametrize("value", ["inf", "1e9", float("inf"), 1e12])
def test_huge_timeouts_mean_no_limit(value):
    # A deadline that far would overflow the event loop's waits (OverflowError).
    assert _settings.parse_timeout(value, "test") is None
