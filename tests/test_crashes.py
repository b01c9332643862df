"""Crashes, hangs, orphans, interrupts and huge output: every end becomes a precise report."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import pickle
import re
import signal
import struct
import subprocess
import sys
import time

import psutil
import pytest
from patience import finish
from patience import wait_for
from pytest import LineMatcher

from spawnrun.driver import _ending
from spawnrun.launch import _forkserver
from spawnrun.launch import _runner
from spawnrun.launch import _stream
from spawnrun.proc import _probe
from spawnrun.wire import _protocol as proto
from spawnrun.wire import _replies
from spawnrun.wire import _reports

NO_INTERNAL = "*INTERNALERROR*"

KINDS = {
    "segfault": ("os.kill(os.getpid(), signal.SIGSEGV)", "killed by signal SIGSEGV (11)", True),
    "abort": ("os.abort()", "killed by signal SIGABRT (6)", True),
    "exit": ("os._exit(7)", "exited with status 7 before reporting the end of the test", False),
    "sigkill": (
        "os.kill(os.getpid(), signal.SIGKILL)",
        "killed by signal SIGKILL (9); the kernel's out-of-memory killer is a common cause",
        False,
    ),
}
PHASES = ("setup", "call", "teardown")


def _matrix_source() -> str:
    lines = [
        "import os, signal",
        "import pytest",
        "pytestmark = pytest.mark.gpu",
        "KINDS = " + repr({k: v[0] for k, v in KINDS.items()}),
        "def die(kind):",
        "    print('last words of', kind)",
        "    exec(KINDS[kind])",
        "@pytest.fixture",
        "def crash(request):",
        "    phase, kind = request.param",
        "    if phase == 'setup':",
        "        die(kind)",
        "    yield (phase, kind)",
        "    if phase == 'teardown':",
        "        die(kind)",
        "@pytest.mark.parametrize('crash', [(p, k) for p in "
        + repr(PHASES)
        + " for k in "
        + repr(tuple(KINDS))
        + "], indirect=True, ids=lambda pk: '-'.join(pk))",
        "def test_crash(crash):",
        "    if crash[0] == 'call':",
        "        die(crash[1])",
        "def test_after_the_crashes():",
        "    pass",
    ]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_crash_matrix(outcomes, pytester, method):
    pytester.makepyfile(test_matrix=_matrix_source())
    # What the child printed outside pytest's capture (a plugin, as the child's pytest
    # starts) is part of every report, in both start methods.
    pytester.makepyfile(bootplugin="print('BOOT-LINE-OF-THE-CHILD')")
    result, seen = outcomes.run("-rA", "--spawn-method", method, "-p", "bootplugin")
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    # setup crashes are errors; call crashes failures; teardown crashes keep the
    # passed call and add an error. The session goes on to the last test.
    result.assert_outcomes(passed=len(KINDS) + 1, failed=len(KINDS), errors=2 * len(KINDS))
    out = result.stdout.str()
    for phase in PHASES:
        for kind, (_, cause, has_stack) in KINDS.items():
            nodeid = f"test_matrix.py::test_crash[{phase}-{kind}]"
            # A death in a fork of a template runs the test again, spawned (issue 56):
            # the first run's report is shown as a rerun, the second counts.
            mine = [s for s in seen if s[0] == nodeid and s[2] != "rerun"]
            # Exactly one failed report, on the phase that died; nothing lost.
            assert [s[1] for s in mine if s[2] == "failed"] == [phase], mine
            assert [s[1] for s in mine] == (
                ["setup", "teardown"] if phase == "setup" else ["setup", "call", "teardown"]
            )
            head = f"{_reports.DIED} during {phase}: {cause}\nnode id: {nodeid}"
            assert head in out
            # Fatal signals leave faulthandler stacks; os._exit and SIGKILL cannot.
            start = out.index(head) + len(head)
            end = out.find("node id: ", start)
            assert (_reports.STACKS in out[start : end if end > 0 else None]) == has_stack
    result.stdout.fnmatch_lines(
        [f"*{_reports.STACKS}*", "*line * in die*", "*line * in test_crash*"]
    )
    result.stdout.fnmatch_lines([f"*{_reports.CAPTURED}*", "last words of segfault"])
    result.stdout.fnmatch_lines([f"*{_reports.OUTPUT}*", "BOOT-LINE-OF-THE-CHILD"])


@pytest.mark.parametrize(
    "marker, expected",
    [
        ("@pytest.mark.xfail(reason='crashes')", {"xfailed": 1}),
        ("@pytest.mark.xfail(strict=True, reason='crashes')", {"xfailed": 1}),
        ("@pytest.mark.xfail(raises=ValueError)", {"failed": 1}),
    ],
    ids=["non-strict", "strict", "raises"],
)
def test_crash_under_xfail_matches_in_process_exception_rule(pytester, marker, expected):
    pytester.makepyfile(
        f"import os, pytest\n@pytest.mark.gpu\n{marker}\ndef test_x():\n    os.abort()\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(**expected)
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    if "failed" in expected:
        result.stdout.fnmatch_lines([f"*{_reports.XFAIL_RAISES}*"])


def test_timeout_dumps_stacks_then_kills(pytester):
    pytester.makepyfile(
        """
        import threading, time
        import pytest

        def helper_thread_body():
            time.sleep(60)

        def wait_for_gpu_that_never_answers():
            time.sleep(60)

        @pytest.mark.gpu(timeout=1)
        def test_hangs():
            threading.Thread(target=helper_thread_body, daemon=True).start()
            wait_for_gpu_that_never_answers()

        @pytest.mark.gpu
        def test_uses_cli_timeout():
            time.sleep(60)

        @pytest.mark.gpu(timeout=0)
        def test_marker_disables_limit():
            time.sleep(1.5)

        @pytest.mark.gpu(timeout=30)
        @pytest.mark.timeout(1)
        def test_pytest_timeout_inside_child():
            time.sleep(60)
        """
    )
    start = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--spawn-timeout", "1.2")
    assert time.monotonic() - start < 40
    result.assert_outcomes(failed=3, passed=1)
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.stdout.fnmatch_lines(
        [
            "*_ test_hangs _*",
            "Timeout (>1 s) during call",
            f"*{_reports.STACKS}*",
            "*in helper_thread_body*",
            "*in wait_for_gpu_that_never_answers*",
            "*in test_hangs*",
            "*_ test_uses_cli_timeout _*",
            "Timeout (>1.2 s) during call",
            "*_ test_pytest_timeout_inside_child _*",
            "*Failed: Timeout*",
        ]
    )


TREE = """
import multiprocessing, subprocess, sys, time
import pytest

