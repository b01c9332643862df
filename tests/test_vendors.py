"""Vendors' inventories and visibility variables as pure logic, without processes.

Discovery reads recorded tool output and a stand-in NVML (``vendor_standins``); what a
child gets is ``Inventory.child_env``, which the parent puts in the child's environment
before its interpreter starts.
"""

from __future__ import annotations

import pytest
import vendor_standins as standins

from spawnrun.config import _table
from spawnrun.devices import _devices
from spawnrun.devices import _discovery
from spawnrun.devices import _inventory
from spawnrun.devices import _nvml
from spawnrun.devices import _vendors

GiB = 2**30
NONE = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(autouse=True)
def no_tools(monkeypatch, tmp_path):
    """No vendor's tool and no NVML, whatever the host running these tests has."""
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setattr(_nvml, "load_nvml", lambda: None)
    yield
    _inventory.activate(None)


def with_nvml(monkeypatch, tmp_path, gpus):
    nvml = standins.nvml_module(monkeypatch, tmp_path, gpus)
    monkeypatch.setattr(_nvml, "load_nvml", lambda: nvml)
    return nvml


# NVIDIA ------------------------------------------------------------------------------


def test_nvml_hands_out_uuids_named_by_index(monkeypatch, tmp_path):
    with_nvml(monkeypatch, tmp_path, standins.MIXED)
    inv = _inventory.inventory("auto", {})
    assert inv.ids == ("0", "1")  # NVML's (and nvidia-smi's) numbers, in tags
    assert inv.child_env(["1"], every=False) == {"CUDA_VISIBLE_DEVICES": "GPU-h100bbbb-1111"}
    assert inv.child_env(["0", "1"], every=False) == {
        "CUDA_VISIBLE_DEVICES": "GPU-a100aaaa-0000,GPU-h100bbbb-1111"
    }
    assert inv.child_env([], every=False) == NONE
    assert inv.child_env([], every=True) == {}  # --spawn-gpu alone: the parent's view
    assert inv.visible(["1"]) == "CUDA_VISIBLE_DEVICES=GPU-h100bbbb-1111"
    assert inv.describe() == (
        "spawnrun: 2 GPU(s) [0, 1] (nvidia, from NVML; each child gets "
        "CUDA_VISIBLE_DEVICES=<its UUID>)"
    )


def test_mig_instances_are_the_inventory_each_with_its_memory(monkeypatch, tmp_path):
    host = [
        dict(
            standins.MIG[0],
            migs=[standins.MIG[0]["migs"][0], None, {"uuid": "MIG-x", "memory": 35 * GiB}],
        ),
        standins.MIXED[0],
    ]
    with_nvml(monkeypatch, tmp_path, host)
    inv = _inventory.inventory("auto", {})
    # An empty slot is skipped; a GPU without MIG mode stays a whole GPU.
    assert inv.ids == ("0:mig0", "0:mig2", "1")
    assert inv.child_env(["0:mig2"], every=False) == {"CUDA_VISIBLE_DEVICES": "MIG-x"}
    assert inv.mig
    assert _inventory.MIG_ONE_PER_PROCESS in inv.refuses(2)
    assert inv.refuses(1) == ""
    _inventory.activate(inv)
    assert _devices.capacities(inv.ids, None) == {
        "0:mig0": 18 * GiB,
        "0:mig2": 35 * GiB,
        "1": 40 * GiB,
    }
    assert _devices.capacities(inv.ids, 20 * GiB)["0:mig2"] == 20 * GiB  # at most declared
    assert "one MIG instance per test" in inv.describe()


def test_mig_ids_given_by_hand_are_refused_two_at_a_time():
    inv = _inventory.inventory("MIG-4b7e,MIG-9c1d", {})
    assert inv.child_env(["MIG-9c1d"], every=False) == {"CUDA_VISIBLE_DEVICES": "MIG-9c1d"}
    assert inv.refuses(2) and not inv.refuses(1)
    assert not _inventory.inventory("GPU-1,GPU-2", {}).refuses(2)


@pytest.mark.parametrize(
    "visible, order, expected",
    [
        # Indices as the user gave them are CUDA's: NVML's figures only where they agree.
        ("1,0", {}, {"1": None, "0": None}),
        ("1,0", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, {"1": "1", "0": "0"}),
        ("GPU-h100bbbb-1111", {}, {"GPU-h100bbbb-1111": "GPU-h100bbbb-1111"}),
    ],
)
def test_an_outer_cuda_visible_devices_is_handed_on_verbatim(
    monkeypatch, tmp_path, visible, order, expected
):
    with_nvml(monkeypatch, tmp_path, standins.MIXED)
    environ = {"CUDA_VISIBLE_DEVICES": visible, **order}
    inv = _inventory.inventory("auto", environ)
    assert inv.ids == tuple(expected)
    first = inv.ids[0]
    # A subset of the user's own tokens: they mean in the child what they meant to them.
    assert inv.child_env([first], every=False) == {"CUDA_VISIBLE_DEVICES": first}
    assert {d: inv.device(d).nvml for d in inv.ids} == expected
    assert inv.visible([first]) == ""  # the tag says it already


