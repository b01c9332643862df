"""Packing end to end, on declared devices: who shares a device, within what, and why.

Every test of an inner suite writes a stamp (its start, end, devices and budget), from
which concurrency is read; the devices are declared (``--spawn-gpus``) with a declared
memory (``--spawn-gpu-memory``), as on a machine without GPUs.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path
from xml.etree import ElementTree

import pytest
import vendor_standins as standins

from spawnrun.child._budget import SECTION
from spawnrun.devices._packing import RESERVE

GiB = 2**30

STAMP = """
import json, os, time

def stamp(name, body=1.2):
    start = time.time()
    time.sleep(body)
    with open(os.environ["STAMPS"], "a") as f:
        f.write(json.dumps({
            "name": name, "start": start, "end": time.time(), "pid": os.getpid(),
            "devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "budget": int(os.environ.get("SPAWNRUN_GPU_BUDGET", 0)),
        }) + "\\n")
"""


def read_stamps(path: Path) -> dict[str, dict[str, object]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return {s["name"]: s for s in map(json.loads, lines)}


def overlapping(stamps: dict[str, dict[str, object]], name: str) -> list[str]:
    me = stamps[name]
    return sorted(
        n
        for n, s in stamps.items()
        if n != name and s["start"] < me["end"] and me["start"] < s["end"]  # type: ignore[operator]
    )


def most_at_once(stamps: dict[str, dict[str, object]], names: list[str]) -> tuple[int, int]:
    """The most tests of ``names`` running at one instant, and their budgets' sum."""
    best = (0, 0)
    for name in names:
        t = stamps[name]["start"]
        running = [s for n, s in stamps.items() if n in names and s["start"] <= t < s["end"]]  # type: ignore[operator]
        load = sum(int(s["budget"]) + RESERVE for s in running)  # type: ignore[call-overload]
        best = max(best, (len(running), load))
    return best


@pytest.fixture
def stamps(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = pytester.path / "stamps.jsonl"
    monkeypatch.setenv("STAMPS", str(path))
    pytester.makepyfile(stamping=STAMP)
    return path


SUITE = """
import pytest
from stamping import stamp

@pytest.mark.parametrize("i", range(5))
@pytest.mark.gpu(memory="3GiB")
def test_budget(i):
    stamp(f"budget{i}")

@pytest.mark.gpu(exclusive=True)
def test_exclusive():
    stamp("exclusive")

@pytest.mark.gpu
def test_no_budget():
    stamp("no_budget")

@pytest.mark.parametrize("j", range(2))
@pytest.mark.gpu(memory=3)
def test_after(j):
    stamp(f"after{j}")

@pytest.mark.gpu(memory="11GiB")
def test_too_large():
    stamp("too_large")
"""


@pytest.mark.parametrize(
    "args",
    [
        # Two booted ahead: the two budgeted tests after the exclusive pair get their
        # children at once, so they always meet (with one, the second may still boot
        # when the first ends, on a loaded machine).
        pytest.param(["--spawn-lookahead", "2"], id="spawn"),
        pytest.param(["--spawn-method", "forkserver", "--spawn-lookahead", "2"], id="forkserver"),
        pytest.param(["-n", "2"], id="xdist"),
    ],
)
def test_budgeted_tests_share_a_device_within_its_memory(pytester, stamps, args):
    pytester.makepyfile(test_suite=SUITE)
    # One 10 GiB device: two 3 GiB budgets and their 1 GiB reserves fit, three do not.
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rs", "--spawn-gpus", "GPU-a", "--spawn-gpu-memory",
        "10GiB", "--spawn-per-gpu", "4", *args,
    )  # fmt: skip
    result.assert_outcomes(passed=9, skipped=1)
    result.stdout.fnmatch_lines(
        ["*needs 11.0 GiB of GPU memory (memory='11GiB'), more than the device's 10.0 GiB*"]
    )
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    seen = read_stamps(stamps)
    assert "too_large" not in seen
    budgeted = [n for n in seen if n.startswith(("budget", "after"))]
    at_once, load = most_at_once(seen, budgeted)
    if "-n" in args:
        # Two workers, one child each: whether two budgeted tests meet depends on which
        # tests xdist hands each worker and when (under load they may not); never more.
        assert 1 <= at_once <= 2, seen
    else:
        assert at_once == 2, seen  # they shared the device, never beyond its memory
    assert load <= 10 * GiB
    assert {seen[n]["budget"] for n in budgeted} == {3 * GiB}
    # Alone means alone: nothing overlapped the exclusive or the unbudgeted test.
    assert overlapping(seen, "exclusive") == []
    assert overlapping(seen, "no_budget") == []
    assert seen["exclusive"]["budget"] == 0
    if "-n" not in args:
        # (The alone tests wait, passed over, while budgeted ones run: the order is
        # test_tests_that_need_the_device_alone_wait_for_one_drain's to check.)
        # Who met whom depends on timing (the fifth budgeted test may run on its own);
        # the summary accounts for all seven, and at least every pair the stamps saw.
        line = re.search(
            r"packing: (\d+) shared a GPU within their budgets; "
            r"(?:(\d+) with a budget found no neighbour; )?2 ran alone \(",
            result.stdout.str(),
        )
        assert line, result.stdout.str()
        shared, alone = int(line[1]), int(line[2] or 0)
        assert shared + alone == 7
        assert shared >= sum(1 for n in budgeted if set(overlapping(seen, n)) & set(budgeted))


