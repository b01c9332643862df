"""A spare fork copies, before its test comes, the pages its test would copy on write.

Runs in a file template's forks (the child side; imports only the standard library).
A fork shares the template's memory until it writes to it; then the kernel copies each
page it writes (copy on write). A Python process writes to nearly every object it
touches (reference counts), so a test's fork copied about 1,600 pages of kornia's
template while pytest ran one 1.4 ms test: its protocol took 12.4 ms instead of 1.4.

A template's first fork (and every ``RECORD_EVERY``-th) writes down, once it said
"done", which of the template's pages it wrote to: the private writable pages that are
present and exclusively its own (``/proc/self/pagemap``: bits 63 and 56). A spare fork
(``_template._Spare``), made while the previous test runs, asks the kernel to copy those
pages now (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14: a write fault on each page,
with its contents unchanged), before it waits for its test. The copies are then made
off the next test's path, on a core the running test leaves free. Nothing the test sees
changes: a page's contents are the same copied or not. Where the kernel lacks any of it,
nothing is rehearsed and the fork copies as it goes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from array import array
from collections.abc import Callable

#: A template's forks that write down their pages: the first, then every this many.
RECORD_EVERY = 32
#: ``MADV_POPULATE_WRITE`` (Linux 5.14).
POPULATE_WRITE = 23
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: A page's pagemap entry, its top byte: present (bit 63) and exclusively mapped (56).
_MINE = 0x81
#: Top bytes of pagemap entries mapped to 1 where the page is present and exclusive.
_TABLE = bytes(1 if value & _MINE == _MINE else 0 for value in range(256))


def _private_writable() -> list[tuple[int, int]]:
    """This process's private writable mappings: (start, end)."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) < 2 or not fields[1].startswith("rw") or fields[1][3] != "p":
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end))
    return found


def dirtied() -> bytes:
    """The ranges of private writable pages this process wrote to since it was forked
    (exclusive and present), as ``array("Q")`` bytes of (start, length) pairs."""
    out = array("Q")
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        for start, end in _private_writable():
            entries = os.pread(pagemap.fileno(), (end - start) // PAGE * 8, start // PAGE * 8)
            mine = entries[7::8].translate(_TABLE)
            index = mine.find(1)
            while index >= 0:
                stop = mine.find(0, index)
                stop = len(mine) if stop < 0 else stop
                out.extend((start + index * PAGE, (stop - index) * PAGE))
                index = mine.find(1, stop)
    return out.tobytes()


def record(path: str) -> None:
    """Write down ``dirtied()`` at ``path`` (replaced whole; never raises)."""
    with contextlib.suppress(Exception):
        words = dirtied()
        partial = f"{path}.{os.getpid()}"
        with open(partial, "wb") as f:
            f.write(words)
        os.replace(partial, path)


#: Bytes copied between two looks at whether the test has come (``rehearse``'s ``until``).
CHUNK = 64 * PAGE


def rehearse(path: str, until: Callable[[], bool] | None = None) -> int:
    """Copy now the pages written down at ``path`` that are private and writable here
    too: the bytes copied (0 where there is nothing to do, or the kernel cannot).
    ``until``: asked between chunks of ``CHUNK`` bytes; True stops the rehearsal (the
    test has come: what is left it copies as it goes, never later than without)."""
    try:
        with open(path, "rb") as f:
            ranges = array("Q")
            ranges.frombytes(f.read())
        mappings = _private_writable()
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except Exception:  # noqa: BLE001 - nothing written down yet, or no such call
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    at = 0
    for i in range(0, len(ranges) - 1, 2):
        start, length = ranges[i], ranges[i + 1]
        while at < len(mappings) and mappings[at][1] <= start:
            at += 1
        if at == len(mappings):
            break
        low, high = mappings[at]
        begin, end = max(start, low), min(start + length, high)
        while begin < end:
            if until is not None and until():
                return done
            step = min(end - begin, CHUNK)
            if madvise(begin, step, POPULATE_WRITE) != 0:
                if ctypes.get_errno() == 22:  # EINVAL: a kernel before 5.14
                    return done
                break
            done += step
            begin += step
    return done
