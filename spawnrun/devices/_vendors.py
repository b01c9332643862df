"""Accelerator vendors: which of them a run uses, and how a child sees only its own devices.

Runs in the parent. One ``Vendor`` per kind of accelerator (NVIDIA, AMD, Intel, Ascend)
says which variables its runtime reads to restrict the devices a process sees, in which
order it applies them, and which tools find its devices (``_discovery``; NVIDIA's are
asked of NVML first, ``_nvml``). No framework (torch, jax) is imported in the parent.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field

import pytest

from spawnrun.devices import _discovery

CUDA_VAR = "CUDA_VISIBLE_DEVICES"


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
    find: Callable[[_discovery.Runner], tuple[list[_discovery.Device], str] | None] = field(
        compare=False, repr=False
    )
    #: Aliases read at one level: a child gets the same subset in each one the parent set.
    aliases: tuple[str, ...] = ()


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


# The table -----------------------------------------------------------------------------

NVIDIA = Vendor(
    "nvidia", (CUDA_VAR,), CUDA_VAR, {CUDA_VAR: ""}, ("nvidia-smi",), _discovery.find_nvidia
)
# ROCr applies ROCR_VISIBLE_DEVICES first; HIP then indexes what it left with
# HIP_VISIBLE_DEVICES, or CUDA_VISIBLE_DEVICES, its alias. ROCR_VISIBLE_DEVICES set but
# empty enumerates no GPU at all, below HIP.
AMD = Vendor(
    "amd",
    ("HIP_VISIBLE_DEVICES", CUDA_VAR, "ROCR_VISIBLE_DEVICES"),
    "ROCR_VISIBLE_DEVICES",
    {"ROCR_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", CUDA_VAR: ""},
    ("amd-smi", "rocm-smi"),
    _discovery.find_amd,
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
    _discovery.find_intel,
)
ASCEND = Vendor(
    "ascend",
    ("ASCEND_RT_VISIBLE_DEVICES",),
    "ASCEND_RT_VISIBLE_DEVICES",
    {CUDA_VAR: ""},
    ("npu-smi",),
    _discovery.find_ascend,
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
