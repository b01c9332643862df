"""GPUs as pure bookkeeping: inventory, allocation, and memory settling via NVML.

Runs in the parent and never touches CUDA: the inventory comes from
CUDA_VISIBLE_DEVICES, NVML (``nvidia-ml-py``, optional) or ``nvidia-smi -L``; the
allocator hands out device ids; under pytest-xdist a file ledger shares them between
workers. After a child on a GPU exits, its memory is released by the driver
asynchronously; ``settle`` polls NVML until each device's used memory is back near its
level before the test, bounded in time. Without NVML it does nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

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


def _handle(nvml: Any, device: str) -> Any:
    if device.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(device))
    return nvml.nvmlDeviceGetHandleByUUID(device)


def used_memory(devices: list[str]) -> dict[str, int] | None:
    """Used bytes per device (ids as in CUDA_VISIBLE_DEVICES), or None without NVML."""
    nvml = _load()
    if nvml is None or not devices:
        return None
    try:
        return {d: int(nvml.nvmlDeviceGetMemoryInfo(_handle(nvml, d)).used) for d in devices}
    except Exception:  # noqa: BLE001 - a device NVML cannot see: nothing to wait for
        return None


def settle(baseline: dict[str, int] | None, limit: float) -> float:
    """Wait until used memory is back near ``baseline``; return the seconds waited."""
    if not baseline or limit <= 0:
        return 0.0
    start = time.monotonic()
    while True:
        now = used_memory(list(baseline))
        if now is None or all(
            now.get(i, 0) <= used + TOLERANCE_BYTES for i, used in baseline.items()
        ):
            break
        if time.monotonic() - start >= limit:
            break
        time.sleep(_POLL)
    return time.monotonic() - start


# Inventory ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Inventory:
    """The devices this run may hand out, and how they were found (for the header)."""

    ids: tuple[str, ...]
    source: str

    def describe(self) -> str:
        if not self.ids:
            return f"spawnrun: no GPUs ({self.source}); tests that need one are skipped"
        return f"spawnrun: {len(self.ids)} GPU(s) [{', '.join(self.ids)}] ({self.source})"


def parse_visible(value: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: indices or UUIDs, up to the first invalid one."""
    ids: list[str] = []
    for token in (t.strip() for t in value.split(",")):
        if not token:
            break
        if token.lstrip("-").isdigit() and int(token) < 0:
            break  # CUDA stops at the first negative index
        ids.append(token)
    return ids


def discover(environ: Mapping[str, str]) -> Inventory:
    """``auto``: CUDA_VISIBLE_DEVICES, else NVML, else ``nvidia-smi -L``, else none."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return Inventory(tuple(parse_visible(visible)), "from CUDA_VISIBLE_DEVICES")
    nvml = _load()
    if nvml is not None:
        with contextlib.suppress(Exception):
            n = int(nvml.nvmlDeviceGetCount())
            return Inventory(tuple(str(i) for i in range(n)), "from NVML")
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        with contextlib.suppress(Exception):
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
            n = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
            return Inventory(tuple(str(i) for i in range(n)), "from nvidia-smi -L")
    return Inventory((), "none found: no CUDA_VISIBLE_DEVICES, NVML or nvidia-smi")


def parse_gpus(value: object, source: str) -> str:
    """Validate a ``--gpus`` value: auto, none, a count, or a comma list of ids."""
    text = str(value).strip()
    if text.lower() in ("auto", "none") or text.isdigit():
        return text.lower()
    ids = [t.strip() for t in text.split(",")]
    if not text or any(not t or any(c.isspace() for c in t) for t in ids):
        raise pytest.UsageError(
            f"{source}: expected auto, none, a count or a comma-separated list of "
            f"device ids, got {value!r}"
        )
    return ",".join(ids)


def inventory(setting: str, environ: Mapping[str, str]) -> Inventory:
    if setting == "auto":
        return discover(environ)
    if setting == "none":
        return Inventory((), "--gpus none")
    if setting.isdigit():
        found = discover(environ)
        n = int(setting)
        if len(found.ids) >= n:
            return Inventory(found.ids[:n], f"first {n} {found.source}")
        return Inventory(tuple(str(i) for i in range(n)), f"--gpus {n}, trusted as given")
    return Inventory(tuple(setting.split(",")), "declared with --gpus, trusted as given")


# Allocation --------------------------------------------------------------------------


class Allocator:
    """Hands out devices to tests in one process: pure bookkeeping, no processes."""

    def __init__(self, ids: tuple[str, ...]) -> None:
        self.free = list(ids)

    def take(self, count: int) -> list[str] | None:
        if count > len(self.free):
            return None
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def give_back(self, ids: list[str]) -> None:
        self.free.extend(i for i in ids if i not in self.free)


class Ledger(Allocator):
    """Devices shared by the processes of one run (pytest-xdist workers).

    A JSON file ``{device id: owner pid}`` in a run-unique directory, read and written
    under an exclusive ``flock``. An entry whose owner is no longer alive is free, so a
    worker that dies cannot keep its devices.
    """

    def __init__(self, ids: tuple[str, ...], directory: Path) -> None:
        super().__init__(ids)
        self.ids = ids
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "ledger.json"
        self.lock_path = directory / "ledger.lock"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, int]]:
        with open(self.lock_path, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    owners = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    owners = {}
                owners = {d: p for d, p in owners.items() if _alive(p)}
                yield owners
                self.path.write_text(json.dumps(owners))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def take(self, count: int) -> list[str] | None:
        with self._locked() as owners:
            free = [d for d in self.ids if d not in owners]
            if count > len(free):
                return None
            taken = free[:count]
            owners.update({d: os.getpid() for d in taken})
            return taken

    def give_back(self, ids: list[str]) -> None:
        with self._locked() as owners:
            for d in ids:
                if owners.get(d) == os.getpid():
                    del owners[d]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def allocator_for(ids: tuple[str, ...], environ: Mapping[str, str]) -> Allocator:
    """One ledger per xdist run (workers share it); a plain allocator otherwise."""
    uid = environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid and environ.get("PYTEST_XDIST_WORKER"):
        safe = "".join(c for c in uid if c.isalnum())
        return Ledger(ids, Path(tempfile.gettempdir()) / f"spawnrun-devices-{safe}")
    return Allocator(ids)
