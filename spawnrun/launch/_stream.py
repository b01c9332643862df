"""A child's pipe read without blocking: its framed messages, decoded as they arrive
whole, and ``Died`` once it ended or cannot be read on.

Runs in the parent, for a test's child (``_runner.ChildProcess``) and the zygote
(``_zygoteproc.Zygote``) alike.
"""

from __future__ import annotations

import os
import struct
from multiprocessing.connection import wait
from typing import Any

from spawnrun.wire import _protocol as proto


class Died:
    """The child's pipe ended, or can no longer be read (``cause``: why not)."""

    def __init__(self, cause: str = "") -> None:
        self.cause = cause


#: How much one read of a pipe takes at most, so that a child sending without end does
#: not keep the event loop from its other events (the rest is read on the next turn).
_READ_CHUNK = 1 << 16
_READS_PER_TURN = 64
#: A message longer than this is taken for a corrupt stream: a child cuts what it sends
#: to ``_protocol.MESSAGE_LIMIT`` (``_protocol.frame``), so each child's partial message
#: held here stays bounded.
MAX_MESSAGE = 4 * proto.MESSAGE_LIMIT


class Stream:
    """The messages in a pipe of ``multiprocessing.Connection``'s framing, never blocking.

    ``Connection.recv`` waits for a whole message: after ``poll`` says a byte is there,
    a partial one (a test that wrote to the pipe, a child killed mid-send) would stall
    the event loop. This reads only what is there, keeps a partial message for later,
    and decodes whole ones with ``_protocol.decode``. ``problem`` says why the stream
    cannot be read on (corrupt, or ended inside a message); nothing is read after it.
    """

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.ended = False
        self.problem = ""

    def read(self, fd: int) -> list[Any]:
        """The messages that arrived whole; ``ended`` or ``problem`` tell the rest."""
        for _ in range(_READS_PER_TURN):
            if self.ended or self.problem or not wait([fd], 0):
                break
            try:
                data = os.read(fd, _READ_CHUNK)
            except OSError:
                data = b""  # ECONNRESET and the like: the other end is gone
            if not data:
                self.ended = True
                break
            self.buffer += data
        out = self._messages()
        if self.ended and self.buffer and not self.problem:
            self.problem = (
                f"the stream ended inside a message ({len(self.buffer)} bytes of it "
                "arrived): a message cut short, or bytes the test wrote into the pipe"
            )
        return out

    def _messages(self) -> list[Any]:
        out = []
        while not self.problem:
            buf = self.buffer
            if len(buf) < 4:
                break
            (size,) = struct.unpack("!i", buf[:4])
            start = 4
            if size == -1:  # a message longer than 2 GiB announces its size in 8 bytes
                if len(buf) < 12:
                    break
                (size,) = struct.unpack("!Q", buf[4:12])
                start = 12
            if not 0 <= size <= MAX_MESSAGE:
                self.problem = f"a message announced a size of {size} bytes (a corrupt stream)"
                break
            if len(buf) < start + size:
                break
            frame = bytes(buf[start : start + size])
            del buf[: start + size]
            try:
                out.append(proto.decode(frame))
            except Exception as exc:  # noqa: BLE001 - whatever the bytes were
                self.problem = f"a message could not be decoded: {exc}"
        return out
