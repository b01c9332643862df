"""spawnrun.call: a function run in a fresh spawn child, from a test, a spawned test, a script."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import spawnrun
from spawnrun.calls import _call
from spawnrun.calls import _outcome

NO_INTERNAL = "*INTERNALERROR*"
ROOT = Path(__file__).resolve().parent.parent

INNER = """
import os
import signal
import sys
import threading
import time

import pytest
import spawnrun


class Odd(Exception):
    # Pickles as Odd(a) and cannot be rebuilt from that: the caller gets a CallError.
    def __init__(self, a, b):
        super().__init__(a)


def deep(n):
    raise ValueError(f"boom {n}")


def segv():
    print("last words")
    os.kill(os.getpid(), signal.SIGSEGV)


def sleepy():
    time.sleep(300)


@spawnrun.in_child
def bare(x):
    return x, os.getpid(), os.environ.get("SPAWNRUN_CHILD")


@spawnrun.in_child(devices=5, timeout=60)
def with_options():
    return os.environ.get("CUDA_VISIBLE_DEVICES"), "pytest" in sys.modules


def raise_odd(a):
    raise Odd(a, 2)


def check_round_trip(capsys):
    base = {"n": 40}
    def add(x, *, y):
        print("printed in the child")
        return base["n"] + x + y, os.getpid(), os.environ.get("SPAWNRUN_CHILD")
    total, pid, marked = spawnrun.call(add, 1, y=1)
    assert (total, marked) == (42, "1") and pid != os.getpid()
    assert "printed in the child" in capsys.readouterr().out
    x, pid, marked = bare(7)
    assert (x, marked) == (7, "1") and pid != os.getpid()
    # The child imports what the function needs, not pytest.
    assert with_options() == ("5", False)
    with pytest.raises(spawnrun.CallError, match="test_inner.raise_odd raised test_inner.Odd"):
        spawnrun.call(raise_odd, 1)