def test_alike_gpus_are_numbered_alike_by_cuda_and_nvml(monkeypatch, tmp_path):
    with_nvml(monkeypatch, tmp_path, [standins.MIXED[1], dict(standins.MIXED[1], uuid="GPU-2")])
    inv = _inventory.inventory("auto", {"CUDA_VISIBLE_DEVICES": "1"})
    assert inv.device("1").nvml == "1"
    _inventory.activate(inv)
    assert _devices.total_memory("1") == 80 * GiB


def test_nvml_lookups_go_through_the_tokens(monkeypatch, tmp_path):
    with_nvml(monkeypatch, tmp_path, standins.MIG)
    inv = _inventory.inventory("auto", {})
    _inventory.activate(inv)
    assert _devices.total_memory("0:mig1") == 18 * GiB  # the instance's, not the GPU's
    assert _devices.still_held(["0:mig1"], {1}) is False
    assert _devices.nvml_available()
    # Another vendor's devices: NVML (present for an NVIDIA card beside them) stays out.
    _inventory.activate(_inventory.inventory("0,1", {}, "amd"))
    assert _devices.total_memory("0") is None
    assert not _devices.nvml_available()


def test_nvidia_smi_lists_mig_instances_in_place_of_their_gpu(tmp_path):
    text = (
        "GPU 0: NVIDIA H200 (UUID: GPU-5a1e0000-1111)\n"
        "  MIG 1g.18gb     Device  0: (UUID: MIG-aaaa0000-1111)\n"
        "  MIG 1g.18gb     Device  1: (UUID: MIG-bbbb0000-2222)\n"
        "GPU 1: NVIDIA H200 (UUID: GPU-6b2f0000-3333)\n"
    )
    found = [(d.label, d.token, d.mig) for d in _discovery.parse_nvidia_smi(text)]
    assert found == [
        ("0:mig0", "MIG-aaaa0000-1111", True),
        ("0:mig1", "MIG-bbbb0000-2222", True),
        ("1", "GPU-6b2f0000-3333", False),
    ]


# AMD ---------------------------------------------------------------------------------


def test_amd_smi_labels_by_its_index_and_hands_out_rocr_indices(tmp_path):
    standins.tool(
        tmp_path / "bin",
        "amd-smi",
        {"list --json": standins.AMD_SMI_LIST, "static --vram --json": standins.AMD_SMI_VRAM},
    )
    inv = _inventory.inventory("auto", {})
    assert inv.vendor == "amd" and inv.ids == ("0", "1")
    # amd-smi's GPU 0 is KFD node 3, after GPU 1 (node 2): ROCr enumerates it second.
    assert inv.child_env(["0"], every=False) == {"ROCR_VISIBLE_DEVICES": "1"}
    assert inv.child_env(["1", "0"], every=False) == {"ROCR_VISIBLE_DEVICES": "0,1"}
    hidden = inv.child_env([], every=False)
    assert hidden == {"ROCR_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", **NONE}
    assert inv.device("0").memory == 196592 * 2**20
    assert inv.describe().startswith("spawnrun: 2 GPU(s) [0, 1] (amd, from amd-smi list;")


def test_rocm_smi_is_amds_second_tool(tmp_path):
    vram = (
        '{"card1": {"VRAM Total Memory (B)": "68702699520"}, '
        '"card0": {"VRAM Total Memory (B)": "1"}}'
    )
    standins.tool(tmp_path / "bin", "rocm-smi", {"--showmeminfo vram --json": vram})
    inv = _inventory.inventory("auto", {})
    assert (inv.vendor, inv.ids) == ("amd", ("0", "1"))
    assert inv.device("1").memory == 68702699520


