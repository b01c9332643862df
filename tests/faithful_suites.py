"""A generator of small suites that record what each test observes (the oracle's input).

Not a test module: ``tests/test_faithful.py`` writes a suite with ``write`` for each seed,
runs it plainly, spawned and in fast mode, and compares what every test saw. Each suite
draws, from its seed, which of these it has:

* a conftest that seeds ``random`` in ``pytest_configure``, and test files whose
  ``parametrize`` ids come from it at import (their draws depend on what was collected
  before them) and whose tests draw from it again;
* a package of the rootdir (``proj``, preloaded by fast mode like a library) that reads
  the device mask and a variable of the outer environment at import, and counts the
  tests that use it (module state);
* a library outside the rootdir (``oraclelib``) that reads a variable at import: imported
  by a test file at top level, or by tests in their body after a fixture set the
  variable (a learned preload from the second run on);
* an autouse session fixture that sets a variable;
* tests on a device (``count=1``) or none (``count=0``), several per file.

Each test appends one JSON line to ``$ORACLE_OUT``: its node id and what it saw. Values
that depend on which device a test got are recorded as comparisons (the mask read at
import equals the test's own), so two correct runs record the same lines.
"""

from __future__ import annotations

import json
import random
import textwrap
from pathlib import Path
from typing import Any

#: What a test records; ``{body}`` is the test's own part.
_RECORD = """
def _record(request, **seen):
    import os, sys, json
    main = sys.modules.get("__main__")
    seen.update(
        nodeid=request.node.nodeid,
        session=os.environ.get("ORACLE_SESSION"),
        outer=os.environ.get("ORACLE_OUTER"),
        cwd=os.getcwd(),
        main=getattr(main, "__name__", None),
        main_file=bool(getattr(main, "__file__", None)),
    )
    seen["process"] = _process()
    line = json.dumps(seen, sort_keys=True) + "\\n"
    fd = os.open(os.environ["ORACLE_OUT"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
"""


#: What a test records of its process, below pytest: plain pytest (without spawnrun) is
#: the reference for these, in every mode, but for ``PROCESS_DIFFERENCES``.
_PROCESS = """
def _process():
    import faulthandler, multiprocessing as mp, os, resource, signal, sys, threading
    import warnings
    seen = {"start_method": mp.get_start_method(allow_none=True)}
    chosen = mp.context._default_context._actual_context
    child = mp.Process(target=lambda: None)  # a closure: the default method's child
    child.start()
    child.join()
    seen.update(
        default_method=mp.get_start_method(),
        process_name=mp.current_process().name,
        has_parent=mp.parent_process() is not None,
        closure_child=child.exitcode,
    )
    # The observer's own start is no choice of the suite's: the next test (in the
    # same process, in plain pytest) finds the method as this one did.
    mp.context._default_context._actual_context = chosen
    mask = os.umask(0)
    os.umask(mask)
    seen["umask"] = mask
    names = ("SIGINT", "SIGTERM", "SIGPIPE", "SIGCHLD", "SIGHUP", "SIGQUIT", "SIGUSR1",
             "SIGUSR2", "SIGALRM", "SIGXFSZ")
    seen["signals"] = {n: str(signal.getsignal(getattr(signal, n))) for n in names}
    seen["blocked"] = sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    seen["rlimits"] = {
        n: resource.getrlimit(getattr(resource, n))
        for n in ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_STACK", "RLIMIT_AS")
    }
    seen["flags"] = list(sys.flags)
    seen["recursion"] = sys.getrecursionlimit()
    seen["faulthandler"] = faulthandler.is_enabled()
    seen["warnings"] = [f"{f[0]} {f[2].__name__}" for f in warnings.filters[:8]]
    inheritable = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if int(name) > 2 and os.get_inheritable(int(name)):
                inheritable.append(int(name))
        except OSError:
            pass
    seen["inheritable_fds"] = sorted(inheritable)
    seen["threads"] = threading.active_count()
    seen["excepthook"] = sys.excepthook is sys.__excepthook__
    return seen
"""