@pytest.mark.parametrize(
    "marker, message",
    [
        ('memory="lots"', "expected a memory size > 0 such as 6GiB"),
        ("memory=-1", "expected a memory size > 0"),
        ('memory="2GiB", exclusive=True', "memory= and exclusive=True contradict"),
        ('exclusive="yes"', "expected True or False"),
    ],
)
def test_a_bad_budget_is_a_usage_error_naming_the_test(pytester, marker, message):
    pytester.makepyfile(
        test_bad=f"import pytest\n\n@pytest.mark.gpu({marker})\ndef test_it():\n    pass\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*test_bad.py::test_it: @pytest.mark.gpu*{message}*"])


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--spawn-gpu-memory", "banana", "command line option --spawn-gpu-memory"),
        ("--spawn-pack", "sometimes", "expected off, declared or auto"),
        ("--spawn-per-gpu", "0", "expected a whole number >= 1"),
        ("--spawn-memory", "3 parsecs", "command line option --spawn-memory"),
    ],
)
def test_a_bad_packing_option_is_a_usage_error(pytester, option, value, message):
    pytester.makepyfile(test_ok="def test_it():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", option, value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


@pytest.mark.parametrize(
    "args, shared",
    [
        # No record (no cache): a first run's share of each device (80 GiB / per_gpu).
        pytest.param([], True, id="first-runs-share"),
        pytest.param(["--spawn-pack", "declared"], False, id="no-budget-alone"),
        pytest.param(["--spawn-memory", "1GiB"], True, id="declared-default-budget"),
        pytest.param(["--spawn-pack", "off", "--spawn-memory", "1GiB"], False, id="pack-off"),
    ],
)
def test_unmarked_tests_under_spawn_gpu_hold_every_device(pytester, stamps, args, shared):
    """--spawn-gpu alone: a test sees every device, so it holds each: alone unless told,
    or on a first run's share under ``auto`` where it has no peak recorded."""
    pytester.makepyfile(
        test_plain="from stamping import stamp\n\n"
        "def test_a():\n    stamp('a')\n\ndef test_b():\n    stamp('b')\n\n"
        "def test_c():\n    stamp('c')\n"
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-gpu", "--spawn-gpus", "0,1",
        "--spawn-gpu-memory", "80GiB", "--spawn-jobs", "3", *args,
    )  # fmt: skip
    result.assert_outcomes(passed=3)
    seen = read_stamps(stamps)
    assert {s["devices"] for s in seen.values()} == {None}  # the parent's devices
    assert bool(overlapping(seen, "b")) is shared, seen


@pytest.mark.parametrize(
    "measured, unmarked",
    [(True, False), (False, False), (True, True)],
    ids=["torch-measured", "unmeasured", "spawn-gpu-fast"],
)
def test_learned_budgets_pack_tests_on_the_second_run(pytester, stamps, measured, unmarked):
    """A peak torch measured (a fake torch: 5 MiB reserved) packs the tests on the
    second run. Where nothing could measure one (no torch view, no NVML here), nothing is
    learned: the second run keeps them alone (it learned a peak of 0 and shared them on a
    256 MiB budget, which a JAX test could overrun). Unmarked tests under --spawn-gpu in
    fast mode too: a file's template forks them, and the second run's file had one
    template only (one way per device, as for tests alone), which ran them one after
    another within their budgets (timm's own tests on the H200, run 37)."""
    if measured:
        write_fake_torch(pytester)
    use = "import torch\n                torch.cuda.init()\n" if measured else ""
    pytester.makepyfile(
        test_learn=textwrap.dedent(
            f"""
            import pytest
            from stamping import stamp

            @pytest.mark.parametrize("i", range(4))
            {"" if unmarked else "@pytest.mark.gpu"}
            def test_it(i):
                {use}
                stamp(f"t{{i}}")
            """
        )
    )
    args = ["--spawn-gpus", "GPU-a", "--spawn-gpu-memory", "80GiB", "--spawn-pack", "auto"]
    if unmarked:
        args += ["--spawn-gpu", "--spawn-method", "forkserver", "--spawn-jobs", "4"]
        args += ["--spawn-per-gpu", "4"]
    first = pytester.runpytest_subprocess(*args)
    first.assert_outcomes(passed=4)
    seen = read_stamps(stamps)
    if unmarked:  # a first run's share of the device: a quarter, less its reserve
        first.stdout.no_fnmatch_line("*ran alone*")
        assert {s["budget"] for s in seen.values()} == {19 * GiB}
    else:
        first.stdout.fnmatch_lines(
            ["packing: 0 shared a GPU*; 4 ran alone (no peak recorded yet: 4)"]
        )
        assert all(overlapping(seen, n) == [] for n in seen)
    stamps.unlink()
    second = pytester.runpytest_subprocess(*args)
    second.assert_outcomes(passed=4)
    seen = read_stamps(stamps)
    if measured:
        second.stdout.fnmatch_lines(["packing: 4 shared a GPU within their budgets"])
        assert any(overlapping(seen, n) for n in seen)
        assert {s["budget"] for s in seen.values()} == {263 * 2**20}  # 5 MiB x 1.25 + 256
    else:
        second.stdout.fnmatch_lines(
            ["packing: 0 shared a GPU*; 4 ran alone (no peak recorded yet: 4)"]
        )
        assert all(overlapping(seen, n) == [] for n in seen)


FAKE_TORCH = {
    "torch/__init__.py": "from torch import cuda\nOutOfMemoryError = cuda.OutOfMemoryError\n",
    "torch/cuda.py": textwrap.dedent(
        """
        import json, os
        _initialized = False
        _queued = []
        fractions = []

        class OutOfMemoryError(RuntimeError):
            pass

        class _Props:
            total_memory = 8 * 2**30

        def is_initialized():
            return _initialized

        def _lazy_call(fn):
            if _initialized:
                fn()
            else:
                _queued.append(fn)

        def _lazy_init():
            init()

        def init():
            global _initialized
            if _initialized:
                return
            _initialized = True
            for fn in _queued:
                fn()

        def device_count():
            return 1

        def get_device_properties(i):
            return _Props()

        def set_per_process_memory_fraction(fraction, device):
            assert _initialized, "the cap initialized CUDA"
            fractions.append((fraction, device))

        def max_memory_reserved(i):
            return 5 * 2**20

        def synchronize(device=None):
            assert _initialized

        def empty_cache():
            pass
        """
    ),
}


def write_fake_torch(pytester: pytest.Pytester) -> None:
    """FAKE_TORCH in the inner suite's folder, ahead of the real torch on sys.path."""
    for name, text in FAKE_TORCH.items():
        path = pytester.path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    "where, args",
    [
        pytest.param("conftest", ["--spawn-method", "forkserver"], id="conftest-forkserver"),
        pytest.param("test", [], id="test-body-spawn"),
    ],
)
def test_the_budget_caps_torch_when_its_cuda_comes_up_and_not_before(pytester, where, args):
    write_fake_torch(pytester)
    pytester.makeconftest("import torch\n" if where == "conftest" else "")
    pytester.makepyfile(
        test_cap=textwrap.dedent(
            """
            import pytest

            @pytest.mark.gpu(memory="1GiB")
            def test_capped_at_init():
                import torch
                assert not torch.cuda.is_initialized() and torch.cuda.fractions == []
                torch.cuda.init()
                assert torch.cuda.fractions == [(0.125, 0)]

            @pytest.mark.gpu(exclusive=True)
            def test_alone_uncapped():
                import torch
                torch.cuda.init()
                assert torch.cuda.fractions == []

            @pytest.mark.gpu(memory="1GiB")
            def test_out_of_memory():
                import torch
                torch.cuda.init()
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            """
        )
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-gpus", "GPU-a", "--spawn-gpu-memory", "8GiB", *args
    )
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            f"*- {SECTION} -*",
            "this test ran with a GPU memory budget of 1.0 GiB per device (memory='1GiB'), *",
            "its peak: 5 MiB reserved by torch",
        ]
    )
    result.stdout.no_fnmatch_line("*INTERNALERROR*")


