"""Stand-ins for the hosts spawnrun runs on: a fake NVML, CUDA's numbering, vendor tools.

The host is a JSON file named by ``FAKE_GPU_HOST``: ``{"gpus": [{"uuid", "name", "speed",
"memory", "migs": [{"uuid", "memory"} or null, ...]}, ...]}`` in PCI bus order (NVML's
order). ``FAKE_NVML`` is a ``pynvml`` reading it; ``FAKE_CUDA`` resolves
``CUDA_VISIBLE_DEVICES`` against it as the CUDA driver does (fastest first unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID``), so a test can tell which GPU a child really got.
``tool`` writes a script that prints recorded output, as ``amd-smi``, ``sycl-ls``... do.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

GiB = 2**30

FAKE_NVML = '''
"""A stand-in pynvml: the host described by the JSON file in $FAKE_GPU_HOST."""
import json, os

NVML_DEVICE_MIG_ENABLE = 1


class NVMLError(Exception):
    pass


class _Memory:
    def __init__(self, total):
        self.total, self.free, self.used = total, total, 0


def _host():
    with open(os.environ["FAKE_GPU_HOST"]) as f:
        return json.load(f)


def _all():
    for i, gpu in enumerate(_host()["gpus"]):
        yield ("gpu", i), gpu
        for j, mig in enumerate(gpu.get("migs") or []):
            if mig:
                yield ("mig", i, j), mig


def _get(handle):
    for key, found in _all():
        if key == tuple(handle):
            return found
    raise NVMLError("NVML_ERROR_INVALID_ARGUMENT")


def nvmlInit():
    _host()


def nvmlDeviceGetCount():
    return len(_host()["gpus"])


def nvmlDeviceGetHandleByIndex(index):
    if not 0 <= index < nvmlDeviceGetCount():
        raise NVMLError("NVML_ERROR_INVALID_ARGUMENT")
    return ("gpu", index)


def nvmlDeviceGetHandleByUUID(uuid):
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    for key, found in _all():
        if found["uuid"] == uuid:
            return key
    raise NVMLError("NVML_ERROR_NOT_FOUND")


def nvmlDeviceGetUUID(handle):
    return _get(handle)["uuid"]


def nvmlDeviceGetName(handle):
    return _get(handle)["name"]


def nvmlDeviceGetMemoryInfo(handle):
    return _Memory(_get(handle)["memory"])


class _Process:
    def __init__(self, pid, used):
        self.pid, self.usedGpuMemory = pid, used


def nvmlDeviceGetComputeRunningProcesses(handle):
    """The processes that said they hold memory here: ``$FAKE_GPU_PROCS/<pid>`` holds
    ``<gpu index> <bytes>``; listed while that process lives (not a zombie)."""
    _get(handle)
    folder = os.environ.get("FAKE_GPU_PROCS")
    found = []
    for name in os.listdir(folder) if folder and os.path.isdir(folder) else []:
        try:
            with open(os.path.join(folder, name)) as f:
                index, used = f.read().split()
            with open(f"/proc/{name}/stat") as f:
                alive = f.read().rpartition(")")[2].split()[0] != "Z"
        except (OSError, ValueError):
            continue
        if alive and tuple(handle) == ("gpu", int(index)):
            found.append(_Process(int(name), int(used)))
    return found


def nvmlDeviceGetMigMode(handle):
    if _get(handle).get("migs") is None:
        raise NVMLError("NVML_ERROR_NOT_SUPPORTED")
    return (1, 1)


def nvmlDeviceGetMaxMigDeviceCount(handle):
    return len(_get(handle)["migs"])


def nvmlDeviceGetMigDeviceHandleByIndex(handle, index):
    if not _get(handle)["migs"][index]:
        raise NVMLError("NVML_ERROR_NOT_FOUND")
    return ("mig", handle[1], index)
'''

#: A host without NVIDIA's driver: pynvml is installed, its init fails.
NO_NVML = "def nvmlInit():\n    raise RuntimeError('NVML: driver not loaded (stand-in)')\n"

FAKE_CUDA = '''
"""How the CUDA driver numbers the stand-in host's GPUs in this process."""
import json, os


def _ordered():
    with open(os.environ["FAKE_GPU_HOST"]) as f:
        gpus = json.load(f)["gpus"]
    if os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        return gpus
    return sorted(gpus, key=lambda g: -g["speed"])  # fastest first; ties keep PCI order