def spawned_worker_waits(ready):
    ready.set()
    time.sleep(300)

def forked_worker_waits(ready):
    ready.set()
    time.sleep(300)

POPEN = "def popen_worker_waits():\\n    print('ready', flush=True)\\n    time.sleep(300)\\n"

@pytest.mark.gpu(timeout=10)
def test_hangs_below():
    for method, target in (("spawn", spawned_worker_waits), ("fork", forked_worker_waits)):
        ctx = multiprocessing.get_context(method)
        ready = ctx.Event()
        ctx.Process(target=target, args=(ready,)).start()
        assert ready.wait(60)
    code = "import time\\n" + POPEN + "popen_worker_waits()\\n"
    popen = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert popen.stdout.readline() == "ready\\n"
    subprocess.Popen(["sleep", "300"])
    time.sleep(300)
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_timeout_shows_the_stacks_of_every_process_below_the_child(pytester, method):
    # GPU tests hang in their grandchildren (an engine core, a worker pool, NCCL ranks):
    # a timeout shows the stacks of every Python process below the child, spawned,
    # forked or started with subprocess, each with its pid and command line.
    pytester.makepyfile(test_tree=TREE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--spawn-method", method)
    result.assert_outcomes(failed=1)
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    out = result.stdout.str()
    title = re.escape(_reports.BELOW).replace(r"\{pid\}", r"(\d+)").replace(r"\{ppid\}", r"\d+")
    title = title.replace(r"\{command\}", "(.*?)")
    found = re.findall(rf"-+ {title} -+\n(.*?)(?=\n-+ spawnrun|\n[=_]{{3,}})", out, re.S)
    assert len(found) >= 4, out
    stacks = {}
    for pid, command, text in found:
        stacks[pid] = (command, text)
    kinds = {
        "spawned": "in spawned_worker_waits",
        "forked": "in forked_worker_waits",
        "popen": "in popen_worker_waits",
    }
    for kind, frame in kinds.items():
        assert any(frame in text for _, text in stacks.values()), (kind, out)
    spawned = [c for c, text in stacks.values() if kinds["spawned"] in text]
    assert "spawn_main" in spawned[0]
    assert [text for c, text in stacks.values() if c == "sleep 300"] == [_reports.NOT_ASKED]


ORPHANS = """
import json, multiprocessing, os, subprocess, sys, time
import pytest

def sleeper():
    time.sleep(300)

@pytest.mark.gpu{args}
def test_leaves_processes_behind():
    a = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    b = multiprocessing.get_context("spawn").Process(target=sleeper)
    b.start()
    with open("pids.json", "w") as f:
        json.dump([a.pid, b.pid], f)
    {end}
"""


@pytest.mark.parametrize(
    "args, end, outcome",
    [("", "pass", {"passed": 1}), ("(timeout=3)", "time.sleep(300)", {"failed": 1})],
    ids=["normal-end", "timeout"],
)
def test_no_orphans_survive(pytester, args, end, outcome):
    pytester.makepyfile(test_orphans=ORPHANS.format(args=args, end=end))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(**outcome)
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    pids = json.loads((pytester.path / "pids.json").read_text())
    alive = [p for p in pids if _alive(p)]
    assert alive == []
    result.stdout.fnmatch_lines([f"*{_reports.REAPED.format(n=2)}*"])


def _start_pytest_until(
    pytester: pytest.Pytester, marker: str
) -> tuple[subprocess.Popen[str], str]:
    """Start the inner pytest in the background; return it once its test wrote ``marker``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    path = pytester.path / marker
    try:
        wait_for(path.exists, f"the inner test to write {marker}", quiet=6.0)
    except AssertionError as exc:
        proc.kill()
        raise AssertionError(f"{exc}; its output:\n{proc.communicate()[0]}") from None
    time.sleep(0.2)
    return proc, path.read_text()


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process: not gone, nor a zombie (one reaped between two
    looks is gone: CI once saw it exist, then vanish before its status was read)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupting_the_parent_ends_children(pytester, signum):
    pytester.makepyfile(
        """
        import json, os, subprocess, sys, time
        import pytest

        @pytest.mark.gpu
        def test_long():
            grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            with open("started.json", "w") as f:
                json.dump([os.getpid(), grandchild.pid], f)
            time.sleep(300)
        """
    )
    proc, started = _start_pytest_until(pytester, "started.json")
    pids = json.loads(started)
    sent = time.monotonic()
    proc.send_signal(signum)
    out = finish(proc, "the interrupted run to end")
    # The child is killed, not waited for: the run ends well before the grace a child
    # that finished its test gets to exit (about 1 s at a load of 10, against 15 s).
    ended = time.monotonic() - sent
    assert ended < _ending.EXIT_GRACE, (ended, out)
    assert proc.returncode == pytest.ExitCode.INTERRUPTED
    assert "KeyboardInterrupt" in out
    assert "INTERNALERROR" not in out
    wait_for(lambda: not any(_alive(p) for p in pids), "the child and its grandchild to go")


@pytest.mark.parametrize(
    "jobs, method", [("1", "spawn"), ("2", "forkserver")], ids=["one-at-a-time", "two-fast"]
)
def test_what_runs_is_shown_and_named_on_ctrl_c(pytester, jobs, method):
    # During a long spawned test the terminal shows what runs (one at a time: pytest's
    # own node id line, as in-process; several: a line per test started, off a
    # terminal), and a Ctrl-C names the tests it interrupted.
    pytester.makepyfile(
        test_long="""
        import time
        import pytest

        @pytest.mark.gpu
        @pytest.mark.parametrize("i", [0, 1])
        def test_long(i):
            open(f"started-{i}", "w").close()
            time.sleep(300)
        """
    )
    args = ["-p", "no:cacheprovider", "-v", "--spawn-jobs", jobs, "--spawn-method", method]
    out_path = pytester.path / "out.txt"
    running = [f"test_long.py::test_long[[]{i}[]]" for i in range(int(jobs))]
    shown = [f"spawnrun: running {r} [[]gpu ?[]]" for r in running]

    def showing() -> bool:
        """Whether the terminal shows what runs (the parent may show it a while after
        the tests started, on a loaded machine)."""
        before = out_path.read_text()
        if jobs == "1":
            return before.rstrip().endswith("test_long.py::test_long[0]")
        return all(fnmatch.filter(before.splitlines(), line) for line in shown)

    with out_path.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *args],
            cwd=pytester.path,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started = [pytester.path / f"started-{i}" for i in range(int(jobs))]
        wait_for(lambda: all(p.exists() for p in started), "the tests to start", quiet=6.0)
        with contextlib.suppress(AssertionError):
            wait_for(showing, "the terminal to show what runs", quiet=1.0)
        before = out_path.read_text()  # what the terminal showed while the tests ran
        proc.send_signal(signal.SIGINT)
        finish(proc, "the interrupted run to end")
    text = out_path.read_text()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, text
    assert "INTERNALERROR" not in text
    if method == "forkserver":
        assert "fast mode, --spawn-method forkserver" in text.splitlines()[2]
    if jobs == "1":
        assert before.rstrip().endswith("test_long.py::test_long[0]"), before
    else:
        LineMatcher(before.splitlines()).fnmatch_lines_random(shown)
    LineMatcher(text.splitlines()).fnmatch_lines(
        [f"*{_reports.INTERRUPTED_RUNNING}*"]
        + [f"{r} [[]gpu ?[]] (call, * s)" for r in running]
        + ["*KeyboardInterrupt*"]
    )


PARENT_PEAK_RSS = """
import os
def pytest_sessionfinish(session):
    # VmHWM, not ru_maxrss: the latter survives exec and would include the
    # peak of whichever process forked this one.
    if os.environ.get("SPAWNRUN_CHILD") != "1":
        with open("/proc/self/status") as f:
            peak = next(l.split()[1] for l in f if l.startswith("VmHWM:"))
        open("parent_rss_kib.txt", "w").write(peak)
"""


def test_huge_output_is_bounded(pytester):
    pytester.makeconftest(PARENT_PEAK_RSS)
    pytester.makepyfile(
        """
        import os, sys
        import pytest
        CHUNK = "x" * (1 << 20)

        @pytest.mark.gpu
        def test_floods_and_fails():
            for _ in range(50):
                sys.stdout.write(CHUNK)
            for _ in range(50):
                os.write(2, CHUNK.encode())
            print("THE-END-OF-STDOUT")
            assert False
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*characters cut, the last*", "*THE-END-OF-STDOUT"])
    assert len(result.stdout.str()) < 2 * 1024 * 1024
    assert int((pytester.path / "parent_rss_kib.txt").read_text()) < 150 * 1024


def test_huge_report_fields_are_cut_before_they_are_sent(pytester):
    """A report is sent whole however large (a 1 GiB frame was accepted): a 40 MB
    assertion message and a 40 MB property were held and printed whole by the parent."""
    pytester.makeconftest(PARENT_PEAK_RSS)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu
        def test_huge(record_property):
            record_property("big", "p" * 40_000_000 + "THE-END-OF-PROPERTY")
            assert False, "m" * 40_000_000 + "THE-END-OF-MESSAGE"
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--junitxml=out.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*[[]spawnrun: * characters cut from a message of *"])
    result.stdout.fnmatch_lines(["*THE-END-OF-MESSAGE*"])
    assert len(result.stdout.str()) < 2 * 1024 * 1024
    xml = (pytester.path / "out.xml").read_text()
    assert "THE-END-OF-PROPERTY" in xml and len(xml) < 2 * 1024 * 1024
    assert int((pytester.path / "parent_rss_kib.txt").read_text()) < 150 * 1024


def test_unpicklable_report_content_degrades_to_text(pytester):
    pytester.makepyfile(
        """
        import threading
        import pytest

        @pytest.mark.gpu
        def test_odd_property(record_property):
            record_property("lock", threading.Lock())
            assert False
        """
    )
    xml = pytester.path / "out.xml"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--junitxml={xml}")
    result.assert_outcomes(failed=1)
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    assert "unlocked _thread.lock object" in xml.read_text()


def test_warns_when_cuda_was_initialized_in_parent(pytester, fake_torch):
    pytester.makeconftest("import torch\n")
    pytester.makepyfile(
        test_uses_cuda_at_import="""
        import pytest
        import torch
        BUFFER = torch.cuda.zeros(4)  # initializes "CUDA" during collection

        @pytest.mark.gpu
        def test_spawned():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*SpawnrunWarning: spawnrun: CUDA was initialized in the pytest parent process,"
            " by *test_uses_cuda_at_import.py:3 in <module>; it holds 3 MiB*"
        ]
    )


def test_cuda_in_the_parent_before_spawnrun_watched_has_a_real_location(pytester, fake_torch):
    # A conftest that initializes CUDA at import: spawnrun cannot name the line, and
    # says so from its own code, never "<unknown>:0".
    pytester.makeconftest("import torch\nBUFFER = torch.cuda.zeros(4)\n")
    pytester.makepyfile("import pytest\n@pytest.mark.gpu\ndef test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        ["*spawnrun/driver/_cudawatch.py:*: SpawnrunWarning: *before spawnrun*"]
    )
    result.stdout.no_fnmatch_line("*<unknown>*")


FAKE_NVML = """
import json, os, time
STATE = os path placeholder
def nvmlInit(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(i): return i
class _Proc:
    def __init__(self, pid): self.pid = pid
def nvmlDeviceGetComputeRunningProcesses(handle):
    # The test's process stays listed (holding memory) until its release time.
    try:
        with open(STATE) as f:
            pid, release_at = f.read().split()
    except (OSError, ValueError):
        return []
    return [_Proc(int(pid))] if time.time() < float(release_at) else []
"""


def test_waits_for_device_memory_to_settle(pytester, monkeypatch):
    state = pytester.path / "release_at.txt"
    pytester.makepyfile(pynvml=FAKE_NVML.replace("os path placeholder", repr(str(state))))
    monkeypatch.setenv("PYTHONPATH", str(pytester.path), prepend=":")
    monkeypatch.setenv("SPAWNRUN_GPUS", "auto")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one device: the second test waits
    pytester.makepyfile(
        test_gpu=f"""
        import os, time
        import pytest

        @pytest.mark.gpu
        def test_frees_late():
            # Listed on the device until 2.5 s after the test, as with a slow driver (well
            # past the 1 s from which a wait is told, whatever the exit and reaping took).
            open({str(state)!r}, "w").write(f"{{os.getpid()}} {{time.time() + 2.5}}")

        @pytest.mark.gpu
        def test_next_on_the_device():
            # Its turn on the device comes only once the driver let go of the last test.
            pid, release_at = open({str(state)!r}).read().split()
            assert time.time() >= float(release_at)
        """
    )
    start = time.monotonic()
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-settle", "4", "--spawn-jobs", "1"
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["*spawnrun: waits for device memory*", "[12].?s after test_gpu.py::test_frees_late"]
    )
    result.stdout.no_fnmatch_line("*after test_gpu.py::test_next_on_the_device*")
    assert time.monotonic() - start < 30


def _processes_with(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("SPAWNRUN_TEST_MARK") == marker and proc.status() != "zombie":
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


@pytest.mark.parametrize("how", ["-x", "SIGINT"])
def test_children_booted_ahead_are_reaped_when_the_run_ends_early(pytester, monkeypatch, how):
    marker = f"{how}-{time.time()}"
    monkeypatch.setenv("SPAWNRUN_TEST_MARK", marker)
    pytester.makepyfile(
        """
        import time
        import pytest
        pytestmark = pytest.mark.gpu

        def test_first():
            open("first.started", "w").close()
            time.sleep(2)
            assert False

        @pytest.mark.parametrize("i", range(6))
        def test_later(i):
            time.sleep(30)
        """
    )
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--spawn-jobs", "1"]
    args += ["--spawn-lookahead", "3", "-x"]
    proc = subprocess.Popen(args, cwd=pytester.path, stdout=subprocess.PIPE, text=True)
    if how == "SIGINT":
        deadline = time.monotonic() + 60
        while not (pytester.path / "first.started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert len(_processes_with(marker)) >= 3  # the running child and the booted ones
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert "INTERNALERROR" not in out
    assert ("1 failed" in out) if how == "-x" else ("KeyboardInterrupt" in out)
    time.sleep(0.3)
    assert _processes_with(marker) == []


def test_a_stuck_exit_does_not_delay_another_childs_timeout(pytester):
    # test_leaks_a_thread passes, but its child cannot exit (a non-daemon thread that
    # never ends); test_hangs, running beside it, must still time out on time.
    pytester.makepyfile(
        """
        import threading, time
        import pytest

        @pytest.mark.gpu
        def test_leaks_a_thread():
            threading.Thread(target=time.sleep, args=(300,)).start()

        @pytest.mark.gpu(timeout=2)
        def test_hangs():
            time.sleep(300)
        """
    )
    start = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", "-W", "default")
    wall = time.monotonic() - start
    result.assert_outcomes(passed=1, failed=1, warnings=1)
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.stdout.fnmatch_lines(["*Timeout (>2 s) during call*", f"*{_reports.STUCK_EXIT[:40]}*"])
    # The stuck exit is ended in the background (at 20 s), not waited on by test_hangs;
    # the session's end waits for it.
    assert wall < 40, wall


def test_timeout_counts_from_the_go_not_the_boot(pytester):
    # A slow conftest (3 s at import, in the child) is boot, not test: timeout=2 holds.
    pytester.makeconftest("import time, spawnrun\nif spawnrun.is_child():\n    time.sleep(3)\n")
    pytester.makepyfile("import pytest\n@pytest.mark.gpu(timeout=2)\ndef test_quick():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--spawn-lookahead", "0")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line(NO_INTERNAL)


def test_children_die_with_a_killed_parent(pytester):
    # SIGKILL of the pytest process (a CI runner's hard stop): no cleanup runs in it, yet
    # its hung child must not live on, reparented to init, holding its GPU.
    pytester.makepyfile(
        """
        import os, time
        import pytest

        @pytest.mark.gpu
        def test_hangs():
            with open("child.pid", "w") as f:
                f.write(str(os.getpid()))
            time.sleep(300)
        """
    )
    proc, started = _start_pytest_until(pytester, "child.pid")
    child = int(started)
    proc.kill()
    proc.communicate(timeout=10)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and time.monotonic() < deadline:
        if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.1)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"


PID_1 = ["unshare", "--pid", "--fork", "--mount-proc"]
#: A shell in a mount namespace of its own, with an empty tmpfs over /proc.
NO_PROC = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]


def _unshare_permitted(args: list[str]) -> bool:
    """Whether this machine lets us start a process in namespaces of its own."""
    try:
        done = subprocess.run([*args, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_pytest_as_pid_1(pytester, method):
    # A container's first process (docker run image pytest): the children's parent is
    # pid 1, which is no sign that it died.
    if not _unshare_permitted(PID_1):
        pytest.skip("unshare --pid --fork --mount-proc is not permitted here")
    pytester.makepyfile(
        """
        import os
        import pytest
        import spawnrun

        def test_in_process_is_pid_1():
            assert os.getpid() == 1
            assert spawnrun.call(abs, -3, timeout=60) == 3

        @pytest.mark.gpu
        def test_spawned():
            assert spawnrun.is_child()
            assert spawnrun.call(abs, -3, timeout=60) == 3
        """
    )
    args = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "pytest"]
    args += ["-p", "no:cacheprovider", "--spawn-method", method, "-W", "error"]
    done = subprocess.run(args, cwd=pytester.path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    assert "forkserver is off" not in done.stdout


def test_no_proc_directory_at_all_finds_no_leftovers(monkeypatch):
    # A chroot without even the /proc mount point: nothing to find, nothing raised.
    def missing(path):
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(_runner.os, "scandir", missing)
    assert _runner.group_members(os.getpid()) == []


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_without_proc_says_what_it_cannot_do(pytester, method):
    # A bare container without /proc: leftovers cannot be found, and a template whose
    # threads and CUDA driver cannot be checked is not taken for safe to fork.
    if not _unshare_permitted([*NO_PROC, "mount -t tmpfs none /proc"]):
        pytest.skip("unshare --mount (and a mount over /proc) is not permitted here")
    pytester.makepyfile(
        """
        import subprocess
        import pytest

        @pytest.mark.gpu
        def test_leaves_a_process():
            left = subprocess.Popen(["sleep", "30"])
            open("left.pid", "w").write(str(left.pid))
        """
    )
    run = f"{sys.executable} -m pytest -p no:cacheprovider --spawn-method {method} -rw"
    done = subprocess.run(
        [*NO_PROC, f"mount -t tmpfs none /proc && exec {run}"],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    left = int((pytester.path / "left.pid").read_text())
    with contextlib.suppress(ProcessLookupError):
        os.kill(left, signal.SIGKILL)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "1 passed" in out and "INTERNALERROR" not in out
    assert f"SpawnrunWarning: {_reports.NO_PROC}" in out
    off = "SpawnrunWarning: " + _forkserver.OFF.format(reason=_probe.NO_PROC)
    assert (off in out) == (method == "forkserver")


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_deleted_working_directory_in_the_parent(pytester, method):
    # An in-process test deletes the directory it made current: children still start
    # (the spawn launcher reads the parent's working directory), and the parent stays
    # where the test left it.
    pytester.makepyfile(
        """
        import os, tempfile
        import pytest

        def test_removes_its_cwd():
            gone = tempfile.mkdtemp()
            os.chdir(gone)
            os.rmdir(gone)

        @pytest.mark.gpu
        def test_spawned_after():
            pass

        def test_still_in_the_deleted_directory():
            with pytest.raises(FileNotFoundError):
                os.getcwd()
        """
    )
    start = time.monotonic()
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-method", method, "--spawn-lookahead", "0"
    )
    assert time.monotonic() - start < 20
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.assert_outcomes(passed=3)


@pytest.mark.parametrize("gpus", ["0,1", "0,"], ids=["two-gpus", "one-gpu"])
def test_a_child_that_cannot_be_started_fails_its_test(pytester, gpus):
    # Whatever stops a child from starting (no process or descriptor left) is its
    # test's failure, with the cause; the run goes on. Its device claim goes with it:
    # on one GPU, the next tests would wait for it forever.
    pytester.makeconftest(
        """
        import os
        import spawnrun.launch._starting

        if os.environ.get("SPAWNRUN_CHILD") != "1":
            start = spawnrun.launch._starting.start

            def refuse(item, *args, **kwargs):
                if "cannot" in item.name:
                    raise BlockingIOError(11, "Resource temporarily unavailable")
                return start(item, *args, **kwargs)

            def refuse_early(*args, **kwargs):
                raise BlockingIOError(11, "Resource temporarily unavailable")

            spawnrun.launch._starting.start = refuse
            spawnrun.launch._starting.start_early = refuse_early  # harmless: tests start their own
        """
    )
    pytester.makepyfile(
        """
        import pytest
        pytestmark = pytest.mark.gpu

        def test_cannot_start():
            pass

        def test_starts():
            pass

        def test_starts_too():
            pass
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-lookahead", "2", "--spawn-gpus", gpus, timeout=90
    )
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.stdout.no_fnmatch_line("*with no holder freed*")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [f"{_reports.NOT_STARTED}: BlockingIOError: *Resource temporarily unavailable*"]
    )


def test_a_zygote_that_dies_before_answering_turns_fast_mode_off(pytester):
    pytester.makepyfile(
        diesatimport="import os\nos._exit(3)\n",
        test_x="import pytest\n@pytest.mark.gpu\ndef test_x():\n    pass\n",
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-method", "forkserver", "--spawn-preload", "diesatimport"
    )
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.assert_outcomes(passed=1)
    off = _forkserver.OFF.format(reason="the template ended before answering (exit status 3")
    result.stdout.fnmatch_lines([f"*{off}*"])


def test_a_boot_past_the_boot_limit_without_a_timeout(pytester):
    pytester.makeconftest(
        """
        import os, time
        import spawnrun.driver._jobrecord

        spawnrun.driver._jobrecord.BOOT_LIMIT = 0.5  # in the parent; 600 s really
        if os.environ.get("SPAWNRUN_CHILD") == "1":
            time.sleep(3)
        """
    )
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu
        def test_no_timeout():
            pass

        @pytest.mark.gpu(timeout=0.2)
        def test_shorter_timeout():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--spawn-lookahead", "0")
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.assert_outcomes(errors=2)
    booting = "setup (while the child booted: spawnrun's boot limit)"
    result.stdout.fnmatch_lines([f"{_reports.TIMEOUT} (>0.5 s) during {booting}"] * 2)


def test_a_librarys_own_shutdown_at_exit_is_let_finish(pytester):
    # An engine process the test started is stopped by its library's atexit handler,
    # which takes a few seconds (vLLM's takes about 5 s); ended under it, the engine
    # would leak the shared memory it registered ("resource_tracker: ... leaked").
    pytester.makepyfile(
        """
        import atexit, time
        import multiprocessing as mp
        from multiprocessing import shared_memory
        import pytest

        def engine(stop):
            shm = shared_memory.SharedMemory(create=True, size=1024)
            stop.wait()
            time.sleep(7)  # an orderly shutdown
            shm.close()
            shm.unlink()

        @pytest.mark.gpu(count=0)
        def test_starts_an_engine():
            ctx = mp.get_context("spawn")
            stop = ctx.Event()
            proc = ctx.Process(target=engine, args=(stop,))
            proc.start()

            def shutdown():
                stop.set()
                proc.join()

            atexit.register(shutdown)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "default")
    result.assert_outcomes(passed=1)
    said = result.stdout.str() + result.stderr.str()
    assert "leaked" not in said
    assert "reaped" not in said


# A test that writes into its child's pipe, or closes it, must not stall the parent: every
# read of a child's pipe is non-blocking and every wait bounded. ``pipe`` is the child's
# end of its pipe to the parent.
WIRE_SUITE = """
import os, pickle, struct, sys, time, pytest

def pipe(request):
    return request.config.pluginmanager.get_plugin("spawnrun-child").conn.fileno()

STRAY = struct.pack("!i", 1000) + b"x"  # announces 1000 bytes, sends one

@pytest.mark.gpu(count=0, timeout=3)
def test_closes_its_fds():
    os.closerange(3, 1024)
    time.sleep(60)

@pytest.mark.gpu(count=0, timeout=3)
def test_stray_bytes(request):
    os.write(pipe(request), STRAY)

@pytest.mark.gpu(count=0, timeout=3)
def test_stray_bytes_then_hangs(request):
    os.write(pipe(request), STRAY)
    time.sleep(60)

@pytest.mark.gpu(count=0, timeout=3)
def test_sends_a_class_the_parent_lacks(request, tmp_path):
    (tmp_path / "childonly.py").write_text("class Thing:\\n    pass\\n")
    sys.path.insert(0, str(tmp_path))
    import childonly
    data = pickle.dumps(childonly.Thing())
    os.write(pipe(request), struct.pack("!i", len(data)) + data)
    time.sleep(60)

def test_in_process_after():
    pass
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_what_a_test_does_to_its_pipe_never_stalls_the_parent(pytester, method):
    pytester.makepyfile(test_wire=WIRE_SUITE)
    start = time.monotonic()
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rA", "--spawn-jobs", "4", "--spawn-method", method, timeout=90
    )
    wall = time.monotonic() - start
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.assert_outcomes(passed=1, failed=4)
    unreadable = f"{_reports.DIED} during call: {_reports.UNREADABLE}"
    result.stdout.fnmatch_lines_random(
        [
            f"*{_reports.DIED} during call: {_reports.PIPE_CLOSED}*",
            f"*{unreadable} (a message could not be decoded: invalid load key*); it was killed",
            f"*{unreadable} (a message could not be decoded: it holds a childonly.Thing, "
            "which is not part of spawnrun's protocol*",
            "*Timeout (>3 s) during call*",
        ]
    )
    # Nothing waited for a sleep of the tests (60 s): each ended at its own event.
    assert wall < 40, wall


# What a test records travels as text where pytest writes text: the parent never imports
# the test's libraries for it (a fake torch notes an import in the parent) nor needs its
# modules (childonly is importable in the child only).
RECORDS_SUITE = """
import os, sys, pytest

@pytest.mark.gpu
def test_property_tensor(record_property):
    import torch
    record_property("loss", torch.tensor(0.25))

@pytest.mark.gpu
def test_property_own_class(record_property, tmp_path):
    (tmp_path / "childonly.py").write_text(
        "class Thing:\\n    def __str__(self):\\n        return 'a-thing'\\n"
    )
    sys.path.insert(0, str(tmp_path))
    import childonly
    record_property("r", childonly.Thing())

@pytest.mark.gpu
def test_report_attribute():
    pass
"""
RECORDS_CONFTEST = """
import os, pytest

@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item):
    report = yield
    if os.environ.get("SPAWNRUN_CHILD") == "1" and item.name == "test_report_attribute":
        import torch
        report.extra = [torch.tensor(1)]
    return report
"""
TENSOR_TORCH = """
import os
if os.environ.get("SPAWNRUN_CHILD") != "1":
    open(os.path.join(os.path.dirname(__file__), os.pardir, "torch-in-parent"), "w").close()

class Tensor:
    def __init__(self, value):
        self.value = value
    def __repr__(self):
        return f"tensor({self.value})"

def tensor(value):
    return Tensor(value)
"""


@pytest.mark.parametrize(
    "case, written",
    [
        ("property_tensor", 'name="loss" value="tensor(0.25)"'),
        ("property_own_class", 'name="r" value="a-thing"'),
        ("report_attribute", ""),
    ],
    ids=["property_tensor", "property_own_class", "report_attribute"],
)
def test_values_a_test_records_reach_the_parent_as_text(pytester, case, written):
    (pytester.path / "torch").mkdir()
    (pytester.path / "torch" / "__init__.py").write_text(TENSOR_TORCH)
    pytester.makeconftest(RECORDS_CONFTEST)
    pytester.makepyfile(test_records=RECORDS_SUITE)
    xml = pytester.path / "out.xml"
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
        "-o",
        "junit_family=xunit1",
        "-k",
        f"test_{case}",
        timeout=60,
    )
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.assert_outcomes(passed=1)
    assert not (pytester.path / "torch-in-parent").exists()
    # What junitxml writes of them in-process: their str.
    assert written in xml.read_text()


class _NotOnTheWire(float):
    def __repr__(self) -> str:
        return "odd(1.5)"


def _frame(msg: object) -> bytes:
    data = pickle.dumps(msg)
    return struct.pack("!i", len(data)) + data


def test_a_childs_stream_is_read_without_waiting_and_decoded_without_imports():
    read_end, write_end = os.pipe()
    stream = _stream.Stream()
    frame = _frame(_replies.Phase("call"))
    os.write(write_end, frame + frame[:3])
    assert [m.when for m in stream.read(read_end)] == ["call"]
    assert stream.read(read_end) == [] and not stream.ended  # the rest is not waited for
    os.write(write_end, frame[3:] + _frame(_NotOnTheWire(1.5)))
    assert [m.when for m in stream.read(read_end)] == ["call"]
    assert "test_crashes._NotOnTheWire, which is not part of spawnrun's protocol" in stream.problem
    stream = _stream.Stream()
    os.write(write_end, frame[:5])
    os.close(write_end)
    assert stream.read(read_end) == [] and stream.ended
    assert "ended inside a message" in stream.problem
    os.close(read_end)


def test_values_travel_as_plain_data():
    nested: list[object] = []
    nested.append(nested)
    value = {"n": 1, "t": (_NotOnTheWire(1.5), "s"), 2: [None, b"x"], "self": nested}
    out = proto.plain(value)
    assert out["t"] == ("odd(1.5)", "s") and out["2"] == [None, b"x"]
    assert type(proto.plain(_NotOnTheWire(1.5), str)) is str
    assert pickle.loads(pickle.dumps(out))["n"] == 1  # the structure that held itself ends


EVIDENCE = """
import os, signal, sys, pytest
pytestmark = pytest.mark.gpu(count=0)

def test_a():
    print("A-STDOUT")
    print("A-STDERR", file=sys.stderr)

def test_b():
    print("B-STDOUT")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGSEGV)
"""


@pytest.mark.parametrize(
    "args",
    [["--spawn-scope", "module"], ["--spawn-method", "forkserver", "--spawn-jobs", "1"]],
    ids=["scope-module", "fast-template"],
)
def test_a_crash_shows_only_what_its_own_test_printed(pytester, args):
    """The second test of a scope's child, or of a template's forks, dies: its report
    shows what it printed, never what the test before it printed in the same process
    or template."""
    pytester.makepyfile(test_evidence=EVIDENCE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "B-STDOUT" in out
    assert "A-STDOUT" not in out and "A-STDERR" not in out


def test_a_child_that_boots_unclaimed_is_under_the_boot_limit_at_its_turn(pytester):
    """Children of a file whose boot is known to touch no device boot unclaimed: while
    they boot, the boot limit armed at a test's turn must still hold for them (a boot
    that hangs was waited for without end). The first child boots at once; the later
    ones boot past the limit. (A limit of 0.5 s was too short for the first child's own
    boot on a loaded machine.)"""
    pytester.makeconftest(
        """
        import itertools, os, time
        import spawnrun.driver._jobrecord, spawnrun.launch._runner

        spawnrun.driver._jobrecord.BOOT_LIMIT = 2.5  # in the parent; 600 s really
        # Numbered as the parent starts them: which child first reached this line was a
        # race among children booting at once (the test failed one run in four).
        started = itertools.count()
        start = spawnrun.launch._runner.ChildProcess.__init__

        def numbered(self, spec, env):
            start(self, spec, {**env, "STARTED": str(next(started))})

        spawnrun.launch._runner.ChildProcess.__init__ = numbered
        if os.environ.get("STARTED", "0") != "0":
            time.sleep(6)
        """
    )
    pytester.makepyfile(
        """
        import time
        import pytest

        @pytest.mark.gpu
        @pytest.mark.parametrize("i", range(3))
        def test_it(i):
            time.sleep(0.5)
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-gpus", "0,", "--spawn-lookahead", "2"
    )
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    result.assert_outcomes(passed=1, errors=2)
    booting = "setup (while the child booted: spawnrun's boot limit)"
    result.stdout.fnmatch_lines([f"{_reports.TIMEOUT} (>2.5 s) during {booting}"] * 2)


@pytest.mark.parametrize("touched, warned", [("driver", 0), ("context", 1)])
def test_the_driver_alone_initialized_in_the_parent_gets_no_warning(
    pytester, monkeypatch, touched, warned
):
    """kornia's and timm's collection ask ``torch.cuda.is_available()``: the CUDA driver
    is initialized in the parent (``cuInit``) but no context is made and no memory held,
    and spawnrun never forks the parent; the warning that said it held "its context
    (typically 500 MiB or more)" came on every run of such a suite. A context still
    gets it. (The driver is asked of libcuda, which CI has not: the probe is set here.)"""
    from spawnrun.driver import _cudawatch
    from spawnrun.proc import _probe

    monkeypatch.setattr(_probe, "cuda_driver_initialized", lambda: True)
    monkeypatch.setattr(_probe, "boot_touch", lambda: touched)
    monkeypatch.setattr(_cudawatch, "_warned", False)
    pytester.makepyfile("import pytest\n@pytest.mark.gpu(count=0)\ndef test_x():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=warned)
