"""Accelerator vendors: how a host's devices are found, and how a child sees only its own.

Runs in the parent. One ``Vendor`` per kind of accelerator (NVIDIA, AMD, Intel, Ascend)
says which variables its runtime reads to restrict the devices a process sees, and in
which order it applies them. Devices are found by the vendor's own tool (a subprocess
with a timeout) or, for NVIDIA, through NVML (the caller, ``_devices``, hands in the
loaded ``pynvml``); no framework (torch, jax) is imported in the parent. Parsing the
tools' output is pure. Each device is named by a short ``label`` (tags, the header,
junitxml, the xdist ledger) and handed to its child as a ``token`` that cannot be
renumbered there: a UUID for NVIDIA devices found through NVML or ``nvidia-smi -L``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import pytest

#: How long one discovery tool may take (a driver that hangs must not hang the run).
TOOL_TIMEOUT = 30.0
CUDA_VAR = "CUDA_VISIBLE_DEVICES"
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


@dataclass(frozen=True)
class Vendor:
    name: str
    #: Variables that restrict the devices its runtime sees, innermost first (applied
    #: last): the first one set in the parent is the outer mask a child's tokens come from.
    masks: tuple[str, ...]
    #: What spawnrun sets when the parent has none of ``masks``.
    own: str
    #: What a child that needs no device (count=0) gets.
    hidden: Mapping[str, str]
    #: Discovery tools, in the order they are tried (their presence picks the vendor).
    tools: tuple[str, ...]
    #: Runs the tools (through the runner it is given) and reads what they print.
    find: Callable[[Runner], tuple[list[Device], str] | None] = field(compare=False, repr=False)
    #: Aliases read at one level: a child gets the same subset in each one the parent set.
    aliases: tuple[str, ...] = ()


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


def parse_visible(value: str) -> list[str]:
    """A visibility variable as CUDA reads it: ids up to the first empty or negative one.

    The same reading serves every vendor's variable: an index, a UUID, or Intel's
    ``device.sub-device`` form are kept as written.
    """
    ids: list[str] = []
    for token in (t.strip() for t in value.split(",")):
        if not token:
            break
        if token.lstrip("-").isdigit() and int(token) < 0:
            break  # CUDA (and HIP, which follows it) stops at the first negative index
        ids.append(token)
    return ids


# NVIDIA --------------------------------------------------------------------------------

_nvml: Any = None
_nvml_failed = False


def load_nvml() -> Any:
    """``pynvml``, initialized once; None without the library or a driver."""
    global _nvml, _nvml_failed
    if _nvml is None and not _nvml_failed:
        try:
            import pynvml  # type: ignore[import-not-found, unused-ignore]

            pynvml.nvmlInit()
            _nvml = pynvml
        except Exception:  # noqa: BLE001 - no library, no driver: no NVML
            _nvml_failed = True
    return _nvml


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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _total(nvml: Any, handle: Any) -> int | None:
    try:
        return int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception:  # noqa: BLE001 - a figure NVML cannot give is unknown, not an error
        return None


def from_nvml(nvml: Any) -> tuple[list[Device], str]:
    """Every GPU by its UUID and memory; a GPU in MIG mode as its MIG instances instead."""
    devices: list[Device] = []
    found_mig = False
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        migs = _mig_instances(nvml, handle, index)
        if migs is None:
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            devices.append(Device(str(index), uuid, _total(nvml, handle), nvml=uuid))
        else:
            found_mig = True
            devices += migs
    return devices, "MIG instances from NVML" if found_mig else "from NVML"


def _mig_instances(nvml: Any, handle: Any, index: int) -> list[Device] | None:
    """A GPU's MIG instances (each its own memory), or None where MIG mode is off."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except Exception:  # noqa: BLE001 - not MIG-capable (or an older driver): a whole GPU
        return None
    if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return None
    found: list[Device] = []
    for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except Exception:  # noqa: BLE001 - no instance in this slot
            continue
        uuid = _text(nvml.nvmlDeviceGetUUID(mig))
        found.append(Device(f"{index}:mig{slot}", uuid, _total(nvml, mig), nvml=uuid, mig=True))
    return found


def nvml_index(token: str, environ: Mapping[str, str], nvml: Any) -> str | None:
    """How NVML names a CUDA id given by the user (None: it cannot be told).

    A UUID is the same for both. An index is CUDA's, fastest first unless
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; NVML numbers in PCI order. The two agree under
    PCI_BUS_ID, with one GPU, or where every GPU is the same model; elsewhere NVML's
    figures for that index could be another GPU's, so none are used.
    """
    if not token.isdigit() or nvml is None:
        return token
    if environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        return token
    try:
        count = int(nvml.nvmlDeviceGetCount())
        if count <= 1:
            return token  # one GPU: no order to disagree on
        names = {
            _text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)
        }
    except Exception:  # noqa: BLE001 - nothing known about the models: no figures
        return None
    return token if len(names) <= 1 else None


