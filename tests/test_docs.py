"""The documentation: the site builds strictly, its configuration reference is the
settings table's, and every command it shows runs.

Which commands are "shown", the rule the pages follow:

- Pages: README.md and every docs/**/*.md, except the validation record
  (docs/validation/: gpu-validation.md and performance.md). Those record past runs on a
  lent H200 host, with that host's scripts, variables and timings: evidence that the
  .ci/gpu scripts reproduce on a GPU host, not instructions, and nothing this machine can
  run.
- A command is a line that starts with "$ " in a ```console block; the lines after it,
  up to the next "$ ", are its output (shown, not checked). The commands of one block
  run in order in one fresh sample project (pytest-split's durations, then the split
  that reads them; coverage's run, combine and report).
- No other fenced block of those pages holds a pytest command
  (test_pytest_commands_are_shown_as_console), except README's four CI blocks (the
  line after each "<!-- test-command... -->" marker): .ci/run runs those.
- A line is split at "&&", and each part is one of:
  - a pytest run (``pytest``, ``python -m pytest``, ``<venv>/bin/python -m pytest`` or
    ``coverage run -m pytest``, after any ``NAME=value`` assignments): run with this
    interpreter in the sample project. Unless the command says which devices the run
    has (``--spawn-gpus``, ``SPAWNRUN_GPUS=``, ``CUDA_VISIBLE_DEVICES=``), it gets
    ``--spawn-gpus 1``: this machine has no GPU, and a declared one lets the ``gpu``
    test run instead of skipping. It must exit 0 with tests passed (or, for
    ``--spawn-explain``, which runs nothing, exit 0), and print no usage error;
  - ``coverage <command>``: run with this interpreter's coverage;
  - an install step (``python3 -m venv``, ``pip install``): not run, since it needs the
    network and a fresh environment; README's CI commands install the same way, and
    .ci/run runs them;
  - a line of NOT_RUN, which says why this file does not run it.
  Anything else fails: teach this file to run it, or add it to NOT_RUN with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RECORDS = DOCS / "validation"
CI_MARKER = re.compile(r"<!-- test-command(-lowest|-models|-wheel)? -->")

#: Commands the pages show that this file does not run, and why.
NOT_RUN = {
    "bash .ci/run": "CI itself: README's four CI commands in fresh virtual environments",
    "python -m mkdocs serve": (
        "serves the site until stopped; test_site_builds_strictly builds the same site"
    ),
    "python docs/gen_reference.py": (
        "rewrites docs/guide/configuration.md; test_configuration_reference_is_generated "
        "checks that it would change nothing"
    ),
}

#: The sample project's package, which the quick start's test file imports.
MYPKG = "def double(x):\n    return 2 * x\n"
#: What ``coverage run`` needs, as docs/guide/compatibility.md says: parallel mode.
COVERAGERC = "[run]\nparallel = true\n"


def _pages() -> list[Path]:
    docs = sorted(p for p in DOCS.rglob("*.md") if RECORDS not in p.parents)
    return [ROOT / "README.md", *docs]


@dataclass(frozen=True)
class Block:
    page: str
    info: str
    lines: tuple[str, ...]
    #: The line before the opening fence.
    before: str


def _blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file (fences may be indented)."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"\s*(```+)\s*(\S*)", lines[i])
        if not opening:
            i += 1
            continue
        fence, info = opening.groups()
        body = []
        i += 1
        while i < len(lines) and not re.match(rf"\s*{fence}\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        before = ""
        start = i - len(body) - 1
        for k in range(start - 1, -1, -1):
            if lines[k].strip():
                before = lines[k].strip()
                break
        code = textwrap.dedent("\n".join(body)).splitlines()
        blocks.append(Block(path.name, info, tuple(code), before))
        i += 1
    return blocks


def _console_blocks() -> dict[tuple[str, ...], str]:
    """Each distinct console block's commands, and the pages that show it."""
    found: dict[tuple[str, ...], list[str]] = {}
    for path in _pages():
        for block in _blocks(path):
            if block.info != "console":
                continue
            commands = tuple(line[2:].strip() for line in block.lines if line.startswith("$ "))
            if commands:
                found.setdefault(commands, []).append(block.page)
    return {commands: ", ".join(sorted(set(pages))) for commands, pages in found.items()}


