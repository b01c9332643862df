"""A run's children share JAX's persistent compilation cache (``_jaxcache``, the
``jax_cache`` setting), with a stand-in ``jax`` package that records what its config is
told. What a test sees must be the same spawned and forked, and whether JAX was imported
before the child started (a conftest a template loaded) or by the test."""

from __future__ import annotations

import json
import os

import pytest

from spawnrun.launch import _starting

STANDIN = """
class _Config:
    def __init__(self):
        self.jax_compilation_cache_dir = None
        self.jax_persistent_cache_min_compile_time_secs = 1.0

    def update(self, name, value):
        setattr(self, name, value)


config = _Config()
"""

SUITE = """
import json, os, pytest

@pytest.mark.gpu(count=0)
@pytest.mark.parametrize("i", range(2))
def test_sees(i):
    import jax
    with open(f"seen-{i}.json", "w") as f:
        json.dump({
            "dir": jax.config.jax_compilation_cache_dir,
            "min": jax.config.jax_persistent_cache_min_compile_time_secs,
        }, f)
"""


def _seen(pytester: pytest.Pytester) -> list[dict]:
    return [json.loads((pytester.path / f"seen-{i}.json").read_text()) for i in range(2)]


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("imported", ["by-the-test", "by-the-conftest"])
def test_children_share_one_compilation_cache_of_the_run(pytester, method, imported):
    pytester.mkpydir("jax").joinpath("__init__.py").write_text(STANDIN)
    pytester.makepyfile(test_jax=SUITE)
    if imported == "by-the-conftest":
        pytester.makeconftest("import jax\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--spawn-method", method)
    result.assert_outcomes(passed=2)
    seen = _seen(pytester)
    assert seen[0]["dir"] and seen[0]["dir"] == seen[1]["dir"], seen
    assert seen[0]["dir"].endswith("jax-cache") and "spawnrun" in seen[0]["dir"]
    assert [s["min"] for s in seen] == [0.0, 0.0]


@pytest.mark.parametrize(
    "how", ["setting-off", "environment-names-a-cache", "environment-sets-the-minimum"]
)
def test_a_cache_the_user_chose_is_left_alone(pytester, monkeypatch, how):
    pytester.mkpydir("jax").joinpath("__init__.py").write_text(STANDIN)
    pytester.makepyfile(test_jax=SUITE)
    args = ["-p", "no:cacheprovider", "--spawn-method", "forkserver"]
    if how == "setting-off":
        args += ["--spawn-jax-cache", "off"]
    elif how == "environment-names-a-cache":
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(pytester.path / "mine"))
    else:
        monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "2")
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=2)
    seen = _seen(pytester)
    if how == "environment-sets-the-minimum":
        # The stand-in reads no environment: JAX itself would take the 2 s from it.
        assert seen[0]["dir"] and [s["min"] for s in seen] == [1.0, 1.0], seen
    else:
        assert seen == [{"dir": None, "min": 1.0}] * 2, seen


def test_a_bad_jax_cache_value_is_a_usage_error(pytester):
    pytester.makepyfile(test_jax=SUITE)
    result = pytester.runpytest_subprocess("--spawn-jax-cache", "always")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--spawn-jax-cache: expected auto, run or off, got 'always'*"])


KEEPS = """
import os, pytest

@pytest.mark.gpu(count=0)
def test_compiles():
    import jax
    directory = jax.config.jax_compilation_cache_dir
    with open("seen.txt", "a") as f:
        f.write(directory + " " + " ".join(sorted(os.listdir(directory))) + "\\n")
    open(os.path.join(directory, "entry-" + os.environ["RUN"]), "w").close()
"""


def test_with_pytests_cache_the_compilations_are_kept_for_the_next_run(pytester, monkeypatch):
    pytester.mkpydir("jax").joinpath("__init__.py").write_text(STANDIN)
    pytester.makepyfile(test_keeps=KEEPS)
    for run in ("1", "2"):
        monkeypatch.setenv("RUN", run)
        result = pytester.runpytest_subprocess("--spawn-method", "forkserver")
        result.assert_outcomes(passed=1)
    first, second = (pytester.path / "seen.txt").read_text().splitlines()
    kept = str(pytester.path / ".pytest_cache" / "d" / "spawnrun-jax-cache")
    assert first == f"{kept} ", first
    assert second == f"{kept} entry-1", second  # what the first run compiled


def test_a_kept_cache_past_its_limit_loses_its_oldest_entries(tmp_path):
    for age, name in enumerate(["old", "older", "newer", "new"][::-1]):
        path = tmp_path / name
        path.write_bytes(b"x" * 400)
        os.utime(path, (1000 - age, 1000 - age))
    _starting.prune(tmp_path, 2000)  # 1600 bytes: under the limit, nothing goes
    assert len(list(tmp_path.iterdir())) == 4
    _starting.prune(tmp_path, 1000)  # over it: the oldest go until half of it is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]
