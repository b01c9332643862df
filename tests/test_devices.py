"""Device inventory and allocation as pure logic, without processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from spawnrun.devices import _allocator
from spawnrun.devices import _inventory
from spawnrun.devices import _ledger
from spawnrun.devices import _nvml
from spawnrun.devices._packing import ALONE

GiB = 2**30


@pytest.mark.parametrize(
    "visible, expected",
    [
        ("0,1", ("0", "1")),
        ("2", ("2",)),
        ("", ()),
        ("GPU-8a7b,GPU-ffee", ("GPU-8a7b", "GPU-ffee")),
        ("1,-1,3", ("1",)),  # CUDA stops at the first invalid entry
        ("-1", ()),
        (" 0 , 3 ", ("0", "3")),
    ],
)
def test_auto_respects_cuda_visible_devices(visible, expected):
    inv = _inventory.inventory("auto", {"CUDA_VISIBLE_DEVICES": visible})
    assert inv.ids == expected
    assert "CUDA_VISIBLE_DEVICES" in inv.source


@pytest.mark.parametrize(
    "setting, environ, expected",
    [
        ("none", {"CUDA_VISIBLE_DEVICES": "0,1"}, ()),
        ("0,1,3", {}, ("0", "1", "3")),
        ("2", {"CUDA_VISIBLE_DEVICES": "4,5,6"}, ("4", "5")),
        ("2", {"CUDA_VISIBLE_DEVICES": ""}, ("0", "1")),
    ],
)
def test_explicit_settings(setting, environ, expected):
    assert _inventory.inventory(setting, environ).ids == expected


@pytest.mark.parametrize("bad", ["0,,1", "a b", "", "-1", "abc", "1.5", "0,x", "GPU-"])
def test_bad_gpus_value_is_a_usage_error(bad):
    with pytest.raises(pytest.UsageError, match="--spawn-gpus: expected auto, none, a count"):
        _inventory.parse_gpus(bad, "--spawn-gpus")


@pytest.mark.parametrize("good", ["0,1", "3", "GPU-8f2c,GPU-1a2b", "MIG-4b7e"])
def test_device_ids_and_uuids_are_accepted(good):
    assert _inventory.parse_gpus(good, "--spawn-gpus") == good


def test_a_device_listed_twice_is_refused():
    with pytest.raises(pytest.UsageError, match="device 0 is listed more than once"):
        _inventory.parse_gpus("0,1,0", "--spawn-gpus")


def test_a_count_picks_from_what_is_visible():
    # CUDA_VISIBLE_DEVICES=3 allows device 3 alone: two can never be handed out.
    assert _inventory.inventory("1", {"CUDA_VISIBLE_DEVICES": "3"}).ids == ("3",)
    with pytest.raises(pytest.UsageError, match="--spawn-gpus 2: only 1 GPU.s. visible .3,"):
        _inventory.inventory("2", {"CUDA_VISIBLE_DEVICES": "3"})


def test_header_says_how_devices_were_found():
    assert _inventory.inventory("0,1", {}).describe() == (
        "spawnrun: 2 GPU(s) [0, 1] (nvidia, declared with --spawn-gpus, trusted as given)"
    )
    assert "tests that need one are skipped" in _inventory.inventory("none", {}).describe()


def test_allocator_hands_out_each_device_once():
    alloc = _allocator.Allocator(("0", "1", "2"))
    a = alloc.take(2, ALONE, "a")
    assert a == ["0", "1"]
    assert alloc.take(2, ALONE, "b") is None  # only one left: a two-device test waits
    b = alloc.take(1, ALONE, "c")
    assert b == ["2"]
    alloc.give_back(a, "a")
    assert sorted(alloc.take(2, ALONE, "d") or []) == ["0", "1"]
    assert alloc.take(0, ALONE, "e") == []


def test_ledger_is_shared_between_processes(tmp_path):
    mine = _ledger.Ledger(("0", "1"), tmp_path)
    assert mine.take(1, ALONE, _allocator.token_for(1)) == ["0"]
    # Another process (a second xdist worker) sees device 0 taken, then takes 1.
    code = (
        "import sys; from pathlib import Path; from spawnrun.devices import _allocator, _ledger;"
        "led = _ledger.Ledger(('0', '1'), Path(sys.argv[1]));"
        "print(led.take(1, None, _allocator.token_for(1)),"
        " led.take(1, None, _allocator.token_for(2)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    # It got device 1, then nothing; its entry died with it, so 1 is free again.
    assert out.stdout.split() == ["['1']", "None"]
    assert mine.take(1, ALONE, _allocator.token_for(2)) == ["1"]
    assert mine.take(1, ALONE, _allocator.token_for(3)) is None
    mine.give_back(["0"], _allocator.token_for(1))
    mine.give_back(["1"], _allocator.token_for(2))
    assert mine.take(2, ALONE, _allocator.token_for(4)) == ["0", "1"]


@pytest.mark.parametrize("how", ["zombie", "pid-reused"])
def test_a_dead_workers_claims_are_dropped_at_once(tmp_path, how):
    """A worker killed with SIGKILL stays a zombie of xdist's controller until reaped:
    a liveness check by signal took it for alive, and every other worker waited for its
    devices forever. A claim whose pid now names another process is dropped too."""
    mine = _ledger.Ledger(("0",), tmp_path)
    code = (
        "import os, sys; from pathlib import Path;"
        "from spawnrun.devices import _allocator, _ledger;"
        "led = _ledger.Ledger(('0',), Path(sys.argv[1]));"
        "print(led.take(1, None, _allocator.token_for(1)), flush=True);"
        "os._exit(0)"
    )
    if how == "zombie":
        worker = subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        assert worker.stdout is not None and worker.stdout.readline().strip() == "['0']"
        deadline = time.monotonic() + 30
        while _allocator.started(worker.pid) is not None and time.monotonic() < deadline:
            with open(f"/proc/{worker.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break  # exited, not reaped: a zombie, as a killed xdist worker is
            time.sleep(0.01)
        try:
            assert mine.take(1, ALONE, _allocator.token_for(2)) == ["0"]
        finally:
            worker.wait()
            worker.stdout.close()
    else:
        # This process's pid, with another start: the claim's owner is long gone.
        started = _allocator.started(os.getpid())
        assert started is not None
        token = f"{os.getpid()}:7:{started - 1}"
        (tmp_path / "ledger.json").write_text(f'{{"0": [[{os.getpid()}, null, "{token}"]]}}')
        assert mine.take(1, ALONE, _allocator.token_for(2)) == ["0"]


def test_ledger_shares_budgets_between_processes(tmp_path):
    # Two workers, one 10 GiB device, budgets of 4 GiB (plus the 1 GiB reserve each):
    # two fit, a third does not, whichever worker asks.
    capacity = {"0": 10 * GiB}
    mine = _ledger.Ledger(("0",), tmp_path, capacity, per_gpu=8)
    assert mine.take(1, 4 * GiB, _allocator.token_for(1)) == ["0"]
    code = (
        "import sys, time; from pathlib import Path;"
        "from spawnrun.devices import _allocator, _ledger;"
        f"led = _ledger.Ledger(('0',), Path(sys.argv[1]), {{'0': {10 * GiB}}}, 8);"
        f"print(led.take(1, {4 * GiB}, _allocator.token_for(1)), flush=True); time.sleep(30)"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None
        assert other.stdout.readline().strip() == "['0']"
        assert mine.take(1, 4 * GiB, _allocator.token_for(2)) is None
        assert not mine.take_exact(["0"], ALONE, _allocator.token_for(3))
    finally:
        other.kill()
        other.wait()
        other.stdout.close()
    # Its claim died with it: room for one more budget again.
    assert mine.take(1, 4 * GiB, _allocator.token_for(4)) == ["0"]


def test_ledger_directory_is_private_and_removed(tmp_path):
    directory = _ledger.private_dir()
    try:
        assert directory.stat().st_mode & 0o777 == 0o700
        assert not directory.name.endswith(("abc123",))
    finally:
        directory.rmdir()
    # A directory another user could write to, or a link to one, is refused.
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(pytest.UsageError, match="not a private directory"):
        _ledger.Ledger(("0",), shared)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(private)
    with pytest.raises(pytest.UsageError, match="not a private directory"):
        _ledger.Ledger(("0",), link)


def test_ledger_never_follows_a_planted_link(tmp_path):
    # A ledger.json planted as a link to a file of ours must not be written through.
    directory = tmp_path / "ledger"
    directory.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (directory / "ledger.json").symlink_to(victim)
    ledger = _ledger.Ledger(("0",), directory)
    with pytest.raises(OSError):
        ledger.take(1, ALONE, _allocator.token_for(1))
    assert victim.read_text() == "precious"


def test_ledger_only_under_xdist(tmp_path):
    capacity: dict[str, int | None] = {"0": None}
    assert type(_ledger.allocator_for(("0",), None, capacity, 1)) is _allocator.Allocator
    led = _ledger.allocator_for(("0",), str(tmp_path), capacity, 1)
    assert isinstance(led, _ledger.Ledger)


def test_nvidia_smi_is_the_last_resort(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        "echo 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\n"
        "echo 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(_nvml, "load_nvml", lambda: None)  # no NVML
    inv = _inventory.inventory("auto", {})
    assert inv.ids == ("0", "1")  # named as nvidia-smi numbers them
    assert [d.token for d in inv.devices] == ["GPU-a", "GPU-b"]  # handed out as UUIDs
    assert inv.source.startswith("from nvidia-smi -L")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert _inventory.inventory("auto", {}).ids == ()


def test_a_cut_ledger_file_keeps_the_last_claims_it_had(tmp_path):
    # A worker killed while writing (or a file cut short) must not read as "no claims":
    # every worker would then hand out every device again.
    directory = tmp_path / "ledger"
    directory.mkdir(mode=0o700)
    ledger = _ledger.Ledger(("0",), directory)
    assert ledger.take(1, ALONE, _allocator.token_for(1)) == ["0"]
    (directory / "ledger.json").write_text('{"0": [[')
    assert ledger.take(1, ALONE, _allocator.token_for(2)) is None
    assert ledger.free() == []


def test_the_ledger_is_written_whole_and_only_when_a_claim_changes(tmp_path):
    directory = tmp_path / "ledger"
    directory.mkdir(mode=0o700)
    ledger = _ledger.Ledger(("0", "1"), directory)
    path = directory / "ledger.json"
    ledger.take(1, ALONE, _allocator.token_for(1))
    before = os.stat(path)
    assert ledger.free() == ["1"]  # a look: nothing written
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    ledger.take(1, ALONE, _allocator.token_for(2))
    assert os.stat(path).st_ino != before.st_ino  # a new file renamed over the old
    assert sorted(p.name for p in directory.iterdir()) == ["ledger.json", "ledger.lock"]


def test_the_ledger_directory_goes_when_a_later_configure_fails(pytester, monkeypatch):
    """Another plugin's usage error after spawnrun's configure: nothing is left behind."""
    temp = pytester.path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    pytester.makeconftest(
        """
        import pytest

        @pytest.hookimpl(trylast=True)
        def pytest_configure(config):
            raise pytest.UsageError("another plugin refuses")
        """
    )
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", timeout=60)
    result.stderr.fnmatch_lines(["*another plugin refuses*"])
    assert [p.name for p in temp.iterdir() if p.name.startswith("spawnrun-devices-")] == []
