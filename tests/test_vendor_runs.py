"""Each vendor end to end, on stand-in hosts: every child gets exactly its devices.

A stand-in NVML (``pynvml`` in the suite's folder), CUDA's own numbering (``fakecuda``,
which the children call) and vendor tools on PATH (``amd-smi``, ``sycl-ls``) make the
hosts; PATH holds nothing else, so a real tool of the machine running these tests is
never found. Each test of the inner suite records the visibility variables it was
started with; the parent's junitxml says which devices it was given.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import vendor_standins as standins

from spawnrun.devices import _inventory

VARS = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "ZE_AFFINITY_MASK",
    "ASCEND_RT_VISIBLE_DEVICES",
)

SUITE = """
import json, os, time
from pathlib import Path
import pytest

RECORDS = Path(os.environ["SPAWNRUN_DEMO_RECORDS"])
AT_ONCE = int(os.environ["SPAWNRUN_DEMO_AT_ONCE"])


def _record(request):
    row = {"env": {k: os.environ.get(k) for k in VARS}}
    if os.environ.get("FAKE_GPU_HOST"):
        import fakecuda  # the children's CUDA, numbering the host's GPUs its own way

        row["uuids"] = fakecuda.visible_uuids()
    (RECORDS / (request.node.name + ".json")).write_text(json.dumps(row))


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(AT_ONCE))
def test_one(request, i):
    _record(request)
    # Wait for the others: they run at once (on different devices), or this one fails.
    (RECORDS / f"here-{i}").touch()
    end = time.monotonic() + 60
    while len(list(RECORDS.glob("here-*"))) < AT_ONCE:
        assert time.monotonic() < end, "the tests did not run at once"
        time.sleep(0.05)


@pytest.mark.gpu(count=0)
def test_none(request):
    _record(request)


@pytest.mark.gpu(count=2)
def test_two(request):
    _record(request)
""".replace("VARS", repr(VARS))

MIG_EXTRA = """

@pytest.mark.gpu(memory="20GiB")
def test_big():
    pass