@pytest.mark.parametrize(
    "environ, ids, child",
    [
        # HIP indexes what ROCr exposes: ROCR_VISIBLE_DEVICES stays, HIP's is narrowed.
        (
            {"ROCR_VISIBLE_DEVICES": "0,1,2,3", "HIP_VISIBLE_DEVICES": "3,1"},
            ("3", "1"),
            {"HIP_VISIBLE_DEVICES": "1"},
        ),
        # HIP_VISIBLE_DEVICES and its alias CUDA_VISIBLE_DEVICES never disagree.
        (
            {"HIP_VISIBLE_DEVICES": "2,0", "CUDA_VISIBLE_DEVICES": "2,0"},
            ("2", "0"),
            {"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "0"},
        ),
        (
            {"ROCR_VISIBLE_DEVICES": "GPU-4b2c1a9f,GPU-77aa01"},
            ("GPU-4b2c1a9f", "GPU-77aa01"),
            {"ROCR_VISIBLE_DEVICES": "GPU-77aa01"},
        ),
    ],
)
def test_an_outer_amd_mask_is_indexed_into(environ, ids, child):
    inv = _inventory.inventory("auto", environ)
    assert (inv.vendor, inv.ids) == ("amd", ids)
    assert inv.child_env([ids[1]], every=False) == child
    assert inv.visible([ids[1]]) == " ".join(f"{k}={v}" for k, v in child.items())


def test_cuda_visible_devices_on_a_host_with_only_amd_tools_is_hips(tmp_path):
    standins.tool(tmp_path / "bin", "amd-smi", {"list --json": standins.AMD_SMI_LIST})
    inv = _inventory.inventory("auto", {"CUDA_VISIBLE_DEVICES": "1"})
    assert inv.vendor == "amd"
    assert inv.child_env(["1"], every=False) == {"CUDA_VISIBLE_DEVICES": "1"}


# Intel and Ascend --------------------------------------------------------------------


def test_sycl_ls_finds_level_zero_gpus(tmp_path):
    standins.tool(tmp_path / "bin", "sycl-ls", {"": standins.SYCL_LS})
    inv = _inventory.inventory("auto", {})
    assert (inv.vendor, inv.ids) == ("intel", ("0", "1"))
    assert inv.child_env(["1"], every=False) == {"ZE_AFFINITY_MASK": "1"}
    assert inv.child_env([], every=False) == NONE  # Level Zero has no value for none
    old_style = "[ext_oneapi_level_zero:gpu:0] Intel(R) Level-Zero, Intel(R) Arc(TM) A770 1.3"
    assert [d.token for d in _discovery.parse_sycl_ls(old_style)] == ["0"]


def test_xpu_smi_is_intels_second_tool(tmp_path):
    listing = (
        '{"device_list": [{"device_id": 0, "device_name": "Intel(R) Data Center GPU Max 1100"}]}'
    )
    standins.tool(tmp_path / "bin", "xpu-smi", {"discovery --json": listing})
    assert _inventory.inventory("auto", {}).ids == ("0",)


def test_an_outer_ze_affinity_mask_keeps_sub_devices():
    inv = _inventory.inventory("auto", {"ZE_AFFINITY_MASK": "0.1,1.0"})
    assert (inv.vendor, inv.ids) == ("intel", ("0.1", "1.0"))
    assert inv.child_env(["1.0"], every=False) == {"ZE_AFFINITY_MASK": "1.0"}


def test_npu_smi_logic_ids_are_ascends_tokens(tmp_path):
    mapping = "\n".join(
        [
            "        NPU ID     Chip ID     Chip Logic ID     Chip Name",
            "        0          0           0                 Ascend 910B3",
            "        0          1           -                 Mcu",
            "        1          0           1                 Ascend 910B3",
        ]
    )
    standins.tool(tmp_path / "bin", "npu-smi", {"info -m": mapping})
    inv = _inventory.inventory("auto", {})
    assert (inv.vendor, inv.ids) == ("ascend", ("0", "1"))
    assert inv.child_env(["1"], every=False) == {"ASCEND_RT_VISIBLE_DEVICES": "1"}
    outer = _inventory.inventory("auto", {"ASCEND_RT_VISIBLE_DEVICES": "4,6"})
    assert outer.child_env(["6"], every=False) == {"ASCEND_RT_VISIBLE_DEVICES": "6"}


# Choosing the vendor ----------------------------------------------------------------


def test_a_named_vendor_wins_over_what_is_found(tmp_path):
    standins.tool(tmp_path / "bin", "amd-smi", {"list --json": standins.AMD_SMI_LIST})
    inv = _inventory.inventory("auto", {}, "intel")
    assert (inv.vendor, inv.ids) == ("intel", ())
    assert "none found: no ZE_AFFINITY_MASK, sycl-ls, xpu-smi" in inv.describe()
    # Ids trusted as given go into the named vendor's own variable.
    declared = _inventory.inventory("0,1", {}, "amd")
    assert declared.child_env(["1"], every=False) == {"ROCR_VISIBLE_DEVICES": "1"}


def test_nothing_found_is_nvidias_empty_inventory():
    inv = _inventory.inventory("auto", {})
    assert (inv.vendor, inv.ids) == ("nvidia", ())
    # Ids trusted as given, as the project's own CPU tests declare them: as before.
    declared = _inventory.inventory("0,1", {})
    assert declared.child_env(["1"], every=False) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert declared.visible(["1"]) == ""


@pytest.mark.parametrize("bad", ["rocm", "NVIDIA GPU", ""])
def test_bad_vendor_is_a_usage_error_naming_its_source(bad):
    with pytest.raises(pytest.UsageError, match="environment variable SPAWNRUN_GPU_VENDOR: "):
        _vendors.parse_vendor(bad, "environment variable SPAWNRUN_GPU_VENDOR")
    assert _vendors.parse_vendor(" AMD ", "x") == "amd"
    setting = {s.name: s for s in _table.SETTINGS}["gpu_vendor"]
    assert (setting.cli, setting.ini, setting.env) == (
        "--spawn-gpu-vendor",
        "spawn_gpu_vendor",
        "SPAWNRUN_GPU_VENDOR",
    )
