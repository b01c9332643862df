"""The zygote (--spawn-method forkserver): forks per test, and refuses to fork a device."""

from __future__ import annotations

import pytest

from spawnrun import _forkserver

DEVICE_SUITE = """
import os
import pytest
import fakedevice

@pytest.mark.gpu
@pytest.mark.parametrize("x", [1, 2, 3])
def test_uses_device(x):
    assert fakedevice.compute(x) == 2 * x
"""

GUARD_HOOK = """
def pytest_spawnrun_device_state(config):
    return "fakedevice is initialized" if fakedevice.is_initialized() else None
"""


@pytest.mark.parametrize("guarded", [True, False], ids=["with-guard-hook", "control"])
def test_device_initialized_in_template_falls_back_to_spawn(pytester, fakedevice, guarded):
    conftest = "import fakedevice\nfakedevice.init()  # at import, in every process\n"
    pytester.makeconftest(conftest + (GUARD_HOOK if guarded else ""))
    pytester.makepyfile(test_device=DEVICE_SUITE)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spawn-method", "forkserver", "-W", "default"
    )
    if guarded:
        # The template refuses to fork; every test spawns and passes; one warning says why.
        result.assert_outcomes(passed=3, warnings=1)
        result.stdout.fnmatch_lines(
            [f"*{_forkserver.OFF.format(reason='fakedevice is initialized')}*"]
        )
    else:
        # The control: forked from a template holding the device, the tests break.
        result.assert_outcomes(failed=3)
        result.stdout.fnmatch_lines(["*Cannot re-initialize FakeDevice in forked subprocess*"])


def test_cuda_initialized_by_a_conftest_is_named(pytester, fake_torch):
    pytester.makeini("[pytest]\nspawn_preload = torch\nspawn_method = forkserver\n")
    pytester.makeconftest(
        "import spawnrun, torch\n"
        "if spawnrun.is_child():\n"
        "    torch.cuda._lazy_init()  # touches CUDA in every child (and the template)\n"
    )
    pytester.makepyfile("import pytest\n@pytest.mark.gpu\ndef test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "default")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        ["*forkserver is off*torch.cuda is initialized (by *conftest.py:3 in <module>)*"]
    )


def test_forked_children_are_separate_processes_with_own_tmp_path(pytester):
    pytester.makepyfile(
        """
        import json, os
        import pytest
        import spawnrun

        @pytest.mark.gpu
        @pytest.mark.parametrize("i", range(3))
        def test_where(i, tmp_path):
            assert spawnrun.is_child()
            assert not (tmp_path / "mark").exists()
            (tmp_path / "mark").write_text(str(i))
            with open(f"where{i}.json", "w") as f:
                json.dump([os.getpid(), os.getppid(), str(tmp_path)], f)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--spawn-method", "forkserver")
    result.assert_outcomes(passed=3)
    import json

    rows = [json.loads((pytester.path / f"where{i}.json").read_text()) for i in range(3)]
    pids, parents, tmps = zip(*rows, strict=True)
    assert len(set(pids)) == 3 and len(set(tmps)) == 3
    assert len(set(parents)) == 1  # all forked from the one template