def test_peaks_of_tests_whose_file_is_gone_are_dropped(pytester):
    """The peaks cache only grew: a file's records outlived the file."""
    write_fake_torch(pytester)
    body = (
        "import pytest\n\n@pytest.mark.gpu\ndef test_it():\n"
        "    import torch\n    torch.cuda.init()\n"
    )
    pytester.makepyfile(test_gone=body, test_kept=body)
    args = ["--spawn-gpus", "GPU-a", "--spawn-gpu-memory", "80GiB", "--spawn-pack", "auto"]
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=2)
    peaks = pytester.path / ".pytest_cache" / "v" / "spawnrun" / "peaks"
    assert sorted(json.loads(peaks.read_text())) == [
        "test_gone.py::test_it",
        "test_kept.py::test_it",
    ]
    (pytester.path / "test_gone.py").unlink()
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=1)
    assert sorted(json.loads(peaks.read_text())) == ["test_kept.py::test_it"]


def test_peaks_of_tests_a_whole_file_no_longer_yields_are_dropped(pytester):
    """The peaks cache only grew: a renamed test's record outlived it. Records of tests
    that a run did not collect, but its file still has, stay (a node id, -k)."""
    write_fake_torch(pytester)
    body = (
        "import pytest\n\n@pytest.mark.gpu\ndef test_{}():\n"
        "    import torch\n    torch.cuda.init()\n"
    )
    pytester.makepyfile(test_a=body.format("one") + "\n\n" + body.format("two"))
    args = ["--spawn-gpus", "GPU-a", "--spawn-gpu-memory", "80GiB", "--spawn-pack", "auto"]
    peaks = pytester.path / ".pytest_cache" / "v" / "spawnrun" / "peaks"
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=2)
    both = ["test_a.py::test_one", "test_a.py::test_two"]
    assert sorted(json.loads(peaks.read_text())) == both
    pytester.runpytest_subprocess("test_a.py::test_one", *args).assert_outcomes(passed=1)
    pytester.runpytest_subprocess("-k", "one", *args).assert_outcomes(passed=1, deselected=1)
    assert sorted(json.loads(peaks.read_text())) == both
    pytester.makepyfile(test_a=body.format("one") + "\n\n" + body.format("three"))
    pytester.runpytest_subprocess("-k", "one", *args).assert_outcomes(passed=1, deselected=1)
    assert sorted(json.loads(peaks.read_text())) == ["test_a.py::test_one"]


