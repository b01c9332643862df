"""GPUs as pure bookkeeping: inventory, allocation, and memory settling via NVML.

Runs in the parent and never touches CUDA: the inventory comes from the vendor's
visibility variable (``CUDA_VISIBLE_DEVICES`` and the others of ``_vendors``), NVML
(``nvidia-ml-py``, optional) or the vendor's tool (``nvidia-smi -L``, ``amd-smi``...);
the allocator hands out device ids and plans booted-ahead children onto the least loaded
devices; under pytest-xdist a file ledger shares them between workers. After a child on
a GPU exits, the driver releases its memory asynchronously; ``still_held`` asks NVML
whether the test's processes still hold any, so the next test can wait for exactly
that. Without NVML there is nothing to ask.

Devices are named by their inventory ids (labels such as ``0`` or ``0:mig1``); the run's
inventory (``activate``) says what each one's child gets in its visibility variable and
how NVML finds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import tempfile
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from spawnrun.devices import _inventory
from spawnrun.devices import _packing
from spawnrun.devices import _vendors
from spawnrun.proc import _proctable


def _load() -> Any:
    return _vendors.load_nvml()


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


# Inventory ---------------------------------------------------------------------------


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


# Allocation --------------------------------------------------------------------------


class Allocator:
    """Which tests hold which devices right now, in one process (``_packing`` decides).

    A claim is a test's need on a device: a memory budget (it may share the device
    within ``_packing.Pool``'s rules) or ``_packing.ALONE``. ``free_memory`` reads a
    device's free memory from NVML where it can, so a budget is admitted only where
    it is really free (other processes use GPUs too).
    """

    def __init__(
        self,
        ids: tuple[str, ...],
        capacity: Mapping[str, int | None] | None = None,
        per_gpu: int = 1,
        free_memory: Callable[[str], int | None] | None = None,
    ) -> None:
        self.ids = ids
        self.capacity = dict(capacity or {})
        self.per_gpu = per_gpu
        self.free_memory = free_memory or (lambda device: None)
        self.pool = _packing.Pool(ids, self.capacity, per_gpu)

    @contextlib.contextmanager
    def _pool(self) -> Iterator[_packing.Pool]:
        yield self.pool

    def free(self) -> list[str]:
        """Devices nobody holds, in inventory order."""
        try:
            with self._pool() as pool:
                return pool.idle()
        except TimeoutError:
            return []  # the ledger is out of reach now: nothing is free

    def take(
        self, count: int, need: int | None, token: str, among: list[str] | None = None
    ) -> list[str] | None:
        """``count`` devices that take ``need`` now (least loaded first), or None."""
        try:
            with self._pool() as pool:
                devices = pool.choose(count, need, self.free_memory, among)
                if devices is not None:
                    pool.take(devices, need, token)
                return devices
        except TimeoutError:
            return None  # asked again on the next turn of the loop

    def take_exact(self, ids: list[str], need: int | None, token: str) -> bool:
        try:
            with self._pool() as pool:
                if not all(pool.fits(d, need, self.free_memory(d)) for d in ids):
                    return False
                pool.take(ids, need, token)
                return True
        except TimeoutError:
            return False

    def tokens(self) -> set[str] | None:
        """Every claim's token on the run's devices (None: the ledger is out of reach)."""
        try:
            with self._pool() as pool:
                return {c.token for d in self.ids for c in pool.held(d)}
        except TimeoutError:
            return None

    def give_back(self, ids: list[str], token: str) -> None:
        # A ledger out of reach keeps the claim only while this process lives.
        with contextlib.suppress(TimeoutError), self._pool() as pool:
            pool.give_back(ids, token)

    def others(self) -> tuple[tuple[str, int | None], ...] | None:
        """Other processes' claims, (device, need) each (None: the ledger is out of reach)."""
        try:
            with self._pool() as pool:
                return tuple(
                    (d, c.need) for d in self.ids for c in pool.held(d) if not owned_here(c.token)
                )
        except TimeoutError:
            return None