@pytest.mark.parametrize("devices, expected", [
    (None, "7"), ("2", "2"), (1, "1"), ([0, "GPU-ab"], "0,GPU-ab"), ((), ""),
])
def test_devices(monkeypatch, devices, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    assert spawnrun.call(visible, "now", devices=devices) == expected


def visible(when):
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_from_parent(capsys):
    assert not spawnrun.is_child()
    check_round_trip(capsys)


@pytest.mark.gpu(count=0)
def test_nested_in_spawned_test(capsys):
    assert spawnrun.is_child()
    check_round_trip(capsys)


def test_raises():
    spawnrun.call(deep, 7)


def answer():
    return 42


def test_call_alone_runs_the_function():
    # No arguments, no options: it runs now (it is not a decorator).
    assert spawnrun.call(answer) == 42


def make_lock():
    return threading.Lock()


def test_result_that_cannot_be_sent_back():
    with pytest.raises(spawnrun.CallError) as excinfo:
        spawnrun.call(make_lock)
    assert str(excinfo.value) == (
        "spawnrun.call: test_inner.make_lock returned, but its result (a _thread.lock) could "
        "not be sent back to the caller: pickling it failed with "
        "TypeError: cannot pickle '_thread.lock' object"
    )
    assert not getattr(excinfo.value, "__notes__", None)  # nothing was raised in the child


def test_crashes():
    try:
        spawnrun.call(segv, timeout=1e300)
    except spawnrun.CallFailed as exc:
        assert isinstance(exc, spawnrun.CallCrashed)
        assert exc.exitcode == -signal.SIGSEGV
        assert "in segv" in exc.stacks and "last words" in exc.output
        raise


@pytest.mark.gpu(count=0)
def test_times_out():
    spawnrun.call(sleepy, timeout=1)
"""


def test_call_from_parent_and_spawned_test(pytester, monkeypatch):
    monkeypatch.delenv("SPAWNRUN_CHILD", raising=False)
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=9, failed=3)
    result.stdout.no_fnmatch_line(NO_INTERNAL)
    # The child's traceback, with its file and source lines, is the exception's cause.
    result.stdout.fnmatch_lines(
        [
            "*_ test_raises _*",
            "*ChildTraceback*",
            '*File "*test_inner.py", line *, in deep',
            '*raise ValueError(f"boom {n}")',
            "E*ValueError: boom 7",
            "*spawnrun.call: raised in the child running test_inner.deep*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_crashes _*",
            "E*spawnrun.CallCrashed: spawnrun.call: the child running test_inner.segv "
            "was killed by signal SIGSEGV (11) before returning",
            f"E*--- {_outcome.STACKS} ---",
            'E*File "*test_inner.py", line * in segv',
            f"E*--- {_outcome.OUTPUT} ---",
            "E*last words",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_times_out _*",
            "E*spawnrun.CallTimeout: spawnrun.call: test_inner.sleepy did not return within the "
            "timeout (1 s); killed",
            f"E*--- {_outcome.STACKS} ---",
            'E*File "*test_inner.py", line * in sleepy',
        ]
    )


SCRIPT = """
import atexit
import os
import sys
import time

import spawnrun

# No __main__ guard: the children must not run this body again.
print("script body ran", flush=True)
scale = 3


def triple(x):
    atexit.register(lambda: print("atexit ran in the child"))
    # Left running: the call's end kills it.
    sleeper = os.posix_spawnp("sleep", ["sleep", "300"], dict(os.environ))
    return x * scale, os.environ["SPAWNRUN_CHILD"], sleeper


@spawnrun.in_child
def bare():
    return os.getpid()


@spawnrun.in_child(devices=[1], timeout=60)
def with_options():
    return os.environ["CUDA_VISIBLE_DEVICES"]


value, marked, sleeper = spawnrun.call(triple, 14, timeout=10**400)
print("result", value, marked)


def state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


# SIGKILL takes effect a moment after it is sent; a zombie waits for init to reap it.
deadline = time.monotonic() + 5
while state(sleeper) not in ("Z", "X", "gone") and time.monotonic() < deadline:
    time.sleep(0.05)
print("sleeper", "ended" if state(sleeper) in ("Z", "X", "gone") else "runs")
assert bare() != os.getpid()
print("decorated", with_options())
"""


def test_script_main_without_guard(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    env.pop("SPAWNRUN_CHILD", None)
    out = subprocess.run(
        [sys.executable, "-X", "dev", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines.count("script body ran") == 1, out.stdout
    assert "result 42 1" in lines
    # The child's own output (its atexit handler's too) comes back to the caller's stdout.
    assert "atexit ran in the child" in lines
    # What the function left running was killed when the call ended.
    assert "sleeper ended" in lines
    assert "decorated 1" in lines
    # -X dev: no ResourceWarning or other complaint, in the caller or the children.
    assert out.stderr == ""


def test_missing_cloudpickle_names_the_extra(tmp_path):
    script = tmp_path / "nocloudpickle.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            sys.modules["cloudpickle"] = None  # import cloudpickle now fails
            import spawnrun
            assert "spawnrun.calls._call" not in sys.modules  # lazy
            try:
                spawnrun.call(len, [1])
            except ImportError as exc:
                print(type(exc).__name__, exc)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == f"ImportError {_call.INSTALL_HINT}", out.stdout + out.stderr
    assert 'pip install "spawnrun[call]"' in _call.INSTALL_HINT


def _never_run() -> None:
    raise AssertionError("a call with invalid arguments must not start a child")


@pytest.mark.parametrize(
    "options, error, words",
    [
        ({"devices": -1}, ValueError, "devices= item -1 is negative"),
        ({"devices": True}, TypeError, "not bool"),
        ({"devices": {0, 1}}, TypeError, "not set"),
        ({"devices": "0,,1"}, ValueError, "devices= item '' is not a device"),
        ({"devices": [1.5]}, TypeError, "devices= item 1.5 is not an int or a str"),
        ({"devices": ["0 1"]}, ValueError, "is not a device"),
        ({"devices": "banana"}, ValueError, "devices= item 'banana' is not a device"),
        ({"devices": ["-1"]}, ValueError, "devices= item '-1' is not a device"),
        ({"devices": "GPU-"}, ValueError, "devices= item 'GPU-' is not a device"),
        ({"devices": [0, 0]}, ValueError, "devices= lists device 0 more than once"),
        ({"devices": "1,GPU-ab,1"}, ValueError, "devices= lists device 1 more than once"),
        ({"timeout": -1}, ValueError, "timeout=-1 is not a number of seconds >= 0"),
        ({"timeout": math.nan}, ValueError, "timeout=nan"),
        ({"timeout": "5"}, TypeError, "timeout= takes seconds, not str"),
        ({"timeout": True}, TypeError, "not bool"),
    ],
)
def test_invalid_options_are_refused_before_any_child(options, error, words):
    # Validation happens before anything is pickled or started, so this runs in-process.
    pattern = f"{words}".replace("(", r"\(")
    with pytest.raises(error, match=f"^spawnrun.call: .*{pattern}"):
        spawnrun.call(_never_run, **options)
    with pytest.raises(error, match=f"^spawnrun.in_child: .*{pattern}"):
        spawnrun.in_child(**options)
    with pytest.raises(error, match=f"^spawnrun.in_child: .*{pattern}"):
        spawnrun.in_child(_never_run, **options)


def test_not_callable_and_no_function():
    with pytest.raises(TypeError, match="is not callable"):
        spawnrun.call(42, 1)
    with pytest.raises(TypeError, match="is not callable"):
        spawnrun.in_child(42)  # type: ignore[call-overload]
    # Options without a function: call says where the decorator is.
    for options in ({}, {"devices": 0, "timeout": 5}):
        with pytest.raises(TypeError, match=r"no function to call.*@spawnrun.in_child"):
            spawnrun.call(**options)
    with pytest.raises(TypeError):
        spawnrun.in_child(_never_run, 1)  # type: ignore[call-overload]


def test_call_always_runs_and_in_child_runs_only_when_called(monkeypatch):
    # The silent pass: `assert spawnrun.call(gpu_is_free)` must run gpu_is_free, whatever
    # arguments it gets; decorating runs nothing until the decorated function is called.
    runs: list[tuple[object, ...]] = []

    def fake_run(fn, args, kwargs, visible, limit):
        runs.append((fn, args, kwargs, visible, limit))
        return "ran"

    monkeypatch.setattr(_call, "_run", fake_run)

    def gpu_is_free() -> bool:
        raise AssertionError("runs in the child, not here")

    assert spawnrun.call(gpu_is_free) == "ran"
    assert runs == [(gpu_is_free, (), {}, None, None)]
    assert spawnrun.call(gpu_is_free, 1, timeout=5, key="v") == "ran"
    assert runs[-1] == (gpu_is_free, (1,), {"key": "v"}, None, 5.0)
    runs.clear()
    bare = spawnrun.in_child(gpu_is_free)
    with_options = spawnrun.in_child(devices=[0, "GPU-ab"], timeout=60)(gpu_is_free)
    assert runs == [] and bare.__name__ == with_options.__name__ == "gpu_is_free"
    assert bare(3) == with_options(x=1) == "ran"
    assert runs == [
        (gpu_is_free, (3,), {}, None, None),
        (gpu_is_free, (), {"x": 1}, "0,GPU-ab", 60.0),
    ]
    assert "in_child" in spawnrun.__all__ and spawnrun.in_child is _call.in_child


@pytest.mark.parametrize(
    "timeout, limit",
    [(None, None), (0, None), (math.inf, None), (10**400, None), (1e300, 1e300), (2, 2.0)],
)
def test_timeout_values(timeout, limit):
    assert _call._limit(timeout) == limit


def test_child_dies_with_its_caller(tmp_path, monkeypatch):
    """...and leaves nothing in the temporary directory (its output and stacks files
    lived there until the caller, which cleans up, was killed)."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    script = tmp_path / "caller.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time
            import spawnrun

            def hang(path):
                # Its own session, so the caller can end whatever it starts.
                with open(path, "w") as f:
                    f.write(f"{os.getpid()} {os.getsid(0) == os.getpid()}")
                time.sleep(300)

            spawnrun.call(hang, "child.txt", timeout=600)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    marker = tmp_path / "child.txt"
    with subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env) as caller:
        deadline = time.monotonic() + 60
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline and caller.poll() is None
            time.sleep(0.05)
        pid, own_session = marker.read_text().split()
        caller.kill()  # SIGKILL: the caller gets no chance to clean up
    assert own_session == "True"
    child = psutil.Process(int(pid))
    try:
        if child.status() != psutil.STATUS_ZOMBIE:  # a zombie is dead, waiting for init
            child.wait(timeout=10)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        child.kill()
        pytest.fail("the child outlived its SIGKILLed caller")
    assert list(temp.iterdir()) == []