def test_short_tests_are_backfilled_while_a_large_budget_waits_on_a_later_run(pytester, stamps):
    """A test with a large budget waits for a long budgeted one to leave room; short
    budgeted tests after it waited too (issue 25). On a later run, with their durations
    recorded, they run beside the long test meanwhile and end before it; the large test
    still never shares beyond the device's memory. On the first run nothing is recorded:
    the order is pytest's."""
    pytester.makepyfile(
        test_drain="""
        import pytest
        from stamping import stamp

        @pytest.mark.gpu(memory="2GiB")
        def test_a_long():
            stamp("long", 7.0)

        @pytest.mark.gpu(memory="77GiB")
        def test_b_large():
            stamp("large", 0.2)

        @pytest.mark.parametrize("i", range(2))
        @pytest.mark.gpu(memory="2GiB")
        def test_c_short(i):
            stamp(f"short{i}", 0.2)
        """
    )
    args = ["--spawn-gpus", "GPU-a", "--spawn-gpu-memory", "80GiB", "--spawn-jobs", "3"]
    shorts = ["short0", "short1"]
    for run in ("first", "later"):
        stamps.unlink(missing_ok=True)
        pytester.runpytest_subprocess(*args).assert_outcomes(passed=4)
        seen = read_stamps(stamps)
        assert overlapping(seen, "large") == [], seen  # 77 GiB leaves room for no other budget
        if run == "first":
            assert all(seen[s]["start"] > seen["large"]["end"] for s in shorts), seen
        else:
            assert all(seen[s]["end"] < seen["long"]["end"] for s in shorts), seen
    durations = pytester.path / ".pytest_cache" / "v" / "spawnrun" / "durations"
    recorded = json.loads(durations.read_text())
    assert 7.0 <= recorded["test_drain.py::test_a_long"] < 30, recorded


