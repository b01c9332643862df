"""Which tests hold which devices in one process: the allocator, and its claims' tokens.

Runs in the parent. ``Allocator`` keeps the claims of one process (``_packing`` decides
what fits); the xdist ledger (``_ledger``) shares them between processes. A claim's
token says which process made it and when that process started (``token_for``), so the
ledger can drop the claims of a process that is gone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping

from spawnrun.devices import _packing
from spawnrun.proc import _proctable


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


def token_for(serial: int) -> str:
    """A claim's token: this process's pid (the owner), a serial number, and when the
    owner started (so that another process given its pid later is not taken for it)."""
    return f"{os.getpid()}:{serial}:{started(os.getpid()) or 0}"


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