def _find_nvidia(run: Runner) -> tuple[list[Device], str] | None:
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


def _find_amd(run: Runner) -> tuple[list[Device], str] | None:
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


def _find_intel(run: Runner) -> tuple[list[Device], str] | None:
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


def _find_ascend(run: Runner) -> tuple[list[Device], str] | None:
    out = run(["npu-smi", "info", "-m"])
    return None if out is None else (parse_npu_smi(out), "from npu-smi info -m")


# The table -----------------------------------------------------------------------------

NVIDIA = Vendor("nvidia", (CUDA_VAR,), CUDA_VAR, {CUDA_VAR: ""}, ("nvidia-smi",), _find_nvidia)
# ROCr applies ROCR_VISIBLE_DEVICES first; HIP then indexes what it left with
# HIP_VISIBLE_DEVICES, or CUDA_VISIBLE_DEVICES, its alias. ROCR_VISIBLE_DEVICES set but
# empty enumerates no GPU at all, below HIP.
AMD = Vendor(
    "amd",
    ("HIP_VISIBLE_DEVICES", CUDA_VAR, "ROCR_VISIBLE_DEVICES"),
    "ROCR_VISIBLE_DEVICES",
    {"ROCR_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", CUDA_VAR: ""},
    ("amd-smi", "rocm-smi"),
    _find_amd,
    aliases=("HIP_VISIBLE_DEVICES", CUDA_VAR),
)
# Level Zero and Ascend's runtime document no value meaning "no device": a child that
# needs none keeps them (and gets CUDA_VISIBLE_DEVICES empty, as on every host).
INTEL = Vendor(
    "intel",
    ("ZE_AFFINITY_MASK",),
    "ZE_AFFINITY_MASK",
    {CUDA_VAR: ""},
    ("sycl-ls", "xpu-smi"),
    _find_intel,
)
ASCEND = Vendor(
    "ascend",
    ("ASCEND_RT_VISIBLE_DEVICES",),
    "ASCEND_RT_VISIBLE_DEVICES",
    {CUDA_VAR: ""},
    ("npu-smi",),
    _find_ascend,
)
VENDORS = {v.name: v for v in (NVIDIA, AMD, INTEL, ASCEND)}
NAMES = ("auto", *VENDORS)


def parse_vendor(value: object, source: str) -> str:
    text = str(value).strip().lower()
    if text not in NAMES:
        raise pytest.UsageError(f"{source}: expected {', '.join(NAMES)}, got {value!r}")
    return text


def choose(setting: str, environ: Mapping[str, str], nvml_found: bool) -> Vendor:
    """The vendor whose devices the run hands out.

    Named, it is that one. ``auto``: a vendor's own variable set in the parent (an
    outer mask says what the user means to use), then ``CUDA_VISIBLE_DEVICES`` (NVIDIA's,
    or AMD's where only AMD's tools are there: HIP reads it too), then the first
    vendor whose NVML or tool is found; NVIDIA when none is.
    """
    if setting != "auto":
        return VENDORS[setting]
    for vendor in (AMD, INTEL, ASCEND):
        if any(var != CUDA_VAR and var in environ for var in vendor.masks):
            return vendor
    nvidia = nvml_found or _has_tool(NVIDIA)
    if CUDA_VAR in environ:
        return AMD if not nvidia and _has_tool(AMD) else NVIDIA
    if nvidia:
        return NVIDIA
    return next((v for v in (AMD, INTEL, ASCEND) if _has_tool(v)), NVIDIA)


def _has_tool(vendor: Vendor) -> bool:
    return any(shutil.which(tool) for tool in vendor.tools)


def outer_mask(vendor: Vendor, environ: Mapping[str, str]) -> tuple[str, list[str]] | None:
    """The innermost of the vendor's variables set in the parent, and its ids."""
    for var in vendor.masks:
        if var in environ:
            return var, parse_visible(environ[var])
    return None


def carriers(vendor: Vendor, variable: str, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The variables a child's tokens go into: ``variable``, and its aliases the parent set.

    HIP_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES both set (say by a launcher) get the
    same subset, so the two never disagree in the child.
    """
    if variable not in vendor.aliases:
        return (variable,)
    return (variable, *(a for a in vendor.aliases if a != variable and a in environ))