@pytest.mark.parametrize(
    "extra",
    [[], ["--spawn-method", "forkserver"], ["--maxfail", "5"]],
    ids=["gathered", "gathered-fast", "with-maxfail"],
)
def test_tests_that_need_the_device_alone_wait_for_one_drain(pytester, stamps, extra):
    """Each exclusive or unbudgeted test drained the device at its turn: nothing new
    started until every running test had left (issue 25). Now they wait, passed over,
    while the budgeted tests after them run, and then run one after another in one
    drain, each alone; on the first run, with nothing recorded; in fast mode too, where
    a file's alone tests are forked from a template that collected it. Where a failure
    stops the session (``--maxfail``), pytest's order is kept: what it reached would
    still run."""
    pytester.makepyfile(
        test_mixed="""
        import pytest
        from stamping import stamp

        @pytest.mark.gpu(memory="2GiB")
        def test_a():
            stamp("a", 1.5)

        @pytest.mark.gpu(exclusive=True)
        def test_b_exclusive():
            stamp("exclusive", 0.2)

        @pytest.mark.gpu(memory="2GiB")
        def test_c():
            stamp("c", 0.2)

        @pytest.mark.gpu
        def test_d_bare():
            stamp("bare", 0.2)

        @pytest.mark.gpu(memory="2GiB")
        def test_e():
            stamp("e", 0.2)
        """
    )
    args = ["-p", "no:cacheprovider", "--spawn-gpus", "GPU-a", "--spawn-gpu-memory", "80GiB"]
    result = pytester.runpytest_subprocess(*args, "--spawn-jobs", "3", *extra)
    result.assert_outcomes(passed=5)
    seen = read_stamps(stamps)
    alone, budgeted = ["exclusive", "bare"], ["a", "c", "e"]
    for name in alone:
        assert overlapping(seen, name) == [], seen  # alone, as declared
    if "--maxfail" in extra:
        assert seen["c"]["start"] > seen["exclusive"]["end"], seen
    else:
        last_budgeted = max(seen[b]["end"] for b in budgeted)
        assert all(seen[a]["start"] > last_budgeted for a in alone), seen
        assert seen["exclusive"]["start"] < seen["bare"]["start"], seen


@pytest.mark.parametrize("method", ["spawn", "forkserver", "forkserver-template"])
def test_a_test_that_fails_on_its_learned_budget_runs_again_alone(
    pytester, stamps, monkeypatch, method
):
    """A learned budget is a guess: a test whose memory grew past it failed (torch's cap)
    on the run after the one that learned it, where in-process it passes. It now runs
    again at once, alone, and that run's outcome and peak count; the summary says so.
    Also where a file's template forked it (tests of one budget, one at a time): the
    driver hands a template to the dispatcher as a scope, whose tests never ran again,
    and it failed; it now runs again in a child of its own."""
    write_fake_torch(pytester)
    twice = method == "forkserver-template"
    pytester.makepyfile(
        test_grows="""
        import os
        import pytest
        from stamping import stamp

        @pytest.mark.gpu
        @pytest.mark.parametrize("n", [1, 2] if os.environ.get("TWICE") else [1])
        def test_grows(n):
            import torch
            torch.cuda.init()
            if os.environ.get("SPAWNRUN_GPU_BUDGET"):  # as if it now needed more
                raise torch.OutOfMemoryError("CUDA out of memory (pretend)")
            stamp(f"grows{n}", 0.1)

        @pytest.mark.gpu
        def test_steady():
            import torch
            torch.cuda.init()
            stamp("steady", 0.1)
        """
    )
    args = ["--spawn-gpus", "GPU-a", "--spawn-gpu-memory", "80GiB", "--spawn-pack", "auto"]
    args += ["--spawn-method", method.split("-")[0], "--junitxml=out.xml"]
    if twice:  # --spawn-gpu: budgeted tests of a file (of one budget) share its template
        monkeypatch.setenv("TWICE", "1")
        args += ["--spawn-jobs", "1", "--spawn-gpu"]
        test_file = pytester.path / "test_grows.py"
        test_file.write_text(test_file.read_text().replace("@pytest.mark.gpu\n", ""))
    tests = ["test_grows.py::test_grows[1]", "test_grows.py::test_grows[2]"][: 1 + twice]
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=2 + twice)  # learns: alone
    second = pytester.runpytest_subprocess(*args, "-rA")
    second.assert_outcomes(passed=2 + twice)
    said = "test ran" if len(tests) == 1 else "tests ran"
    assert (
        f"{len(tests)} {said} out of memory (or skipped for want of it) on a guessed budget, "
        "or beside one, or held more than it over its process tree, and ran again alone "
        f"(the second run's outcome counts; its peak is recorded): {', '.join(tests)}"
    ) in second.stdout.str()
    # Both runs are shown (issue 56): the first run's failure, then the one that counts.
    second.stdout.fnmatch_lines(
        ["*first runs of tests that ran again*", "*out of memory (pretend)*"]
    )
    seen = read_stamps(stamps)
    assert [seen[f"grows{n}"]["budget"] for n in (1, 2)[: 1 + twice]] == [0] * len(tests)
    xml = (pytester.path / "out.xml").read_text()
    assert xml.count('classname="test_grows" name="test_grows[1]"') == 1, xml


