"""Device memory over a test's whole process tree (an engine process, as vLLM's).

vLLM's ``LLM(...)`` starts an engine process that holds the weights and the KV cache; a
test's own process holds next to nothing, and the engine is gone by the test's end. The
stand-in NVML (``vendor_standins``) lists what each process says it holds, as long as it
lives: a test is measured over every process below its child while it runs, and learns
that peak.
"""

from __future__ import annotations

import json
import os
import signal
import xml.etree.ElementTree as ET

import pytest
import vendor_standins as standins

from spawnrun.devices import _packing
from spawnrun.wire import _reports

GiB = 2**30

ENGINE_SUITE = """
import os, subprocess, sys, time
import pytest

ENGINE = '''
import os, sys, time
with open(os.path.join(os.environ["FAKE_GPU_PROCS"], str(os.getpid())), "w") as f:
    f.write("0 {held}")
time.sleep(1.2)
'''

@pytest.mark.gpu
@pytest.mark.parametrize("how", ["child", "grandchild"])
def test_engine(how):
    # The engine holds the memory, and has ended before the test does.
    code = ENGINE if how == "child" else (
        "import subprocess, sys; subprocess.run([sys.executable, '-c', %r], check=True)" % ENGINE
    )
    subprocess.run([sys.executable, "-c", code], check=True)
"""


def _peaks(xml) -> dict[str, float]:
    found = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name") == _reports.LEARNED_PEAK:
                found[case.get("name")] = float(prop.get("value"))
    return found


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_test_learns_the_memory_its_engine_process_held(pytester, monkeypatch, method):
    """The engine's 30 GiB are the test's peak, though its own process held nothing and
    the engine had ended before the test's end (NVML lists only live processes)."""
    standins.one_h100(pytester, monkeypatch)
    pytester.makepyfile(test_engine=ENGINE_SUITE.replace("{held}", str(30 * GiB)))
    xml = pytester.path / "out.xml"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-method", method, f"--junitxml={xml}"
    )
    result.assert_outcomes(passed=2)
    want = (30 * GiB - _packing.RESERVE) / 2**20
    assert _peaks(xml) == {"test_engine[child]": want, "test_engine[grandchild]": want}


LEAVES_RUNNING = """
import os, subprocess, sys, time
import pytest

def test_leaves_two(tmp_path):
    # A child it never waits for, and a grandchild in a session of its own whose
    # parent has ended: re-parented to init, it would escape every group and session.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)  # left-child TOKEN"])
    subprocess.run(
        ["sh", "-c", "setsid " + sys.executable + " -c 'import time; time.sleep(301)  # TOKEN' &"],
        check=True,
    )
    time.sleep(0.3)  # the shell has ended; its orphan runs on

def test_clean():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def _running(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(name))
        except (OSError, ValueError):
            continue
    return found


def _kill_running(marker: str) -> list[int]:
    """The processes still running with ``marker`` on their command line, killed."""
    left = _running(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_what_a_test_leaves_running_is_ended_and_named(pytester, method):
    """Nothing a test starts outlives its process, also not a grandchild that left for a
    session of its own after its parent ended; the warning names them, on their test."""
    # This run's own sleepers: another run of this test may have its own running now.
    token = f"{pytester.path.name}-{method}"
    pytester.makepyfile(test_leaves=LEAVES_RUNNING.replace("TOKEN", token))
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--spawn-method",
        method,
        "--spawn-gpu",
        "-W",
        "default",
        "-W",
        "ignore::ResourceWarning",  # the test's own: it never waits for its Popen
    )
    try:
        result.assert_outcomes(passed=2, warnings=1)
        result.stdout.fnmatch_lines(
            [
                "*test_leaves.py::test_leaves_two*",
                "*this test left 2 process(es) running, ended as its process left*"
                "time.sleep(300)  # left-child*time.sleep(301)*",
            ]
        )
        result.stdout.fnmatch_lines(["*2 processes left behind were reaped*"])
    finally:
        left = _kill_running(token)
    assert left == []


GROWING_ENGINE = """
import os, subprocess, sys
import pytest

ENGINE = '''
import os, sys, time
with open(os.path.join(os.environ["FAKE_GPU_PROCS"], str(os.getpid())), "w") as f:
    f.write("0 " + os.environ["ENGINE_HOLDS"])
time.sleep(1.2)
'''

@pytest.mark.gpu
def test_engine():
    subprocess.run([sys.executable, "-c", ENGINE], check=True)
"""


def test_a_process_tree_over_its_learned_budget_runs_again_alone(pytester, monkeypatch):
    """The engine held 2 GiB when its peak was learned; it holds 10 GiB now, beyond the
    learned budget (no cap reaches a process the test started): the test runs again
    alone, though it passed, and that run's peak is what is learned."""
    standins.one_h100(pytester, monkeypatch)
    pytester.makepyfile(test_engine=GROWING_ENGINE)
    peaks = []
    for run, holds in enumerate((2 * GiB, 10 * GiB, 10 * GiB)):
        monkeypatch.setenv("ENGINE_HOLDS", str(holds))
        xml = pytester.path / f"run{run}.xml"
        result = pytester.runpytest_subprocess(f"--junitxml={xml}")
        result.assert_outcomes(passed=1)
        again = "*1 test ran out of memory (or skipped for want of it) on a guessed budget*"
        if run == 1:
            result.stdout.fnmatch_lines([again + "test_engine.py::test_engine"])
        else:
            result.stdout.no_fnmatch_line(again)
        peaks.append(_peaks(xml)["test_engine"])
    assert peaks == [1024.0, 9216.0, 9216.0]