def visible_uuids():
    """The UUIDs of cuda:0, cuda:1, ... as this process would see them."""
    gpus = _ordered()
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return [g["uuid"] for g in gpus]
    found = []
    for token in (t.strip() for t in value.split(",")):
        if token.isdigit() and int(token) < len(gpus):
            found.append(gpus[int(token)]["uuid"])
        elif token.startswith("GPU-"):
            match = [g["uuid"] for g in gpus if g["uuid"].startswith(token)]
            if len(match) != 1:
                break
            found.append(match[0])
        else:
            break  # CUDA stops at the first id it cannot use
    return found
'''


def write_host(path: Path, gpus: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"gpus": gpus}))
    return path


def one_h100(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host of one 80 GiB GPU whose stand-in NVML lists the processes that say they
    hold memory on it (a file ``$FAKE_GPU_PROCS/<pid>`` holding "<gpu index> <bytes>"),
    for the inner runs of ``pytester``."""
    procs = pytester.path / "procs"
    procs.mkdir()
    gpus = [{"uuid": "GPU-e0000000-0000", "name": "NVIDIA H100", "speed": 1, "memory": 80 * GiB}]
    monkeypatch.setenv("FAKE_GPU_HOST", str(write_host(pytester.path / "host.json", gpus)))
    monkeypatch.setenv("FAKE_GPU_PROCS", str(procs))
    monkeypatch.setenv("SPAWNRUN_GPUS", "auto")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pytester.makepyfile(pynvml=FAKE_NVML)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path), prepend=":")


def nvml_module(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gpus: list[dict[str, Any]]) -> Any:
    """The stand-in pynvml as a module object, on a host of ``gpus``."""
    monkeypatch.setenv("FAKE_GPU_HOST", str(write_host(tmp_path / "host.json", gpus)))
    module = types.ModuleType("pynvml")
    exec(FAKE_NVML, module.__dict__)
    return module


def tool(bin_dir: Path, name: str, outputs: dict[str, str]) -> None:
    """A script ``name`` that prints ``outputs[arguments]`` (and fails for others)."""
    bin_dir.mkdir(exist_ok=True)
    cases = []
    for args, text in outputs.items():
        assert "'" not in text
        cases.append(f"  '{args}') printf '%s\\n' '{text}' ;;")
    script = '#!/bin/sh\ncase "$*" in\n' + "\n".join(cases) + "\n  *) exit 2 ;;\nesac\n"
    path = bin_dir / name
    path.write_text(script)
    path.chmod(0o755)


#: A mixed host in PCI order: the slower GPU first, so CUDA's fastest-first order differs.
MIXED = [
    {"uuid": "GPU-a100aaaa-0000", "name": "NVIDIA A100-SXM4-40GB", "speed": 1, "memory": 40 * GiB},
    {"uuid": "GPU-h100bbbb-1111", "name": "NVIDIA H100 80GB HBM3", "speed": 2, "memory": 80 * GiB},
]
#: One H200 in MIG mode with three 1g.18gb instances.
MIG = [
    {
        "uuid": "GPU-h200cccc-2222",
        "name": "NVIDIA H200",
        "speed": 3,
        "memory": 141 * GiB,
        "migs": [{"uuid": f"MIG-{n}{n}{n}{n}-aaaa-bbbb", "memory": 18 * GiB} for n in (1, 2, 3)],
    }
]

#: ``amd-smi list --json`` of two MI300X whose amd-smi order is not ROCr's (KFD node order).
AMD_SMI_LIST = json.dumps(
    [
        {
            "gpu": 0,
            "bdf": "0000:11:00.0",
            "uuid": "11ff74a1-0000-1000-8000-000000000001",
            "kfd_id": 4242,
            "node_id": 3,
        },
        {
            "gpu": 1,
            "bdf": "0000:2f:00.0",
            "uuid": "22ff74a1-0000-1000-8000-000000000002",
            "kfd_id": 1717,
            "node_id": 2,
        },
    ]
)
AMD_SMI_VRAM = json.dumps(
    [
        {"gpu": 0, "vram": {"type": "HBM", "size": {"value": 196592, "unit": "MB"}}},
        {"gpu": 1, "vram": {"type": "HBM", "size": {"value": 196592, "unit": "MB"}}},
    ]
)
SYCL_LS = "\n".join(
    [
        "[opencl:cpu][opencl:0] Intel(R) OpenCL, Intel(R) Xeon(R) Platinum 8480+ OpenCL 3.0",
        "[level_zero:gpu][level_zero:0] Intel(R) Level-Zero, Intel(R) Data Center GPU Max "
        "1550 1.3 [1.3.27642]",
        "[level_zero:gpu][level_zero:1] Intel(R) Level-Zero, Intel(R) Data Center GPU Max "
        "1550 1.3 [1.3.27642]",
    ]
)
