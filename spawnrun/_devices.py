"""Device memory settling through NVML, without ever touching CUDA.

Runs in the parent. After a child on a GPU exits, its memory is released by the
driver asynchronously; the next test may start before it is free. ``settle`` polls
NVML (``nvidia-ml-py``, optional) until each device's used memory is back near its
level before the test, bounded in time. Without NVML it does nothing.
"""

from __future__ import annotations

import os
import time
from typing import Any

#: Used memory this close to the baseline counts as settled.
TOLERANCE_BYTES = 64 * 2**20
_POLL = 0.05
_nvml: Any = None
_nvml_failed = False


def _load() -> Any:
    global _nvml, _nvml_failed
    if _nvml is None and not _nvml_failed:
        try:
            import pynvml  # type: ignore[import-not-found, unused-ignore]

            pynvml.nvmlInit()
            _nvml = pynvml
        except Exception:  # noqa: BLE001 - no library, no driver: nothing to wait for
            _nvml_failed = True
    return _nvml


def _indices(nvml: Any) -> list[int]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        parts = [p.strip() for p in visible.split(",") if p.strip()]
        if all(p.isdigit() for p in parts):
            return [int(p) for p in parts]
    return list(range(int(nvml.nvmlDeviceGetCount())))


def used_memory() -> dict[int, int] | None:
    """Used bytes per visible device, or None without NVML."""
    nvml = _load()
    if nvml is None:
        return None
    try:
        return {
            i: int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).used)
            for i in _indices(nvml)
        }
    except Exception:  # noqa: BLE001
        return None


def settle(baseline: dict[int, int] | None, limit: float) -> float:
    """Wait until used memory is back near ``baseline``; return the seconds waited."""
    if not baseline or limit <= 0:
        return 0.0
    start = time.monotonic()
    while True:
        now = used_memory()
        if now is None or all(
            now.get(i, 0) <= used + TOLERANCE_BYTES for i, used in baseline.items()
        ):
            break
        if time.monotonic() - start >= limit:
            break
        time.sleep(_POLL)
    return time.monotonic() - start