FIRST_RUN = """
import os
import pytest
from stamping import stamp

@pytest.mark.parametrize("i", range(3))
def test_light(i):
    stamp(f"light{i}")

def test_needs_more():
    import torch
    torch.cuda.init()
    if os.environ.get("SPAWNRUN_GPU_BUDGET"):  # more than a share: torch's cap stops it
        raise torch.OutOfMemoryError("CUDA out of memory (pretend)")
    stamp("needs_more", 0.1)

def test_skips_where_crowded():
    import torch
    torch.cuda.init()
    if os.environ.get("SPAWNRUN_GPU_BUDGET"):  # as a test that reads the free memory
        pytest.skip("too little memory free (pretend)")
    stamp("crowded", 0.1)

def test_skips_before_any_device():
    pytest.skip("not on this platform")
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_first_run_shares_the_device_and_a_test_it_does_not_fit_runs_again_alone(
    pytester, stamps, monkeypatch, method
):
    """With no peak recorded, the tests --spawn-gpu spawns share the device on a first
    run, each within an equal share of it (a quarter of 80 GiB less the 1 GiB reserve:
    19 GiB); they ran one at a time before, PyG's 205 CUDA tests 6.7x plain on an H200.
    The share is a guess: a test that fails on it, or is skipped after it used the
    device, runs again alone and that outcome counts; a test skipped before it touched
    the device stays skipped, run once."""
    standins.one_h100(pytester, monkeypatch)
    write_fake_torch(pytester)
    pytester.makepyfile(test_first=FIRST_RUN)
    args = ["--spawn-gpu", "--spawn-per-gpu", "4", "--spawn-jobs", "4", "-rs"]
    result = pytester.runpytest_subprocess(*args, "--spawn-method", method)
    result.assert_outcomes(passed=5, skipped=1)
    assert result.parseoutcomes()["rerun"] == 2  # both runs shown (issue 56)
    result.stdout.fnmatch_lines(["*not on this platform*"])
    again = [line for line in result.stdout.lines if "on a guessed budget, or beside one" in line]
    assert len(again) == 1, result.stdout.str()
    assert again[0].startswith("2 tests ran out of memory (or skipped for want of it)"), again
    named = again[0].split(": ", 1)[1].split(", ")
    assert sorted(named) == [
        "test_first.py::test_needs_more",
        "test_first.py::test_skips_where_crowded",
    ]
    result.stdout.fnmatch_lines(
        ["packing: * shared a GPU within their budgets (* on a first run's share: *"]
    )
    seen = read_stamps(stamps)
    share = 80 * GiB // 4 - RESERVE
    assert {seen[f"light{i}"]["budget"] for i in range(3)} == {share}
    assert any(overlapping(seen, f"light{i}") for i in range(3)), seen
    # The second runs: alone, with no budget.
    assert seen["needs_more"]["budget"] == seen["crowded"]["budget"] == 0


def test_a_test_that_fails_beside_a_learned_budget_runs_again_alone(pytester, stamps):
    """The class of the test above, from the other side: a test with a declared budget
    that fails while a neighbour on a learned budget runs beside it (the neighbour's
    guess may be what it ran out of) runs again alone; that run counts."""
    write_fake_torch(pytester)
    pytester.makepyfile(
        test_side="""
        import os, time
        import pytest
        from stamping import stamp

        @pytest.mark.gpu
        def test_guessed():
            import torch
            torch.cuda.init()
            open("guessed.running", "w").close()
            try:
                stamp("guessed", 3.0)
            finally:
                os.unlink("guessed.running")

        @pytest.mark.gpu(memory="1GiB")
        def test_declared():
            end = time.time() + 2.0
            while time.time() < end and not os.path.exists("guessed.running"):
                time.sleep(0.05)
            if os.path.exists("guessed.running"):
                import torch
                raise torch.OutOfMemoryError("CUDA out of memory beside a guess (pretend)")
            stamp("declared", 0.1)
        """
    )
    args = ["--spawn-gpus", "GPU-a", "--spawn-gpu-memory", "80GiB", "--spawn-jobs", "2"]
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=2)  # learns: alone
    second = pytester.runpytest_subprocess(*args)
    second.assert_outcomes(passed=2)
    second.stdout.fnmatch_lines(
        ["1 test ran out of memory (or skipped for want of it) on a guessed budget, or *"]
    )
    second.stdout.fnmatch_lines(["*ran again alone*: test_side.py::test_declared"])


def _run_fast_on_peaks(
    pytester: pytest.Pytester, peaks: dict[str, int]
) -> tuple[pytest.RunResult, dict[tuple[str, str], dict[str, str]]]:
    """A fast-mode run of the inner suite under ``--spawn-gpu`` on one declared 80 GiB
    device, one test at a time, as a second run whose first recorded ``peaks``; each
    test's junit properties, by (classname, name)."""
    cache = pytester.path / ".pytest_cache" / "v" / "spawnrun"
    cache.mkdir(parents=True)
    (cache / "peaks").write_text(json.dumps(peaks))
    result = pytester.runpytest_subprocess(
        "--spawn-gpu", "--spawn-method", "forkserver", "--spawn-jobs", "1",
        "--spawn-gpus", "GPU-a", "--spawn-gpu-memory", "80GiB", "--junitxml=out.xml",
        "-o", "junit_family=xunit1",
    )  # fmt: skip
    properties = {}
    for case in ElementTree.parse(pytester.path / "out.xml").getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") or "" for p in case.iter("property")}
        properties[(case.get("classname") or "", case.get("name") or "")] = props
    return result, properties