DECLARED_ENGINE = """
import os, subprocess, sys
import pytest

ENGINE = '''
import os, sys, time
with open(os.path.join(os.environ["FAKE_GPU_PROCS"], str(os.getpid())), "w") as f:
    f.write("0 " + sys.argv[1])
time.sleep(1.2)
'''

@pytest.mark.gpu(memory="4GiB")
@pytest.mark.parametrize("gib", [3, 10])
def test_engine(gib):
    print("the engine starts")
    subprocess.run([sys.executable, "-c", ENGINE, str(gib * 2**30)], check=True)
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_process_tree_over_its_declared_budget_fails_the_test(pytester, monkeypatch, method):
    """A declared budget holds over the test's process tree: torch's cap reaches only
    the test's own process, so an engine process that took 10 GiB under a 4 GiB budget
    fails its test (its output kept), where before it passed while its neighbours ran
    on memory the budgets said was theirs. One that kept within it passes."""
    standins.one_h100(pytester, monkeypatch)
    pytester.makepyfile(test_engine=DECLARED_ENGINE)
    result = pytester.runpytest_subprocess("--spawn-method", method, "-rA")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "spawnrun: GPU memory budget: the test's process tree held 10.0 GiB on one of "
            "its GPUs at once*",
        ]
    )
    result.stdout.fnmatch_lines(["FAILED test_engine.py::test_engine[[]10[]]*"])
    result.stdout.fnmatch_lines(
        [
            "*; 9.0 GiB less the 1.0 GiB reserve for its context), more than its budget of "
            "4.0 GiB (memory='4GiB'): a process it started went over it*"
        ]
    )
    result.stdout.fnmatch_lines(["*Captured stdout call*", "the engine starts"])
    result.stdout.fnmatch_lines(["PASSED test_engine.py::test_engine[[]3[]]"])


FAKE_JAX = {
    "jax/__init__.py": "",
    "jax/_src/__init__.py": "",
    "jax/_src/xla_bridge.py": '''
import json
import os

_backends = {}


class _Device:
    def memory_stats(self):
        return {"bytes_in_use": 0, "peak_bytes_in_use": 2 * 2**30, "bytes_limit": 60 * 2**30}


class _Client:
    platform = "gpu"

    def local_devices(self):
        return [_Device()]


def start():
    """As JAX's GPU backend starts: it preallocates 75% of the device (NVML sees it)."""
    with open(os.path.join(os.environ["FAKE_GPU_PROCS"], str(os.getpid())), "w") as f:
        f.write("0 " + str(60 * 2**30))
    _backends["cuda"] = _Client()
''',
}

JAX_SUITE = """
import json, os
import pytest

@pytest.mark.gpu
def test_jax():
    from jax._src import xla_bridge
    xla_bridge.start()
    with open("env.json", "w") as f:
        json.dump({k: v for k, v in os.environ.items() if k.startswith("XLA_")}, f)
"""


def test_a_jax_test_learns_what_it_used_not_what_jax_preallocated(pytester, monkeypatch):
    """JAX preallocates 75% of the device; NVML counts that pool as the process's. The
    test learns JAX's own peak (2 GiB) and its next run gets a budget from it in JAX's
    own variables, where it learned 59 GiB and ran alone."""
    standins.one_h100(pytester, monkeypatch)
    for name, text in FAKE_JAX.items():
        (pytester.path / name).parent.mkdir(parents=True, exist_ok=True)
        (pytester.path / name).write_text(text)
    pytester.makepyfile(test_jax=JAX_SUITE)
    first = pytester.runpytest_subprocess("--junitxml=first.xml")
    first.assert_outcomes(passed=1)
    assert _peaks(pytester.path / "first.xml") == {"test_jax": 2048.0}
    second = pytester.runpytest_subprocess("-v")
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines(["test_jax.py::test_jax PASSED [[]gpu 0, 2.8 GiB[]]*"])
    env = json.loads((pytester.path / "env.json").read_text())
    assert env == {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{2816 * 2**20 / (80 * GiB):.4f}",
    }


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_what_a_test_left_running_is_named_when_the_parent_reads_done_late(pytester, method):
    """A loaded parent may take a while between reading a child's "done" and handing the
    child on, while the child says what it left running and exits: that last word was in
    the pipe, which was closed unread (the run ended green with no warning). Here the
    parent is held up in that window, as a busy machine's scheduler may hold it."""
    pytester.makeconftest(
        """
        import os, time

        if os.environ.get("SPAWNRUN_CHILD") != "1":  # the parent only
            from spawnrun.learn import _learned

            _saw = _learned.saw_imports

            def held_up(config, modules):
                time.sleep(1.5)  # the child leaves meanwhile
                return _saw(config, modules)

            _learned.saw_imports = held_up
        """
    )
    token = f"{pytester.path.name}-late-{method}"
    pytester.makepyfile(
        test_left=f"""
        import subprocess, sys

        def test_leaves_one():
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)  # {token}"])
        """
    )
    try:
        result = pytester.runpytest_subprocess(
            "-p",
            "no:cacheprovider",
            "--spawn-gpu",
            "--spawn-method",
            method,
            "-W",
            "ignore::ResourceWarning",
        )
        result.assert_outcomes(passed=1, warnings=1)
        result.stdout.fnmatch_lines(["*this test left 1 process(es) running*"])
    finally:
        left = _kill_running(token)
    assert left == []
