"""Outcome parity: one inner suite, run plainly and with spawnrun, must agree per test id."""

from __future__ import annotations

import textwrap

import pytest

from spawnrun.wire import _reports

INNER = textwrap.dedent(
    """
    import logging
    import os
    import sys
    import unittest
    import warnings

    import pytest

    import spawnrun

    def test_pass():
        assert 1 + 1 == 2

    def test_assert_introspection():
        left = {"a": 1, "b": [1, 2, 3]}
        assert left == {"a": 1, "b": [1, 2, 4]}

    @pytest.fixture
    def broken_setup():
        raise RuntimeError("setup exploded")

    def test_setup_error(broken_setup):
        pass

    @pytest.fixture
    def broken_teardown():
        yield
        raise RuntimeError("teardown exploded")

    def test_teardown_error(broken_teardown):
        pass

    def test_fail_and_teardown_error(broken_teardown):
        assert False, "call failed too"

    @pytest.mark.skip(reason="marker skip")
    def test_skip_marker():
        pass

    @pytest.mark.skipif(True, reason="skipif true")
    def test_skipif():
        pass

    def test_skip_imperative():
        pytest.skip("imperative skip")

    def test_importorskip():
        pytest.importorskip("a_module_that_does_not_exist_spawnrun")

    @pytest.mark.xfail(reason="expected")
    def test_xfail():
        assert False

    @pytest.mark.xfail(strict=True, reason="strict")
    def test_xfail_strict_fails():
        assert False

    @pytest.mark.xfail(reason="passes anyway")
    def test_xpass():
        pass

    @pytest.mark.xfail(strict=True, reason="strict xpass")
    def test_xpass_strict():
        pass

    @pytest.mark.xfail(raises=ValueError)
    def test_xfail_raises_match():
        raise ValueError("x")

    @pytest.mark.xfail(raises=ValueError)
    def test_xfail_raises_mismatch():
        raise TypeError("x")

    @pytest.mark.xfail(run=False, reason="not run")
    def test_xfail_not_run():
        os._exit(99)

    def test_imperative_xfail():
        pytest.xfail("imperative xfail")

    def test_pytest_fail():
        pytest.fail("explicit failure")

    def test_system_exit():
        sys.exit(3)

    @pytest.mark.parametrize("value", ["a::b", "sp ace", "brä[ck]et", "slash/x", "", "é"])
    def test_odd_ids(value):
        assert isinstance(value, str)

    class TestGroup:
        def test_method_pass(self):
            assert True

        def test_method_fail(self):
            assert [1, 2] == [1, 3]

    class UnitCase(unittest.TestCase):
        def test_ok(self):
            self.assertEqual(1, 1)

        def test_bad(self):
            self.assertEqual(1, 2)

        @unittest.skip("unittest skip")
        def test_skipped(self):
            pass

    def test_capsys(capsys):
        print("to-stdout")
        sys.stderr.write("to-stderr\\n")
        out, err = capsys.readouterr()
        assert out == "to-stdout\\n" and err == "to-stderr\\n"

    def test_capfd(capfd):
        os.write(1, b"fd-out\\n")
        assert capfd.readouterr().out == "fd-out\\n"

    def test_caplog(caplog):
        logging.getLogger("x").warning("logged-warning")
        assert "logged-warning" in caplog.text

    def test_output_sections():
        print("SECTION-STDOUT-MARK")
        sys.stderr.write("SECTION-STDERR-MARK\\n")
        logging.getLogger("y").error("SECTION-LOG-MARK")
        assert False

    def test_record_property(record_property):
        record_property("flavour", "spawned-or-not")

    def test_warns():
        warnings.warn(UserWarning("inner-warning-mark"))

    def test_tmp_path(tmp_path):
        (tmp_path / "f.txt").write_text("x")
        assert (tmp_path / "f.txt").read_text() == "x"
        assert str(tmp_path).startswith(os.environ["INNER_BASETEMP"])

    def test_where():
        assert spawnrun.is_child() == (os.environ.get("EXPECT_CHILD") == "1")
    """
)

# Parameters that differ between interpreters under the same ids, as kornia's tensors made
# by torch.rand at import do: every child collects other values. The child must run the
# parent's values (which the parent's module left in the environment), so each test sees
# exactly what it sees in-process.
DRAWN = textwrap.dedent(
    """
    import json
    import os
    import random

    import numpy
    import pytest

    import spawnrun

    ARRAYS = [numpy.random.rand(3) for _ in range(2)]
    LISTS = [[random.random()] for _ in range(2)]
    # A set's order follows the hash seed: which pair "pair3" names differs per process.
    PAIRS = list({(f"key{i}", i) for i in range(8)})
    if not spawnrun.is_child():
        spelled = [[repr(v) for v in vs] for vs in (ARRAYS, LISTS, PAIRS)]
        os.environ["INNER_DRAWN"] = json.dumps(spelled)
    PARENT = json.loads(os.environ["INNER_DRAWN"])

    @pytest.mark.parametrize("i, array", list(enumerate(ARRAYS)))
    def test_drawn_array(i, array):
        assert repr(array) == PARENT[0][i]

    @pytest.mark.parametrize("i, drawn", list(enumerate(LISTS)))
    def test_drawn_list(i, drawn):
        assert repr(drawn) == PARENT[1][i]

    @pytest.mark.parametrize("i, pair", list(enumerate(PAIRS)))
    def test_set_ordered(i, pair):
        assert repr(pair) == PARENT[2][i]
    """
)

