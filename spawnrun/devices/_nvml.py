"""NVML, the NVIDIA driver's management library: loaded once, the GPUs it finds.

Runs in the parent, never touching CUDA; imports only ``_discovery`` of spawnrun.
``load_nvml`` initializes ``pynvml`` (``nvidia-ml-py``, optional) once; ``from_nvml``
finds every GPU (or its MIG instances) by UUID with its memory, and ``nvml_index`` says
how NVML names a CUDA id the user gave. What NVML says of the run's devices while tests
run is ``_devices``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spawnrun.devices import _discovery

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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _total(nvml: Any, handle: Any) -> int | None:
    try:
        return int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception:  # noqa: BLE001 - a figure NVML cannot give is unknown, not an error
        return None


def from_nvml(nvml: Any) -> tuple[list[_discovery.Device], str]:
    """Every GPU by its UUID and memory; a GPU in MIG mode as its MIG instances instead."""
    devices: list[_discovery.Device] = []
    found_mig = False
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        migs = _mig_instances(nvml, handle, index)
        if migs is None:
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            devices.append(_discovery.Device(str(index), uuid, _total(nvml, handle), nvml=uuid))
        else:
            found_mig = True
            devices += migs
    return devices, "MIG instances from NVML" if found_mig else "from NVML"


def _mig_instances(nvml: Any, handle: Any, index: int) -> list[_discovery.Device] | None:
    """A GPU's MIG instances (each its own memory), or None where MIG mode is off."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except Exception:  # noqa: BLE001 - not MIG-capable (or an older driver): a whole GPU
        return None
    if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return None
    found: list[_discovery.Device] = []
    for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except Exception:  # noqa: BLE001 - no instance in this slot
            continue
        uuid = _text(nvml.nvmlDeviceGetUUID(mig))
        found.append(
            _discovery.Device(f"{index}:mig{slot}", uuid, _total(nvml, mig), nvml=uuid, mig=True)
        )
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
