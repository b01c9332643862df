"""The xdist ledger: devices shared by the processes of one run, in a private file.

Runs in the parent (each pytest-xdist worker). ``Ledger`` is an allocator whose claims
live in a JSON file under a bounded ``flock``, in a directory only this user can enter
(``private_dir``, checked by ``not_private``); a claim whose owner is gone is dropped.
``allocator_for`` gives a run its ledger, or a plain ``_allocator.Allocator``.
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

from spawnrun.devices import _allocator
from spawnrun.devices import _devices
from spawnrun.devices import _nvml
from spawnrun.devices import _packing
from spawnrun.proc import _proctable


class Ledger(_allocator.Allocator):
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


def _owner(token: str) -> int:
    return int(token.split(":", 1)[0])


def _started_of(token: str) -> int | None:
    parts = token.split(":")
    return int(parts[2]) if len(parts) > 2 and parts[2].isdigit() and parts[2] != "0" else None


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
) -> _allocator.Allocator:
    """One ledger per xdist run (its workers share it); a plain allocator otherwise."""
    free = _devices.free_memory if _nvml.load_nvml() is not None else None
    if ledger:
        return Ledger(ids, Path(ledger), capacity, per_gpu, free)
    return _allocator.Allocator(ids, capacity, per_gpu, free)


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
