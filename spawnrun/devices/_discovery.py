"""How a host's devices are found: each vendor's discovery tool, and its output read.

Runs in the parent; imports nothing from the rest of spawnrun. Each vendor's tools
(``nvidia-smi -L``, ``amd-smi``, ``sycl-ls``, ``npu-smi``...) run as subprocesses with a
timeout (``run_tool``); reading what they print is pure. What they find is a list of
``Device``: a short ``label`` (tags, the header, junitxml, the xdist ledger) and the
``token`` its child's visibility variable gets. NVML's discovery is ``_nvml``'s.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: How long one discovery tool may take (a driver that hangs must not hang the run).
TOOL_TIMEOUT = 30.0
#: Runs a tool: its standard output, or None.
Runner = Callable[[Sequence[str]], str | None]


@dataclass(frozen=True)
class Device:
    """One device to hand out: its name in reports, and what its child's variable gets."""

    label: str
    token: str
    #: Its memory in bytes where discovery reported it (NVML is asked first where it can).
    memory: int | None = None
    #: How NVML finds it (a UUID or NVML's index); None: NVML cannot tell which it is.
    nvml: str | None = None
    #: A MIG instance: one CUDA process sees one.
    mig: bool = False


def run_tool(argv: Sequence[str]) -> str | None:
    """The tool's standard output, or None: not on PATH, failed, or too slow."""
    path = shutil.which(argv[0])
    if path is None:
        return None
    try:
        done = subprocess.run(
            [path, *argv[1:]], capture_output=True, text=True, timeout=TOOL_TIMEOUT, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


# NVIDIA --------------------------------------------------------------------------------

_SMI_GPU = re.compile(r"^GPU (\d+):.*?(?:\(UUID: (GPU-[^)\s]+)\))?\s*$")
_SMI_MIG = re.compile(r"^\s+MIG\b.*?Device\s+(\d+):\s*\(UUID: (MIG-[^)\s]+)\)")


def parse_nvidia_smi(text: str) -> list[Device]:
    """``nvidia-smi -L``: each GPU by its UUID, or its MIG instances where it has them."""
    gpus: list[tuple[str, str | None, list[tuple[str, str]]]] = []
    for line in text.splitlines():
        if match := _SMI_GPU.match(line):
            gpus.append((match.group(1), match.group(2), []))
        elif (match := _SMI_MIG.match(line)) and gpus:
            gpus[-1][2].append((match.group(1), match.group(2)))
    devices: list[Device] = []
    for index, uuid, migs in gpus:
        if migs:
            devices += [Device(f"{index}:mig{j}", u, nvml=u, mig=True) for j, u in migs]
        else:
            devices.append(Device(index, uuid or index, nvml=uuid or index))
    return devices


def find_nvidia(run: Runner) -> tuple[list[Device], str] | None:
    out = run(["nvidia-smi", "-L"])
    return None if out is None else (parse_nvidia_smi(out), "from nvidia-smi -L")


# AMD -----------------------------------------------------------------------------------

_BYTES = {"b": 1, "kb": 2**10, "kib": 2**10, "mb": 2**20, "mib": 2**20, "gb": 2**30, "gib": 2**30}


def _size(value: Any, unit: str = "MB") -> int | None:
    """A size as amd-smi writes it: {"value": 192, "unit": "GB"}, "196592 MB" or a number."""
    if isinstance(value, dict):
        return _size(value.get("value"), str(value.get("unit", unit)))
    if isinstance(value, str):
        parts = value.split()
        if len(parts) == 2:
            return _size(parts[0], parts[1])
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        factor = _BYTES.get(unit.strip().lower())
        return None if factor is None else int(value * factor)
    return None


def _rows(text: str | None) -> list[dict[str, Any]]:
    """amd-smi's JSON: a list of per-GPU objects (some versions wrap it in an object)."""
    try:
        data = json.loads(text or "")
    except ValueError:
        return []
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), [])
    return [row for row in data if isinstance(row, dict)] if isinstance(data, list) else []