def test_each_fork_of_a_template_runs_with_its_own_learned_budget(pytester):
    """timm's model tests on the H200 (run 44): a file's template forked tests of
    different learned budgets, and each fork ran with the budget of the template's first
    test (a Go tells an adopted child its test, not its budget): tests whose peak was
    over that budget ran out of memory, where in-process they pass. Each test runs with
    its own budget, as its report says, and tests of three budgets share one template
    (the Go carries each fork's budget)."""
    pytester.makepyfile(
        test_many="import json, os, pytest\n\n@pytest.mark.parametrize('i', range(6))\n"
        "def test_it(i, record_property):\n"
        "    record_property('budget_seen', os.environ.get('SPAWNRUN_GPU_BUDGET'))\n"
    )
    peaks = {f"test_many.py::test_it[{i}]": (1 + i // 2) * 2**30 for i in range(6)}
    result, properties = _run_fast_on_peaks(pytester, peaks)
    result.assert_outcomes(passed=6)
    budgets = {
        name: (props["budget_seen"], props["spawnrun_budget_mib"])
        for (_, name), props in properties.items()
    }
    assert len({seen for seen, _ in budgets.values()}) == 3, budgets
    for seen, told in budgets.values():
        assert round(int(seen) / 2**20) == round(float(told)), budgets
    result.stdout.fnmatch_lines(["6 tests isolated in 6 children (6 forked from 1 template*"])


BUDGET_CONFTEST = """
import os
import spawnrun
{read}
def pytest_configure(config):
    if spawnrun.is_child():
        with open(os.path.join(os.environ["RECORDS"], f"configured-{{os.getpid()}}"), "w") as f:
            f.write(str(SEEN))
"""


@pytest.mark.parametrize("reads", [False, True], ids=["conftest-reads-no-budget", "reads-it"])
def test_a_configured_template_forks_tests_of_other_budgets_each_with_its_own(
    pytester, monkeypatch, reads
):
    """Tests in files of their own with learned budgets (timm's model tests on a second
    run, one per file here) fork from one configured template, as tests without a
    budget do: the template runs with none, and each fork with its test's own, or a first
    run's share where the test has no record. Before, a budget was part of a template's kind, and no
    learned budget is another test's. A conftest that reads the budget while pytest is
    configured would see none in the template, where a spawned child sees its test's:
    then no configured template serves, and each test's conftest sees its own."""
    records = pytester.path / "records"
    records.mkdir()
    monkeypatch.setenv("RECORDS", str(records))
    read = 'SEEN = os.environ.get("SPAWNRUN_GPU_BUDGET")' if reads else "SEEN = 'unread'"
    pytester.makeconftest(BUDGET_CONFTEST.format(read=read))
    n = 6
    body = (
        "import os, time\n\ndef test_it():\n    time.sleep(0.3)\n"
        "    with open(os.path.join(os.environ['RECORDS'], 'ran-{i}'), 'w') as f:\n"
        "        f.write(f\"{{os.getpid()}} {{os.environ.get('SPAWNRUN_GPU_BUDGET')}}\")\n"
    )
    pytester.makepyfile(**{f"test_{i}": body.format(i=i) for i in range(n)})
    # Every test but the last has a record of its own.
    peaks = {f"test_{i}.py::test_it": (1 + i) * GiB for i in range(n - 1)}
    result, properties = _run_fast_on_peaks(pytester, peaks)
    result.assert_outcomes(passed=n)
    told = {cls: props.get("spawnrun_budget_mib") for (cls, _), props in properties.items()}
    ran = {i: (records / f"ran-{i}").read_text().split() for i in range(n)}
    for i, (_, seen) in ran.items():
        mib = told[f"test_{i}"]
        assert round(int(seen) / 2**20) == round(float(mib)), (i, seen, mib)
    assert len({seen for _, seen in ran.values()}) == n, ran  # each its own
    configured = {int(p.name.split("-")[1]): p.read_text() for p in records.glob("configured-*")}
    pids = {int(pid) for pid, _ in ran.values()}
    templates = set(configured) - pids
    if not reads:
        assert pids - set(configured) and len(configured) < n, configured  # forked
        assert templates, configured
        return
    # Each test's conftest saw its own budget, as in a spawned child: none forked from
    # a configured template (one may have been configured, and then refused).
    for i, (pid, seen) in ran.items():
        assert configured.get(int(pid)) == seen, (i, configured)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_tests_that_kept_cores_busy_take_job_slots_on_the_next_run(
    pytester, stamps, monkeypatch, method
):
    """timm's model tests on the H200: each builds its model on the CPU with torch's 16
    threads, and 16 such tests at once took several times as long as one by one (the
    second run 1.06x plain; with two threads each, 0.47x). A run records the cores each
    test kept busy; the next gives a test as many of the run's job slots as those cores
    need, so that busy tests do not share the cores beyond what they hold. Here the
    recorded loads say each busy test needs every core: each runs with nothing beside
    it, while the idle ones share; the summary says so. (No GPUs: unmarked tests under
    ``--spawn-gpu`` would hold every one, alone.) In fast mode a file's template forks
    its tests, and each but the last says it is done without ending its process: the
    load is told that way too (it was not: run 1 on the H200 recorded one test's)."""
    monkeypatch.delenv("SPAWNRUN_GPUS")
    pytester.makepyfile(
        test_busy=textwrap.dedent(
            """
            import hashlib, threading, time
            import pytest
            from stamping import stamp

            def spin(seconds):
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    hashlib.sha256(b"x" * 1_000_000).digest()  # without the GIL

            @pytest.mark.parametrize("i", range(2))
            def test_busy(i):
                threads = [threading.Thread(target=spin, args=(0.5,)) for _ in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                stamp(f"busy{i}", 0.3)
            """
        ),
        test_idle=textwrap.dedent(
            """
            import pytest
            from stamping import stamp

            @pytest.mark.parametrize("i", range(3))
            def test_idle(i):
                stamp(f"idle{i}", 1.5)  # long enough to meet on a slow machine
            """
        ),
    )
    args = ("--spawn-gpu", "--spawn-jobs", "4", "--spawn-method", method, "-p", "cacheprovider")
    args += ("--junitxml=out.xml",)
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=5)
    loads = json.loads((pytester.path / ".pytest_cache/v/spawnrun/cpu-loads").read_text())
    busy = [loads[f"test_busy.py::test_busy[{i}]"] for i in range(2)]
    idle = [loads[f"test_idle.py::test_idle[{i}]"] for i in range(3)]
    # What the cores did, however many there are and however busy the machine is (on
    # a loaded one a busy test got 0.2 of a core: an absolute threshold failed there).
    assert min(busy) > 0.05 and min(busy) > 3 * max(idle), loads
    junit = (pytester.path / "out.xml").read_text()
    assert 'name="spawnrun_cpu_load"' in junit
    # Every core, whatever this machine has: each busy test takes all four slots.
    cores = len(os.sched_getaffinity(0))
    recorded = {k: (float(cores) if "busy" in k else 0.0) for k in loads}
    (pytester.path / ".pytest_cache/v/spawnrun/cpu-loads").write_text(json.dumps(recorded))
    stamps.unlink()
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=5)
    seen = read_stamps(stamps)
    assert overlapping(seen, "busy0") == [] and overlapping(seen, "busy1") == [], seen
    assert most_at_once(seen, [f"idle{i}" for i in range(3)])[0] > 1, seen
    result.stdout.fnmatch_lines(["job slots: 2 tests took more than one, * (up to 4 of 4)"])
