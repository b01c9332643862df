"""Device inventory and allocation as pure logic, without processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spawnrun import _devices


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
    inv = _devices.inventory("auto", {"CUDA_VISIBLE_DEVICES": visible})
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
    assert _devices.inventory(setting, environ).ids == expected


@pytest.mark.parametrize("bad", ["0,,1", "a b", "", "-1", "abc", "1.5", "0,x", "GPU-"])
def test_bad_gpus_value_is_a_usage_error(bad):
    with pytest.raises(pytest.UsageError, match="--spawn-gpus: expected auto, none, a count"):
        _devices.parse_gpus(bad, "--spawn-gpus")


@pytest.mark.parametrize("good", ["0,1", "3", "GPU-8f2c,GPU-1a2b", "MIG-4b7e"])
def test_device_ids_and_uuids_are_accepted(good):
    assert _devices.parse_gpus(good, "--spawn-gpus") == good


def test_a_device_listed_twice_is_refused():
    with pytest.raises(pytest.UsageError, match="device 0 is listed more than once"):
        _devices.parse_gpus("0,1,0", "--spawn-gpus")


def test_a_count_picks_from_what_is_visible():
    # CUDA_VISIBLE_DEVICES=3 allows device 3 alone: two can never be handed out.
    assert _devices.inventory("1", {"CUDA_VISIBLE_DEVICES": "3"}).ids == ("3",)
    with pytest.raises(pytest.UsageError, match="--spawn-gpus 2: only 1 GPU.s. visible .3,"):
        _devices.inventory("2", {"CUDA_VISIBLE_DEVICES": "3"})


def test_header_says_how_devices_were_found():
    assert _devices.inventory("0,1", {}).describe() == (
        "spawnrun: 2 GPU(s) [0, 1] (declared with --spawn-gpus, trusted as given)"
    )
    assert "tests that need one are skipped" in _devices.inventory("none", {}).describe()


def test_allocator_hands_out_each_device_once():
    alloc = _devices.Allocator(("0", "1", "2"))
    a = alloc.take(2)
    assert a == ["0", "1"]
    assert alloc.take(2) is None  # only one left: a two-device test waits
    b = alloc.take(1)
    assert b == ["2"]
    alloc.give_back(a)
    assert sorted(alloc.take(2) or []) == ["0", "1"]
    assert alloc.take(0) == []


def test_ledger_is_shared_between_processes(tmp_path):
    mine = _devices.Ledger(("0", "1"), tmp_path)
    assert mine.take(1) == ["0"]
    # Another process (a second xdist worker) sees device 0 taken, then takes 1.
    code = (
        "import sys; from pathlib import Path; from spawnrun import _devices;"
        "led = _devices.Ledger(('0', '1'), Path(sys.argv[1]));"
        "print(led.take(1), led.take(1))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    # It got device 1, then nothing; its entry died with it, so 1 is free again.
    assert out.stdout.split() == ["['1']", "None"]
    assert mine.take(1) == ["1"]
    assert mine.take(1) is None
    mine.give_back(["0", "1"])
    assert mine.take(2) == ["0", "1"]


def test_ledger_only_under_xdist(tmp_path):
    assert type(_devices.allocator_for(("0",), {})) is _devices.Allocator
    env = {"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_TESTRUNUID": "abc123"}
    assert isinstance(_devices.allocator_for(("0",), env), _devices.Ledger)


def test_nvidia_smi_is_the_last_resort(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        "echo 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\n"
        "echo 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(_devices, "_load", lambda: None)  # no NVML
    inv = _devices.inventory("auto", {})
    assert inv == _devices.Inventory(("0", "1"), "from nvidia-smi -L")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert _devices.inventory("auto", {}).ids == ()
