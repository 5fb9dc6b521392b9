"""Waiting on descriptors with ``poll(2)``: any descriptor, where ``select(2)`` refuses one numbered 1024 or more
(a trainer with many open files, DataLoader workers or NCCL's sockets has such numbers)."""

from __future__ import annotations

import math
import select

__all__ = ["poll_ms", "readable", "writable"]


def poll_ms(timeout: float) -> int:
    """``timeout`` (seconds) as ``poll()`` counts it: whole milliseconds, rounded up, so that a short wait is not a
    busy loop."""
    return 0 if timeout <= 0 else max(1, math.ceil(timeout * 1000))


def readable(fds: list[int], timeout: float) -> list[int]:
    """The descriptors among ``fds`` with something to read (data, a connection to accept, EOF or an error) within
    ``timeout`` s, in the order given.

    One ``poll(2)``: 1.1 us for two descriptors, where :func:`multiprocessing.connection.wait` builds a
    selector each call (3.4 us). The local schemes poll several times a send, on their round trip.
    """
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ready = {fd for fd, _ in poller.poll(poll_ms(timeout))}
    return [fd for fd in fds if fd in ready]


def writable(fd: int, timeout: float) -> bool:
    """Whether ``fd`` takes more bytes (or failed: the write says how) within ``timeout`` s."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(poll_ms(timeout)))