CONSOLE = _console_blocks()
ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=")
PYTHON = re.compile(r"(\S*/)?python(3(\.\d+)?)?$")


@dataclass(frozen=True)
class Step:
    kind: str  # "pytest", "coverage", "install" or "not run"
    argv: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def _step(part: str) -> Step:
    """What to do with one command (a part of a line between "&&")."""
    if part in NOT_RUN:
        return Step("not run")
    words = shlex.split(part, comments=True)
    env = []
    while words and ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env.append((name, value))
    if words[:1] == ["pytest"]:
        return Step("pytest", ("-m", "pytest", *words[1:]), tuple(env))
    if len(words) >= 3 and PYTHON.match(words[0]) and words[1:3] == ["-m", "pytest"]:
        return Step("pytest", ("-m", "pytest", *words[3:]), tuple(env))
    if words[:4] == ["coverage", "run", "-m", "pytest"]:
        return Step("pytest", ("-m", "coverage", "run", "-m", "pytest", *words[4:]), tuple(env))
    if words[:1] == ["coverage"] and not env:
        return Step("coverage", ("-m", "coverage", *words[1:]))
    if PYTHON.match(words[0]) and words[1:3] == ["-m", "venv"]:
        return Step("install")
    if re.match(r"(\S*/)?pip3?$", words[0]) and words[1:2] == ["install"]:
        return Step("install")
    raise AssertionError(
        f"tests/test_docs.py does not know how to run {part!r}: teach it, or add it to "
        "NOT_RUN with the reason it is not run"
    )


def _steps(commands: tuple[str, ...]) -> list[Step]:
    return [_step(part.strip()) for line in commands for part in line.split("&&")]


def _sample(path: Path, steps: list[Step]) -> None:
    """The quick start's test file, the package it tests, and what the commands name."""
    quick = [
        b
        for b in _blocks(ROOT / "README.md")
        if b.info == "python" and b.lines[:1] == ("# test_sample.py",)
    ]
    assert len(quick) == 1, "README.md's quick start shows test_sample.py once"
    (path / "test_sample.py").write_text("\n".join(quick[0].lines) + "\n")
    (path / "mypkg").mkdir()
    (path / "mypkg" / "__init__.py").write_text(MYPKG)
    (path / ".coveragerc").write_text(COVERAGERC)
    if any("examples" in step.argv for step in steps):
        # The demo suite, as the README runs it from the repository's root.
        shutil.copytree(
            ROOT / "examples",
            path / "examples",
            ignore=shutil.ignore_patterns("models", "__pycache__"),
        )


def _devices_given(step: Step) -> bool:
    names = {name for name, _ in step.env}
    return "--spawn-gpus" in step.argv or bool(names & {"SPAWNRUN_GPUS", "CUDA_VISIBLE_DEVICES"})


