"""GPUs as pure bookkeeping: inventory, allocation, and memory settling via NVML.

Runs in the parent and never touches CUDA: the inventory comes from
CUDA_VISIBLE_DEVICES, NVML (``nvidia-ml-py``, optional) or ``nvidia-smi -L``; the
allocator hands out device ids and plans booted-ahead children onto the least loaded
devices; under pytest-xdist a file ledger shares them between workers. After a child on
a GPU exits, the driver releases its memory asynchronously; ``still_held`` asks NVML
whether the test's processes still hold any, so the next test can wait for exactly
that. Without NVML there is nothing to ask.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

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
    """Validate a ``--spawn-gpus`` value: auto, none, a count, or a comma list of device ids.

    An id is an index (``0``) or a UUID as ``CUDA_VISIBLE_DEVICES`` takes it
    (``GPU-...``, ``MIG-...``); each may appear once. A bare number is a count; a list may
    end with a comma, which is how one index alone is written (``0,``: device 0).
    The value is kept in that form: a single index keeps its comma.
    """
    text = str(value).strip()
    if text.lower() in ("auto", "none") or text.isdigit():
        return text.lower()
    listed = text[:-1] if text.endswith(",") else text
    ids = [t.strip() for t in listed.split(",")]
    bad = [t for t in ids if not _is_device_id(t)]
    if not listed or bad:
        shown = ", ".join(repr(t) for t in bad) if listed else "nothing"
        raise pytest.UsageError(
            f"{source}: expected auto, none, a count or a comma-separated list of "
            f"device ids (indices such as 0,1 or GPU-/MIG- UUIDs; one index alone: 0,), "
            f"got {value!r} ({shown} is no device id)"
        )
    repeated = sorted({t for t in ids if ids.count(t) > 1})
    if repeated:
        raise pytest.UsageError(
            f"{source}: device {', '.join(repeated)} is listed more than once in {value!r}; "
            "each device is handed to one test at a time"
        )
    joined = ",".join(ids)
    return joined + "," if joined.isdigit() else joined


def _is_device_id(text: str) -> bool:
    if text.isdigit():
        return True
    prefix, _, rest = text.partition("-")
    return prefix in ("GPU", "MIG") and bool(rest) and not any(c.isspace() for c in rest)


def inventory(setting: str, environ: Mapping[str, str]) -> Inventory:
    if setting == "auto":
        return discover(environ)
    if setting == "none":
        return Inventory((), "--spawn-gpus none")
    if setting.isdigit():
        found = discover(environ)
        n = int(setting)
        if len(found.ids) >= n:
            return Inventory(found.ids[:n], f"first {n} {found.source}")
        if found.ids:
            # Some devices are visible, fewer than asked: never hand out others.
            raise pytest.UsageError(
                f"--spawn-gpus {n}: only {len(found.ids)} GPU(s) visible "
                f"({', '.join(found.ids)}, {found.source})"
            )
        return Inventory(tuple(str(i) for i in range(n)), f"--spawn-gpus {n}, trusted as given")
    ids = tuple(t for t in setting.split(",") if t)  # "0,": device 0 alone
    return Inventory(ids, "declared with --spawn-gpus, trusted as given")


# Allocation --------------------------------------------------------------------------


def least_loaded(ids: tuple[str, ...], load: Mapping[str, int], count: int) -> list[str]:
    """The ``count`` devices with the fewest tests running or planned, in inventory order.

    Used to plan a child booted ahead: its devices are fixed when it starts, so it goes
    where the queue is shortest; ties go to the lower index.
    """
    order = {d: i for i, d in enumerate(ids)}
    chosen = sorted(ids, key=lambda d: (load.get(d, 0), order[d]))[:count]
    return sorted(chosen, key=order.__getitem__)


class Allocator:
    """Which devices are held right now, in one process: pure bookkeeping."""

    def __init__(self, ids: tuple[str, ...]) -> None:
        self.ids = ids
        self.busy: set[str] = set()

    def free(self) -> list[str]:
        """Devices nobody holds, in inventory order."""
        return [d for d in self.ids if d not in self.busy]

    def take(self, count: int) -> list[str] | None:
        """Any ``count`` free devices (the first in inventory order), or None."""
        free = self.free()
        if count > len(free):
            return None
        taken = free[:count]
        return taken if self.take_exact(taken) else None

    def take_exact(self, ids: list[str]) -> bool:
        if any(d in self.busy for d in ids):
            return False
        self.busy.update(ids)
        return True

    def give_back(self, ids: list[str]) -> None:
        self.busy.difference_update(ids)


class Ledger(Allocator):
    """Devices shared by the processes of one run (pytest-xdist workers).

    A JSON file ``{device id: owner pid}`` in a run-unique directory, read and written
    under an exclusive ``flock``. An entry whose owner is no longer alive is free, so a
    worker that dies cannot keep its devices.
    """

    def __init__(self, ids: tuple[str, ...], directory: Path) -> None:
        super().__init__(ids)
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

    def free(self) -> list[str]:
        with self._locked() as owners:
            return [d for d in self.ids if d not in owners]

    def take_exact(self, ids: list[str]) -> bool:
        with self._locked() as owners:
            if any(d in owners for d in ids):
                return False
            owners.update({d: os.getpid() for d in ids})
            return True

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
        return Ledger(ids, ledger_dir(uid))
    return Allocator(ids)


def ledger_dir(testrunuid: str) -> Path:
    """The ledger's directory for one xdist run (the controller removes it at the end)."""
    safe = "".join(c for c in testrunuid if c.isalnum())
    return Path(tempfile.gettempdir()) / f"spawnrun-devices-{safe}"