"""

U = {g["uuid"][:8]: g["uuid"] for g in standins.MIXED}
MIGS = [m["uuid"] for m in standins.MIG[0]["migs"]]
ROCR_OUTER = "GPU-x1,GPU-y2,GPU-z3"

# name: (host for NVML, tools, parent environment, tests at once, header, the visibility
# variables a child on ids gets, what a child with count=0 gets)
SCENARIOS = {
    "nvidia-mixed-host": (
        standins.MIXED,
        {},
        {},
        2,
        "spawnrun: 2 GPU(s) [[]0, 1[]] (nvidia, from NVML; each child gets "
        "CUDA_VISIBLE_DEVICES=<its UUID>)",
        lambda ids: {"CUDA_VISIBLE_DEVICES": ",".join(standins.MIXED[int(i)]["uuid"] for i in ids)},
        {"CUDA_VISIBLE_DEVICES": ""},
    ),
    "nvidia-mig": (
        standins.MIG,
        {},
        {},
        3,
        "spawnrun: 3 GPU(s) [[]0:mig0, 0:mig1, 0:mig2[]] (nvidia, MIG instances from NVML; "
        "each child gets CUDA_VISIBLE_DEVICES=<its UUID>, one MIG instance per test)",
        lambda ids: {"CUDA_VISIBLE_DEVICES": ",".join(MIGS[int(i[-1])] for i in ids)},
        {"CUDA_VISIBLE_DEVICES": ""},
    ),
    "amd-smi-xdist": (
        None,
        {"amd-smi": {"list --json": standins.AMD_SMI_LIST}},
        {},
        1,
        "spawnrun: 2 GPU(s) [[]0, 1[]] (amd, from amd-smi list; each child gets "
        "ROCR_VISIBLE_DEVICES=<its index>)",
        # amd-smi's GPU 0 is ROCr's second (KFD node order)
        lambda ids: {"ROCR_VISIBLE_DEVICES": ",".join({"0": "1", "1": "0"}[i] for i in ids)},
        {"ROCR_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": ""},
    ),
    "amd-outer-mask": (
        None,
        {},
        {"ROCR_VISIBLE_DEVICES": ROCR_OUTER, "HIP_VISIBLE_DEVICES": "2,0"},
        2,
        "spawnrun: 2 GPU(s) [[]2, 0[]] (amd, from HIP_VISIBLE_DEVICES; each child gets a "
        "subset of it)",
        lambda ids: {"HIP_VISIBLE_DEVICES": ",".join(ids), "ROCR_VISIBLE_DEVICES": ROCR_OUTER},
        {"ROCR_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": ""},
    ),
    "intel-sycl-ls": (
        None,
        {"sycl-ls": {"": standins.SYCL_LS}},
        {},
        2,
        "spawnrun: 2 GPU(s) [[]0, 1[]] (intel, from sycl-ls; each child gets "
        "ZE_AFFINITY_MASK=<its index>)",
        lambda ids: {"ZE_AFFINITY_MASK": ",".join(ids)},
        {"CUDA_VISIBLE_DEVICES": ""},
    ),
    "intel-outer-mask": (
        None,
        {},
        {"ZE_AFFINITY_MASK": "0.1,1.0"},
        2,
        "spawnrun: 2 GPU(s) [[]0.1, 1.0[]] (intel, from ZE_AFFINITY_MASK; each child gets "
        "a subset of it)",
        lambda ids: {"ZE_AFFINITY_MASK": ",".join(ids)},
        {"CUDA_VISIBLE_DEVICES": "", "ZE_AFFINITY_MASK": "0.1,1.0"},  # not hidden: no value
    ),
}


#: The variables each scenario's children get their tokens in (the junitxml property).
CARRIERS = {
    "nvidia-mixed-host": ["CUDA_VISIBLE_DEVICES"],
    "nvidia-mig": ["CUDA_VISIBLE_DEVICES"],
    "amd-smi-xdist": ["ROCR_VISIBLE_DEVICES"],
    "amd-outer-mask": ["HIP_VISIBLE_DEVICES"],  # ROCR_VISIBLE_DEVICES stays the parent's
    "intel-sycl-ls": ["ZE_AFFINITY_MASK"],
    "intel-outer-mask": ["ZE_AFFINITY_MASK"],
}


def _junit(path):
    cases = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cases[case.get("name")] = {p.get("name"): p.get("value") for p in case.iter("property")}
    return cases


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_child_gets_exactly_its_devices(pytester, monkeypatch, name):
    host, tools, environ, at_once, header, gets, hidden = SCENARIOS[name]
    mig = name == "nvidia-mig"
    for var in ("SPAWNRUN_GPUS", "FAKE_GPU_HOST", "CUDA_DEVICE_ORDER", *VARS):
        monkeypatch.delenv(var, raising=False)
    pytester.makepyfile(test_suite=SUITE + (MIG_EXTRA if mig else ""))
    if host is None:
        pytester.makepyfile(pynvml=standins.NO_NVML)  # were one installed: no driver
    else:
        pytester.makepyfile(pynvml=standins.FAKE_NVML, fakecuda=standins.FAKE_CUDA)
        monkeypatch.setenv(
            "FAKE_GPU_HOST", str(standins.write_host(pytester.path / "host.json", host))
        )
    bin_dir = pytester.mkdir("bin")
    for tool, outputs in tools.items():
        standins.tool(bin_dir, tool, outputs)
    monkeypatch.setenv("PATH", str(bin_dir))
    records = pytester.mkdir("records")
    monkeypatch.setenv("SPAWNRUN_DEMO_RECORDS", str(records))
    monkeypatch.setenv("SPAWNRUN_DEMO_AT_ONCE", str(at_once))
    for var, value in environ.items():
        monkeypatch.setenv(var, value)
    xml = pytester.path / "out.xml"
    xdist = ["-n", "2"] if name.endswith("xdist") else []
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-v", "-rs", f"--junitxml={xml}", *xdist
    )
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    result.stdout.fnmatch_lines([header])
    if mig:
        # count=2 is refused with its reason; budgets are the instance's own 18 GiB.
        result.assert_outcomes(passed=4, skipped=2)
        result.stdout.fnmatch_lines(
            [
                f"SKIPPED*: needs 2 GPUs, *MIG instances: {_inventory.MIG_ONE_PER_PROCESS}",
                "SKIPPED*: needs 20.0 GiB of GPU memory*more than the device's 18.0 GiB",
            ],
            consecutive=False,
        )
    else:
        result.assert_outcomes(passed=at_once + 2)
    if not xdist:
        result.stdout.fnmatch_lines(["*test_one?0? PASSED [[]gpu *[]]*", "*isolated in*"])

    junit = _junit(xml)
    rows = {p.stem: json.loads(p.read_text()) for p in records.glob("*.json")}
    given = {}
    for test, row in rows.items():
        ids = junit[test].get("spawnrun_devices")
        env = {k: v for k, v in row["env"].items() if v is not None}
        if ids is None:
            assert env == hidden, test  # count=0: no device
            continue
        given[test] = ids
        if "uuids" in row and not mig:
            # What CUDA made of its variable in the child: the very GPUs (NVML's ids 0, 1)
            # the parent assigned, in that order, whatever CUDA's own numbering.
            assert row["uuids"] == [host[int(i)]["uuid"] for i in ids.split(",")], test
        expected = gets(ids.split(","))
        assert env == expected, test  # its devices, exactly, and nothing stale beside
        shown = " ".join(f"{k}={expected[k]}" for k in CARRIERS[name])
        tag = junit[test].get(_inventory.VISIBLE_PROPERTY, "")
        assert tag == ("" if shown == "CUDA_VISIBLE_DEVICES=" + ids else shown), test
    ones = [ids for test, ids in given.items() if test.startswith("test_one")]
    assert len(ones) == at_once
    assert len(set(ones)) == at_once  # at once, each on its own device