def _environment() -> dict[str, str]:
    """This suite's environment, less what would change what the commands mean (devices
    that tests/conftest.py declares, options, xdist's worker variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPAWNRUN_", "PYTEST_"))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    # The test extra installs hypothesis for this project's own suite; its pytest plugin
    # costs about a second in every pytest process here (the parent and each child), and
    # the sample project has no use for it.
    env["PYTEST_ADDOPTS"] = "-p no:hypothesispytest"
    return env


def _run_block(commands: tuple[str, ...], path: Path, environ: dict[str, str]) -> list[str]:
    """Run a block's commands in order; what went wrong, as messages (none: all ran)."""
    steps = _steps(commands)
    _sample(path, steps)
    # Each run's temporary directories stay in its own sample project.
    (path / "tmp").mkdir()
    base = {**environ, "PYTEST_DEBUG_TEMPROOT": str(path / "tmp")}
    for step in steps:
        if step.kind not in ("pytest", "coverage"):
            continue
        argv = list(step.argv)
        if step.kind == "pytest" and not _devices_given(step):
            argv += ["--spawn-gpus", "1"]
        env = {**base, **dict(step.env)}
        try:
            done = subprocess.run(
                [sys.executable, *argv],
                cwd=path,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
        except subprocess.TimeoutExpired as exc:
            return [f"{' '.join(argv)} ran past 120 s:\n{exc.stdout}{exc.stderr}"]
        output = done.stdout + done.stderr
        shown = " ".join(["python", *argv])
        problems = []
        if done.returncode != 0:
            problems.append(f"{shown} exited {done.returncode}")
        problems += [f"{shown} printed {bad!r}" for bad in BAD_OUTPUT if bad in output]
        runs_tests = step.kind == "pytest" and "--spawn-explain" not in argv
        if runs_tests and not re.search(r"\d+ passed", output):
            problems.append(f"{shown} passed no test")
        if problems:
            return [*problems, output]
    return []


#: Output no command shown may print.
BAD_OUTPUT = ("UsageError", "error:", "INTERNALERROR")
#: Blocks run at once: each is a pytest process and its children, mostly one core each.
AT_ONCE = 2


class Runs:
    """Blocks run on AT_ONCE threads, each in a fresh sample project of its own.

    Not in pytester's directory: that, and the environment pytester works in, belong to
    one test at a time, and these blocks run side by side (about half the time on two
    cores). The environment is taken once, here, since tests meanwhile change theirs.
    """

    def __init__(self, pool: ThreadPoolExecutor, factory: pytest.TempPathFactory) -> None:
        self.pool = pool
        self.factory = factory
        self.environ = _environment()
        self.started: dict[tuple[str, ...], Future[list[str]]] = {}

    def start(self, commands: tuple[str, ...]) -> None:
        if commands not in self.started:
            path = self.factory.mktemp("docs-command")
            run = self.pool.submit(_run_block, commands, path, self.environ)
            self.started[commands] = run

    def problems(self, commands: tuple[str, ...]) -> list[str]:
        self.start(commands)
        return self.started[commands].result()


@pytest.fixture(scope="module")
def command_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Runs]:
    """Every selected block's run, all started at the first one's test.

    test_command_shown_runs then waits for its own, so blocks run side by side. Under
    xdist, where a worker does not know which tests it will get, each starts its own.
    """
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        runs = Runs(pool, tmp_path_factory)
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            for item in request.session.items:
                callspec = getattr(item, "callspec", None)
                if callspec and item.name.startswith("test_command_shown_runs["):
                    runs.start(callspec.params["commands"])
        yield runs
        # Stopped early (-x, a Ctrl-C): the blocks not begun are not run.
        pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize(
    "commands",
    [pytest.param(commands, id=" ; ".join(commands)) for commands in CONSOLE],
)
def test_command_shown_runs(command_runs, commands):
    problems = command_runs.problems(commands)
    assert not problems, f"shown on {CONSOLE[commands]}:\n" + "\n".join(problems)


def test_pytest_commands_are_shown_as_console():
    """A pytest command in any other block would escape test_command_shown_runs."""
    command = re.compile(r"^(\$ )?(\S+=\S*\s+)*((\S*/)?python3?\s+-m\s+pytest|pytest)(\s|$)")
    hidden = []
    for path in _pages():
        for block in _blocks(path):
            if block.info == "console" or CI_MARKER.fullmatch(block.before):
                continue
            hidden += [f"{block.page}: {line}" for line in block.lines if command.match(line)]
    assert not hidden, "show these in a ```console block, as `$ command`:\n" + "\n".join(hidden)


def test_the_rule_finds_the_commands():
    # The extraction finds what the rule says: a sanity check against a parser that
    # silently finds nothing.
    pages = {page for shown in CONSOLE.values() for page in shown.split(", ")}
    assert {"README.md", "configuration.md", "compatibility.md", "scaling.md"} <= pages
    assert len(CONSOLE) >= 10


def test_configuration_reference_is_generated():
    generator = runpy.run_path(str(DOCS / "gen_reference.py"))
    page = DOCS / "guide" / "configuration.md"
    text = page.read_text()
    assert generator["render"](text) == text, (
        "docs/guide/configuration.md's settings table is not what spawnrun/config/_settings.py's "
        "reference_table() renders: run `python docs/gen_reference.py`"
    )


def test_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail(
            "mkdocs and mkdocs-material are not installed: the test extra installs them "
            '(pip install -e ".[test]", or ".[docs]" for the site alone)'
        )
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