#: Process observations that differ from plain pytest by design (docs/guide: the table of
#: what a child's process does not share with a fresh interpreter's).
PROCESS_DIFFERENCES: frozenset[str] = frozenset()
#: ... and those of a fork (fast mode) alone: threads a template started (a plugin's
#: server thread at configure) are not in its forks, as ``os.fork`` keeps none.
FORK_DIFFERENCES: frozenset[str] = frozenset({"threads"})


def write(root: Path, site: Path, seed: int) -> dict[str, Any]:
    """Write suite ``seed`` into ``root`` (its library into ``site``); what it drew."""
    rng = random.Random(seed)
    shape: dict[str, Any] = {
        "seeded": rng.random() < 0.75,
        "files": rng.randint(2, 3),
        "proj": rng.random() < 0.75,
        "lib_at_top": rng.random() < 0.4,
        "lib_in_body": rng.random() < 0.6,
        "session_env": rng.random() < 0.5,
    }
    (root / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    conftest = ["import os, random, pytest", ""]
    if shape["seeded"]:
        conftest += ["def pytest_configure(config):", f"    random.seed({seed})", ""]
    if shape["session_env"]:
        conftest += [
            "@pytest.fixture(scope='session', autouse=True)",
            "def _session_env():",
            "    os.environ['ORACLE_SESSION'] = 'set by a session fixture'",
            "    yield",
            "",
        ]
    (root / "conftest.py").write_text("\n".join(conftest))
    proj = root / "proj"
    proj.mkdir()
    (proj / "__init__.py").write_text(
        textwrap.dedent(
            """\
            import os
            MASK = os.environ.get("CUDA_VISIBLE_DEVICES")
            OUTER = os.environ.get("ORACLE_OUTER")
            USED = 0

            def use():
                global USED
                USED += 1
                return USED
            """
        )
    )
    lib = site / "oraclelib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text('import os\nFLAG = os.environ.get("ORACLE_FLAG")\n')
    tests = root / "tests"
    tests.mkdir()
    for index in range(shape["files"]):
        (tests / f"test_f{index}.py").write_text(_test_file(rng, shape))
    return shape


def _test_file(rng: random.Random, shape: dict[str, Any]) -> str:
    lines = ["import os, random, pytest"]
    if shape["proj"]:
        lines.append("import proj")
    if shape["lib_at_top"]:
        lines.append("import oraclelib")
    lines.append(_RECORD)
    lines.append(_PROCESS)
    if shape["lib_in_body"]:
        lines += [
            "@pytest.fixture",
            "def flag(monkeypatch):",
            "    monkeypatch.setenv('ORACLE_FLAG', 'set by a fixture')",
            "",
        ]
    for number in range(rng.randint(1, 3)):
        count = rng.choice([0, 1])
        params = rng.randint(1, 3)
        if shape["seeded"]:
            ids = f"[random.randint(0, 10**6) for _ in range({params})]"
        else:
            ids = f"list(range({params}))"
        fixtures = "request, value" + (", flag" if shape["lib_in_body"] else "")
        body = ["    seen = {'value': value}"]
        if shape["seeded"]:
            body.append("    seen['draw'] = random.random()")
        if shape["proj"]:
            body += [
                "    mask = os.environ.get('CUDA_VISIBLE_DEVICES')",
                "    seen['proj_mask_is_mine'] = proj.MASK == mask",
                "    seen['proj_outer'] = proj.OUTER",
                "    seen['proj_used'] = proj.use()",
            ]
        if shape["lib_at_top"]:
            body.append("    seen['lib_top_flag'] = oraclelib.FLAG")
        if shape["lib_in_body"]:
            body += [
                "    import oraclelib as lib",
                "    seen['lib_flag_is_mine'] = lib.FLAG == os.environ.get('ORACLE_FLAG')",
            ]
        body.append("    _record(request, **seen)")
        lines += [
            f"@pytest.mark.gpu(count={count})",
            f"@pytest.mark.parametrize('value', {ids})",
            f"def test_t{number}({fixtures}):",
            *body,
            "",
        ]
    return "\n".join(lines)


def observations(path: Path) -> dict[str, dict[str, Any]]:
    """What each test recorded, by node id (a test recorded twice keeps its last)."""
    if not path.exists():
        return {}
    out: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        seen = json.loads(line)
        out[seen.pop("nodeid")] = seen
    return out
