"""The machine's processes as ``/proc`` tells them (Linux), for the parent and children.

Imports only the standard library: the parent reads it to find what a test left behind
and whether a peer worker lives (``_runner``, ``_devices``), and the process that runs a
test reads it to find what it still has running as it leaves (``_leftovers``).
"""

from __future__ import annotations

import os


def stat_fields(pid: int) -> list[bytes] | None:
    """``/proc/<pid>/stat``'s fields after the process's name (its state first); None
    where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def live_processes() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, process group, session) of every live process (Linux /proc).

    Zombies are left out; without /proc there is nothing to list.
    """
    procs: dict[int, tuple[int, int, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return procs
    for name in names:
        if not name.isdigit():
            continue
        # os.open and one read, not a file object: each child's end looks at every
        # process of the machine (half the cost).
        try:
            fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
        except OSError:
            continue
        try:
            stat = os.read(fd, 4096)
        except OSError:
            continue
        finally:
            os.close(fd)
        # Fields after the parenthesized command: state ppid pgrp session ...
        fields = stat[stat.rfind(b")") + 2 :].split(None, 4)
        if len(fields) > 3 and fields[0] != b"Z":
            procs[int(name)] = (int(fields[1]), int(fields[2]), int(fields[3]))
    return procs
