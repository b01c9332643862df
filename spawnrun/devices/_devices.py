"""The run's devices as NVML sees them now: their memory, and who still holds it.

Runs in the parent and never touches CUDA; NVML (``_nvml``) is asked about the run's
devices as the inventory names them (``_inventory``). After a child on a GPU exits, the
driver releases its memory asynchronously; ``still_held`` asks NVML whether the test's
processes still hold any, so the next test can wait for exactly that. Without NVML (or
on another vendor's devices) there is nothing to ask, and every answer is None.
"""

from __future__ import annotations

from typing import Any

from spawnrun.devices import _inventory
from spawnrun.devices import _nvml


def _load() -> Any:
    return _nvml.load_nvml()


def nvml_available() -> bool:
    """Whether NVML can tell about the run's devices (not another vendor's)."""
    return _load() is not None and _inventory.active().vendor == "nvidia"


def _nvml_name(device: str) -> str | None:
    """How NVML finds the run's device ``device`` (None: it cannot tell which it is)."""
    active = _inventory.active()
    if active.vendor != "nvidia":
        return None  # NVML knows NVIDIA GPUs only
    return active.device(device).nvml


def _handle(nvml: Any, device: str) -> Any:
    name = _nvml_name(device)
    if name is None:
        raise LookupError(f"NVML cannot tell which GPU device {device} is")
    if name.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(name))
    # A GPU- or MIG- UUID (a MIG instance's handle has the instance's own memory).
    return nvml.nvmlDeviceGetHandleByUUID(name)


def still_held(devices: list[str], pids: set[int]) -> bool | None:
    """Whether NVML still lists any of ``pids`` on ``devices``; None without NVML.

    A GPU's memory comes back when the driver has torn down the exited process's
    context, which can lag its exit; NVML lists a process until then. Asking for the
    test's own processes (not a memory level) keeps other processes on the device,
    such as children booted ahead, from making the wait last.
    """
    nvml = _load()
    if nvml is None or not devices or not pids:
        return None
    try:
        for device in devices:
            handle = _handle(nvml, device)
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in pids:
                    return True
    except Exception:  # noqa: BLE001 - a device NVML cannot see: nothing to wait for
        return None
    return False


def total_memory(device: str) -> int | None:
    """The device's memory in bytes, from NVML (None: NVML cannot tell)."""
    info = _memory_info(device)
    return None if info is None else int(info.total)


def free_memory(device: str) -> int | None:
    """The device's free memory in bytes right now, from NVML (None: cannot tell)."""
    info = _memory_info(device)
    return None if info is None else int(info.free)


def _memory_info(device: str) -> Any:
    nvml = _load()
    if nvml is None:
        return None
    try:
        return nvml.nvmlDeviceGetMemoryInfo(_handle(nvml, device))
    except Exception:  # noqa: BLE001 - a device NVML cannot see (declared, or gone)
        return None


def process_memory(devices: list[str], pids: set[int]) -> int | None:
    """The most memory ``pids`` hold together on any one of ``devices`` (None: unknown)."""
    nvml = _load()
    if nvml is None or not devices or not pids:
        return None
    most = 0
    try:
        for device in devices:
            handle = _handle(nvml, device)
            used = 0
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in pids and isinstance(proc.usedGpuMemory, int):
                    used += proc.usedGpuMemory
            most = max(most, used)
    except Exception:  # noqa: BLE001 - a figure for learning is never worth a failure
        return None
    return most


def capacities(ids: tuple[str, ...], declared: int | None) -> dict[str, int | None]:
    """Each device's memory: NVML's total (else the vendor tool's), at most ``declared``
    (--spawn-gpu-memory)."""
    found: dict[str, int | None] = {}
    for device in ids:
        total = total_memory(device)
        if total is None:
            total = _inventory.active().device(device).memory  # as the vendor's tool said
        if total is None:
            found[device] = declared
        else:
            found[device] = total if declared is None else min(total, declared)
    return found
