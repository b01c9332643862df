"""The run summary a person reads: what was isolated, what crashed, booted, reaped, used."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

SUITE = """
import os, signal, subprocess, sys, time, pytest

@pytest.mark.gpu
def test_uses_cuda():
    import torch
    torch.cuda.zeros(1)  # the fake torch's CUDA "initializes"

@pytest.mark.gpu
def test_no_cuda():
    pass

@pytest.mark.gpu(count=0)
def test_crashes():
    os.kill(os.getpid(), signal.SIGSEGV)

@pytest.mark.gpu(count=0, timeout=1)
def test_hangs():
    time.sleep(30)

@pytest.mark.gpu(count=0)
def test_leaves_a_process():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

def test_in_process():
    pass
"""


def test_summary_and_junitxml_say_what_spawnrun_did(pytester, fake_torch):
    pytester.makepyfile(test_s=SUITE)
    xml = pytester.path / "out.xml"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--junitxml={xml}")
    result.assert_outcomes(passed=4, failed=2, warnings=1)  # the reaping warning
    result.stdout.fnmatch_lines(
        [
            "*- spawnrun -*",
            "5 tests isolated in 5 children; boot median *s, slowest *s",
            "1 crashed, 1 timed out, 1 process left behind was reaped",
            "peak GPU memory per test (torch's caching allocator, reserved):",
            "  5.0 MiB  test_s.py::test_uses_cuda*",
        ]
    )
    result.stdout.no_fnmatch_line("*MiB  test_s.py::test_no_cuda*")
    cases = {c.get("name"): c for c in ET.parse(xml).getroot().iter("testcase")}

    def props(name: str) -> dict[str, str]:
        found = cases[name].find("properties")
        return {} if found is None else {p.get("name"): p.get("value") for p in found}

    assert float(props("test_uses_cuda")["spawnrun_boot_s"]) > 0
    assert float(props("test_uses_cuda")["spawnrun_peak_gpu_mib"]) == 5.0
    assert "spawnrun_peak_gpu_mib" not in props("test_no_cuda")
    assert float(props("test_crashes")["spawnrun_boot_s"]) > 0
    assert props("test_in_process") == {}


def test_no_summary_when_nothing_was_spawned(pytester):
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*spawnrun -*")
    result.stdout.no_fnmatch_line("*isolated*")


FIRST = """
import os, time, pytest

@pytest.mark.gpu(count=0)
def test_first():
    # Until the next test's child, booted ahead meanwhile, has died.
    deadline = time.monotonic() + 60
    while not os.path.exists("died") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # and the parent has seen it go
"""

DIES = """
import os, pytest, spawnrun

if spawnrun.is_child():  # the child dies while it collects, before its turn
    open("died", "w").close()
    os._exit(3)

@pytest.mark.gpu(count=0)
def test_dies_booting():
    pass
"""


@pytest.mark.parametrize(
    "args, outcomes, first",
    [
        # The second test's child boots ahead during the first and dies before its turn.
        ([], {"passed": 1, "errors": 1}, "2 tests isolated in 2 children; boot median *"),
        # One test alone (no boot time: its child never booted).
        (["test_b.py"], {"errors": 1}, "1 test isolated in 1 child"),
    ],
)
def test_summary_counts_a_child_that_died_booting_ahead(pytester, args, outcomes, first):
    pytester.makepyfile(test_a=FIRST, test_b=DIES)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-jobs", "1", "--spawn-lookahead", "1", *args
    )
    result.assert_outcomes(**outcomes)
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    result.stdout.fnmatch_lines(["*- spawnrun -*", first, "1 crashed"])


def test_each_xdist_worker_says_what_its_spawned_tests_came_to(pytester):
    """Under -n 2 the run summary was missing entirely: each worker keeps its own, and
    the controller prints them, one line each, named by the worker."""
    pytester.makepyfile(
        "import pytest\n\n@pytest.mark.gpu(count=0)\n@pytest.mark.parametrize('i', range(4))\n"
        "def test_g(i):\n    pass\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*- spawnrun -*"])
    lines = [line for line in result.stdout.lines if "isolated in" in line]
    assert sorted(line.split()[0] for line in lines) == ["[gw0]", "[gw1]"], lines
    isolated = sum(int(line.split()[1]) for line in lines)
    assert isolated == 4, lines


def test_shared_counts_only_tests_that_ran_side_by_side(pytester):
    """One test at a time: the second starts while the first's child still exits (an
    atexit handler), holding its claim. That is no sharing a person can act on: the
    summary said both had shared a GPU."""
    pytester.makepyfile(
        "import atexit, time, pytest\n\n"
        "@pytest.mark.gpu(memory='1GiB')\ndef test_first():\n"
        "    atexit.register(time.sleep, 1.5)\n\n"
        "@pytest.mark.gpu(memory='1GiB')\ndef test_second():\n    pass\n"
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-gpus", "0,", "--spawn-gpu-memory", "80GiB",
        "--spawn-jobs", "1",
    )  # fmt: skip
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["packing: 0 shared a GPU*"])


def test_the_header_says_what_to_do_when_gpu_memory_is_unknown(pytester):
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--spawn-gpus", "0,")
    result.stdout.fnmatch_lines(
        [
            "spawnrun: each GPU test runs alone on its GPU, even with a memory= budget: *"
            "To let budgeted tests share a GPU, give it: --spawn-gpu-memory 80GiB"
        ]
    )


def test_a_group_that_xdist_splits_over_workers_is_named(pytester):
    pytester.makepyfile(
        "import pytest\npytestmark = pytest.mark.gpu(count=0, group='llm')\n\n"
        "@pytest.mark.parametrize('i', range(4))\ndef test_g(i):\n    pass\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        ["[[]gw?[]] group llm: ? of its 4 tests ran in this worker*xdist split the group*"]
    )
