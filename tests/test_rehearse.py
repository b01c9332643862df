"""A spare fork copies the pages its test will write before the test comes
(``spawnrun.child._rehearse``): the test's own writes then fault far less, and nothing the
pages hold changes."""

from __future__ import annotations

import os
import sys

import pytest

from spawnrun.child import _rehearse

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="pagemap and madvise are Linux's"
)

PAGES = 512


def _faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _in_fork(work) -> int:  # type: ignore[no-untyped-def]
    """``work()``'s return in a forked child (an int), or -1 where it failed."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            value = int(work())
        except BaseException:  # noqa: BLE001 - told as -1
            value = -1
        os.write(write, str(value).encode())
        os._exit(0)
    os.close(write)
    words = b""
    while chunk := os.read(read, 64):
        words += chunk
    os.close(read)
    os.waitpid(pid, 0)
    return int(words or b"-1")


def test_a_rehearsed_fork_writes_its_pages_without_copying_them_again(tmp_path) -> None:  # type: ignore[no-untyped-def]
    size = PAGES * _rehearse.PAGE
    buffer = bytearray(os.urandom(size))  # the template's memory, shared by its forks
    before = bytes(buffer)
    path = str(tmp_path / "pages")

    def first() -> int:  # a test's fork: writes every page, writes its pages down
        for at in range(0, size, _rehearse.PAGE):
            buffer[at] ^= 0xFF
        _rehearse.record(path)
        return 0

    def writes(rehearse: bool) -> int:  # the next test's fork: its faults writing them
        if rehearse and _rehearse.rehearse(path) == 0:
            return -2  # the kernel cannot (before Linux 5.14)
        if bytes(buffer) != before:
            return -3  # a rehearsal must leave every byte as it was
        start = _faults()
        for at in range(0, size, _rehearse.PAGE):
            buffer[at] ^= 0xFF
        return _faults() - start

    assert _in_fork(first) == 0
    assert os.path.getsize(path) > 0
    plain = _in_fork(lambda: writes(False))
    rehearsed = _in_fork(lambda: writes(True))
    if rehearsed == -2:
        pytest.skip("MADV_POPULATE_WRITE is not supported by this kernel")
    assert rehearsed != -3, "the rehearsal changed the pages' contents"
    assert plain >= PAGES * 0.9, plain  # each write copied its page
    assert 0 <= rehearsed <= PAGES * 0.1, (plain, rehearsed)


def test_pages_written_down_elsewhere_are_left_alone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Ranges that are not private writable mappings here (garbage, another process's
    layout) are skipped, never faulted or written."""
    path = tmp_path / "pages"
    from array import array

    path.write_bytes(array("Q", [8, 4096, 2**47, 2**20]).tobytes())  # unmapped
    assert _in_fork(lambda: _rehearse.rehearse(str(path))) == 0
    path.write_bytes(b"\x01\x02\x03")  # not even whole entries
    assert _in_fork(lambda: _rehearse.rehearse(str(path))) == 0
    assert _in_fork(lambda: _rehearse.rehearse(str(tmp_path / "missing"))) == 0