MODES = {
    "marker": [],
    "spawn-gpu": ["--spawn-gpu"],
    "no-spawn": ["--no-spawn"],
    # One child at a time, two booted ahead; and no booting ahead at all.
    "lookahead-2": ["--spawn-jobs", "1", "--spawn-lookahead", "2"],
    "lookahead-0": ["--spawn-lookahead", "0"],
    "forkserver": ["--spawn-method", "forkserver"],
    # Two xdist workers, each spawning its tests' children.
    "xdist": ["-n", "2"],
    # One child per module or class (fixtures shared within), in both start methods and
    # under xdist (a module's tests spread over two workers: a child each).
    "module": ["--spawn-scope", "module"],
    "module-forkserver": ["--spawn-scope", "module", "--spawn-method", "forkserver"],
    "class": ["--spawn-scope", "class"],
    "module-xdist": ["--spawn-scope", "module", "-n", "2"],
    # Fast mode forking both files' tests from a template that collected them both.
    "run-template": ["--spawn-method", "forkserver", "--spawn-template", "run"],
}
MARKED = ("marker", "lookahead-2", "lookahead-0", "forkserver", "xdist", *list(MODES)[7:])


def _by_test(record):
    return record[0]


@pytest.fixture
def inner(outcomes, pytester, monkeypatch):
    monkeypatch.setenv("INNER_BASETEMP", str(pytester.path / "bt"))
    return outcomes


def _run(inner, pytester, monkeypatch, mode: str, *extra: str):
    prefix = "import pytest\npytestmark = pytest.mark.gpu\n" if mode in MARKED else ""
    pytester.makepyfile(test_inner=prefix + INNER, test_drawn=prefix + DRAWN)
    monkeypatch.setenv("EXPECT_CHILD", "0" if mode in ("plain", "no-spawn") else "1")
    args = MODES.get(mode, [])
    return inner.run("--basetemp", str(pytester.path / "bt"), "-rA", *args, *extra)


@pytest.mark.parametrize("mode", list(MODES))
def test_outcomes_match_plain_run(inner, pytester, monkeypatch, mode):
    plain, plain_seen = _run(inner, pytester, monkeypatch, "plain", "-p", "no:spawnrun")
    result, seen = _run(inner, pytester, monkeypatch, mode)
    assert len(plain_seen) > 100  # the recorder works and saw every phase
    # A test that ran again (a failure after it ran out of order) shows its first run as
    # a rerun (issue 56); what counts is the second run's.
    reruns = [s for s in seen if s[2] == "rerun"]
    seen = [s for s in seen if s[2] != "rerun"]
    # Children run two at a time: compare per test, each test's phases in order.
    assert sorted(seen, key=_by_test) == sorted(plain_seen, key=_by_test)
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    assert result.ret == plain.ret == 1
    counts = plain.parseoutcomes()
    outcomes = result.parseoutcomes()
    assert outcomes.pop("rerun", 0) == len(reruns)
    assert outcomes == counts
    if mode == "no-spawn":
        return
    # Messages, not just outcomes: introspection, sections, warnings, properties. Under
    # xdist two workers report in either order: each message alone.
    match = result.stdout.fnmatch_lines
    if "xdist" in mode:
        match = _each_line(result)
    match(
        [
            "*spawnrun: * run in a fresh * child*",
            "*RuntimeError: setup exploded*",
            "*RuntimeError: teardown exploded*",
            "*Differing items:*",
            "*At index 1 diff: 2 != 3*",
            "*Captured stdout call*",
            "SECTION-STDOUT-MARK",
            "*Captured stderr call*",
            "SECTION-STDERR-MARK",
            "*Captured log call*",
            "*SECTION-LOG-MARK*",
            "*warnings summary*",
            "*test_inner.py::test_warns*",
            "*UserWarning: inner-warning-mark*",
        ]
    )
    assert _reports.DIED not in result.stdout.str()


def _each_line(result):
    def match(lines):
        for line in lines:
            result.stdout.fnmatch_lines([line])

    return match


def test_junitxml_has_every_test(inner, pytester, monkeypatch):
    pytester.makepyfile(test_inner="import pytest\npytestmark = pytest.mark.gpu\n" + INNER)
    monkeypatch.setenv("EXPECT_CHILD", "1")
    xml = pytester.path / "out.xml"
    inner.run(
        "--basetemp", str(pytester.path / "bt"), f"--junitxml={xml}", "-o", "junit_logging=all"
    )
    import xml.etree.ElementTree as ET

    root = ET.parse(xml).getroot()
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert len(cases) >= 35
    assert cases["test_pass"].find("failure") is None
    failure = cases["test_assert_introspection"].find("failure")
    assert failure is not None and "Differing items" in (failure.text or "")
    assert cases["test_setup_error"].find("error") is not None
    assert cases["test_skip_marker"].find("skipped") is not None
    props = cases["test_record_property"].find("properties")
    assert props is not None
    values = {p.get("name"): p.get("value") for p in props}
    expected = {"flavour", "spawnrun_devices", "spawnrun_wall_s", "spawnrun_boot_s"}
    # What auto learns from comes only where something measured it (torch's view of its
    # CUDA, or NVML): an unmeasured peak is no record, never 0.
    assert expected <= set(values) <= expected | {"spawnrun_device_peak_mib"}
    assert values["flavour"] == "spawned-or-not"
    assert values["spawnrun_devices"] in ("0", "1")  # one of the two declared GPUs
    assert float(values["spawnrun_wall_s"]) > 0
    assert float(values["spawnrun_boot_s"]) > 0
    assert "SECTION-STDOUT-MARK" in (cases["test_output_sections"].findtext("system-out") or "")