def parse_amd_smi(listing: str, vram: str | None = None) -> list[Device]:
    """``amd-smi list --json`` (and ``static --vram --json`` for memory).

    Labelled by amd-smi's GPU index; the token is the device's place in ROCr's own
    enumeration (KFD topology node order, which ``ROCR_VISIBLE_DEVICES`` indexes), so
    a numbering that differs between the two does not move a child to another GPU.
    """
    memory = {str(r.get("gpu")): _size((r.get("vram") or {}).get("size")) for r in _rows(vram)}
    gpus = [r for r in _rows(listing) if str(r.get("gpu", "")).isdigit()]
    nodes = [r.get("node_id") for r in gpus]
    if all(isinstance(n, int) for n in nodes) and len(set(nodes)) == len(nodes):
        order = sorted(range(len(gpus)), key=lambda i: int(gpus[i]["node_id"]))
        rank = {gpus[i]["gpu"]: place for place, i in enumerate(order)}
    else:
        rank = {r["gpu"]: int(r["gpu"]) for r in gpus}
    return [
        Device(str(r["gpu"]), str(rank[r["gpu"]]), memory.get(str(r["gpu"])))
        for r in sorted(gpus, key=lambda r: int(r["gpu"]))
    ]


def parse_rocm_smi(text: str) -> list[Device]:
    """``rocm-smi --showmeminfo vram --json``: ``{"card0": {"VRAM Total Memory (B)": ...}}``."""
    try:
        data = json.loads(text)
    except ValueError:
        return []
    if not isinstance(data, dict):
        return []
    cards = sorted((k for k in data if re.fullmatch(r"card\d+", k)), key=lambda k: int(k[4:]))
    devices = []
    for place, card in enumerate(cards):
        info = data[card] if isinstance(data[card], dict) else {}
        total = _size(info.get("VRAM Total Memory (B)"), "B")
        devices.append(Device(str(place), str(place), total))
    return devices


def find_amd(run: Runner) -> tuple[list[Device], str] | None:
    listing = run(["amd-smi", "list", "--json"])
    if listing is not None:
        vram = run(["amd-smi", "static", "--vram", "--json"])
        return parse_amd_smi(listing, vram), "from amd-smi list"
    out = run(["rocm-smi", "--showmeminfo", "vram", "--json"])
    return None if out is None else (parse_rocm_smi(out), "from rocm-smi")


# Intel ---------------------------------------------------------------------------------

_SYCL_GPU = re.compile(r"^\[(?:ext_oneapi_)?level_zero:gpu(?::(\d+))?\](?:\[level_zero:(\d+)\])?")


def parse_sycl_ls(text: str) -> list[Device]:
    """``sycl-ls``: the Level Zero GPUs, numbered as ``ZE_AFFINITY_MASK`` numbers them."""
    found = []
    for line in text.splitlines():
        if match := _SYCL_GPU.match(line.strip()):
            index = match.group(1) or match.group(2)
            if index is not None:
                found.append(Device(index, index))
    return found


def parse_xpu_smi(text: str) -> list[Device]:
    """``xpu-smi discovery --json``: ``{"device_list": [{"device_id": 0, ...}, ...]}``."""
    try:
        data = json.loads(text)
    except ValueError:
        return []
    rows = data.get("device_list", []) if isinstance(data, dict) else []
    devices = []
    for row in rows:
        if isinstance(row, dict) and str(row.get("device_id", "")).isdigit():
            memory = _size(row.get("memory_physical_size_byte"), "B")
            devices.append(Device(str(row["device_id"]), str(row["device_id"]), memory))
    return devices


def find_intel(run: Runner) -> tuple[list[Device], str] | None:
    out = run(["sycl-ls"])
    if out is not None:
        return parse_sycl_ls(out), "from sycl-ls"
    out = run(["xpu-smi", "discovery", "--json"])
    return None if out is None else (parse_xpu_smi(out), "from xpu-smi discovery")


# Ascend --------------------------------------------------------------------------------


def parse_npu_smi(text: str) -> list[Device]:
    """``npu-smi info -m``: rows of NPU ID, Chip ID, Chip Logic ID, Chip Name.

    ``ASCEND_RT_VISIBLE_DEVICES`` takes logic ids; chips without one (the MCU) are not
    devices to run on.
    """
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0].isdigit() and fields[1].isdigit():
            if fields[2].isdigit():
                found.append(Device(fields[2], fields[2]))
    return found


def find_ascend(run: Runner) -> tuple[list[Device], str] | None:
    out = run(["npu-smi", "info", "-m"])
    return None if out is None else (parse_npu_smi(out), "from npu-smi info -m")
