"""Length-prefixed frames read with bounds: the framing of :class:`multiprocessing.connection.Connection`.

A frame is a 4-byte big-endian signed length (``-1``: an 8-byte unsigned length follows), then that many bytes.
``Connection.recv_bytes`` trusts the length and blocks until the whole frame is in: a peer that announces
2**62 bytes makes it raise ``MemoryError``, and one that sends half a frame holds it for as long as it likes.
Here the length is checked before a byte of the body is read, and a frame is read against one deadline for
the whole of it, never past its end (what follows may carry file descriptors).
"""

from __future__ import annotations

import math
import os
import select
import struct

from ...core.timing import remaining
from ...errors import SyncTimeoutError, TransportError

__all__ = ["FrameReader", "frame", "read_frame"]


def frame(data: bytes) -> bytes:
    """``data`` framed as :meth:`multiprocessing.connection.Connection.send_bytes` frames it (under 2 GiB)."""
    return struct.pack("!i", len(data)) + data


class FrameReader:
    """Reads one length-prefixed frame a piece at a time, refusing a length over ``limit`` before reading it."""

    def __init__(self, limit: int, what: str) -> None:
        self._limit, self._what = limit, what
        self._head = bytearray()
        self._size: int | None = None
        self._body: list[bytes] = []
        self._got = 0

    def want(self) -> int:
        """How many bytes to read next (never past the end of this frame: what follows may carry descriptors)."""
        if self._size is None:
            return (4 if len(self._head) < 4 else 12) - len(self._head)
        return self._size - self._got

    def feed(self, data: bytes) -> bytes | None:
        """Take ``data`` (at most :meth:`want` bytes); the frame's bytes once complete, else ``None``.

        Raises:
            TransportError: the length header is negative or over the limit.
        """
        if self._size is None:
            self._head += data
            if len(self._head) == 4:
                (size,) = struct.unpack("!i", self._head)
                if size != -1:  # -1: an 8-byte length follows (frames over 2 GiB)
                    self._sized(size)
            elif len(self._head) == 12:
                self._sized(struct.unpack("!Q", self._head[4:])[0])
        else:
            self._body.append(data)
            self._got += len(data)
        if self._size is not None and self._got == self._size:
            return b"".join(self._body)
        return None

    def _sized(self, size: int) -> None:
        if not 0 <= size <= self._limit:
            raise TransportError(f"{self._what} announced a frame of {size} bytes (at most {self._limit}); refused")
        self._size = size


def read_frame(fd: int, deadline: float, limit: int, what: str) -> bytes:
    """One whole frame from blocking descriptor ``fd`` by ``deadline`` (the frame as a whole, not each read).

    Raises:
        SyncTimeoutError: the frame was not complete by ``deadline``.
        TransportError: its length is over ``limit``.
        EOFError: the peer closed its end.
    """
    reader = FrameReader(limit, what)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        if not poller.poll(max(0, math.ceil(remaining(deadline) * 1000))):
            raise SyncTimeoutError(f"{what} did not send a whole frame in time")
        data = os.read(fd, min(reader.want(), 1 << 20))  # readable: returns at once, never past this frame
        if not data:
            raise EOFError(f"{what} closed the connection")
        whole = reader.feed(data)
        if whole is not None:
            return whole