class Ledger(Allocator):
    """Devices shared by the processes of one run (pytest-xdist workers).

    A JSON file ``{device id: [[owner pid, need, token], ...]}`` in the run's private
    directory (``private_dir``), read and written under an exclusive ``flock`` that is
    waited for a bounded time; written only when a claim changed, always whole (a
    renamed new file). A claim whose owner is no longer alive is dropped, so a
    worker that dies cannot keep its devices. Files are opened without following
    symbolic links.
    """

    def __init__(
        self,
        ids: tuple[str, ...],
        directory: Path,
        capacity: Mapping[str, int | None] | None = None,
        per_gpu: int = 1,
        free_memory: Callable[[str], int | None] | None = None,
    ) -> None:
        super().__init__(ids, capacity, per_gpu, free_memory)
        check_private(directory)
        self.path = directory / "ledger.json"
        self.lock_path = directory / "ledger.lock"
        #: The last state read or written whole (what a file that cannot be parsed is
        #: taken for).
        self._good: dict[str, list[list[Any]]] = {}

    @contextlib.contextmanager
    def _pool(self) -> Iterator[_packing.Pool]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            _lock(fd, LOCK_WAIT)
            try:
                pool = _packing.Pool(self.ids, self.capacity, self.per_gpu)
                read = self._read()
                for device, claims in read.items():
                    for pid, need, token in claims:
                        if _alive(int(pid), _started_of(str(token))):
                            pool.held(str(device)).append(_packing.Claim(str(token), need))
                yield pool
                data = {
                    d: [[_owner(c.token), c.need, c.token] for c in claims]
                    for d, claims in pool.claims.items()
                    if claims
                }
                if data != read:  # a look that changed nothing writes nothing
                    self._write(json.dumps(data))
                    self._good = data
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _read(self) -> dict[str, list[list[Any]]]:
        """The claims on file; where it cannot be parsed, the last good state this
        worker saw (never "no claims": that would hand every device out again).

        A planted link is refused (``OSError``), never followed.
        """
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return {}
        with os.fdopen(fd) as f:
            try:
                data = json.load(f)
            except ValueError:
                return dict(self._good)
        if not isinstance(data, dict):
            return dict(self._good)
        self._good = data
        return data

    def _write(self, text: str) -> None:
        """Whole or not at all: a new file renamed over the old, so a worker killed while
        writing leaves the last state, not an empty or cut file."""
        temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        with os.fdopen(os.open(temporary, flags, 0o600), "w") as f:
            f.write(text)
        os.replace(temporary, self.path)


#: How long a worker waits for the ledger's lock (held for microseconds at a time).
LOCK_WAIT = 30.0


def _lock(fd: int, limit: float) -> None:
    """``flock`` with a bound: a lock nobody gives back is an error, not a hang."""
    end = time.monotonic() + limit
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= end:
                raise TimeoutError(f"the device ledger stayed locked for {limit:g} s") from None
            time.sleep(0.005)


def token_for(serial: int) -> str:
    """A claim's token: this process's pid (the owner), a serial number, and when the
    owner started (so that another process given its pid later is not taken for it)."""
    return f"{os.getpid()}:{serial}:{started(os.getpid()) or 0}"


def _owner(token: str) -> int:
    return int(token.split(":", 1)[0])


def _started_of(token: str) -> int | None:
    parts = token.split(":")
    return int(parts[2]) if len(parts) > 2 and parts[2].isdigit() and parts[2] != "0" else None


def owned_here(token: str) -> bool:
    """Whether a claim's token is this process's (``token_for``), not another worker's."""
    return token.split(":", 1)[0] == str(os.getpid())


def started(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``); None where
    it cannot be read."""
    fields = _proctable.stat_fields(pid)
    if fields is None or len(fields) <= 19 or not fields[19].isdigit():
        return None
    return int(fields[19])


def _alive(pid: int, started_at: int | None = None) -> bool:
    """Whether the worker that made a claim still runs: not gone, not a zombie (a
    worker killed with SIGKILL stays one until its parent reaps it, and its claims
    held every other worker's tests back forever), and, where its start is known, the
    same process (a pid given to another process since)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _proctable.stat_fields(pid)
    if fields is None:
        return True  # no /proc: the signal's word stands
    if fields[:1] in ([b"Z"], [b"X"]):
        return False
    if started_at is not None and len(fields) > 19 and fields[19].isdigit():
        return int(fields[19]) == started_at
    return True


def allocator_for(
    ids: tuple[str, ...],
    ledger: str | None,
    capacity: Mapping[str, int | None],
    per_gpu: int,
) -> Allocator:
    """One ledger per xdist run (its workers share it); a plain allocator otherwise."""
    free = free_memory if _load() is not None else None
    if ledger:
        return Ledger(ids, Path(ledger), capacity, per_gpu, free)
    return Allocator(ids, capacity, per_gpu, free)


def private_dir() -> Path:
    """A new directory only this user can enter, for one xdist run's ledger.

    Made by the controller (``mkdtemp``: mode 0700, an unpredictable name) and handed
    to its workers, so another local user can neither plant files in it nor guess it.
    """
    return Path(tempfile.mkdtemp(prefix="spawnrun-devices-"))


def not_private(directory: Path) -> str:
    """Why ``directory`` is not a private directory of this user ("": it is).

    What others could plant files in is refused: a link, something else than a
    directory, another owner, write access for others. The ledger's directory and the
    children's bytecode directory are checked so.
    """
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.getuid():
        return "belongs to another user"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "may be written by other users"
    return ""


def check_private(directory: Path) -> None:
    """Refuse a ledger directory that is a link, is not ours, or others may write."""
    if not_private(directory):
        raise pytest.UsageError(
            f"spawnrun: the device ledger directory {directory} is not a private directory "
            "of this user (a link, another owner, or writable by others): refusing it"
        )
