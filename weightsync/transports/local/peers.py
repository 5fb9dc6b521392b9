"""The process at the other end of a worker's channel, and whether it is gone.

Memory a worker maps (a shared slot, a CUDA IPC share of the trainer's GPU
memory) may be rewritten or given back only once the process that maps it has
exited: a worker dropped after a timeout, refused, or replaced by a rejoining
process may still be alive and still reading it (for ``shared_mem``, its model
*is* that memory). :class:`PeerProcess` names that process by the kernel's
word (``SO_PEERCRED`` of the connected socket, not what the peer says) and
holds a ``pidfd`` on it, so its exit is seen without polling ``/proc`` and a
reused pid is never mistaken for it. :class:`Departed` keeps the CUDA shares
handed to processes given up on until each has exited.
"""

from __future__ import annotations

import os
import select
import socket
import struct
from collections.abc import Callable, Iterable
from typing import Any

from ...tensors import cuda

__all__ = ["Departed", "PeerProcess"]

_UCRED = struct.Struct("3i")  # pid, uid, gid


class PeerProcess:
    """A process, watched until it exits.

    Args:
        pid: its process id; ``None``: unknown, and treated as never gone (nothing it may map is released).
    """

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self._fd = -1
        self._gone = False
        if pid is None or pid <= 0:
            return
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True  # it exited already
        except (OSError, AttributeError):  # no pidfd on this kernel: fall back to /proc
            self._fd = -1

    @classmethod
    def of_socket(cls, fd: int) -> PeerProcess:
        """The process at the other end of a connected Unix socket (as the kernel saw it connect)."""
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                pid, _, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError:
            return cls(None)
        return cls(pid)

    def fileno(self) -> int:
        """Its ``pidfd`` (readable once it exited), or ``-1`` where there is none (unknown, gone, or no pidfd)."""
        return self._fd

    def gone(self) -> bool:
        """Whether the process has exited (once gone, always gone)."""
        if self._gone:
            return True
        if self._fd >= 0:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)  # a pidfd is readable once its process exited
            self._gone = bool(poller.poll(0))
        elif self.pid is not None and self.pid > 0:
            self._gone = not os.path.exists(f"/proc/{self.pid}")
        if self._gone:
            self.close()
        return self._gone

    # (os.close bound at definition: at interpreter exit, the module's ``os`` may be gone before this object)
    def close(self, _close: Callable[[int], None] = os.close) -> None:
        if self._fd >= 0:
            _close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"process {self.pid}"


class Departed:
    """Transports (:class:`~.mp.MPTransport`) of worker processes given up on or replaced: the CUDA shares handed
    to each (``shares``, what its process holds a reference of) are released once its process is known to have
    exited, and only then (released before, they would take references a live process holds)."""

    def __init__(self) -> None:
        self.transports: list[Any] = []

    def add(self, transport: Any) -> None:
        if transport.shares and transport not in self.transports:
            self.transports.append(transport)

    def release(self, given_up: Iterable[Any] = ()) -> None:
        """Release the shares of the processes known to have exited (``given_up``: transports of workers given up
        on but still connected in name, added first)."""
        for transport in given_up:
            self.add(transport)
        keep = []
        for transport in self.transports:
            if transport.process is not None and transport.process.gone():
                for shares in transport.shares.values():
                    for share in shares:
                        cuda.release_share(share)
                transport.shares = {}
            else:
                keep.append(transport)
        self.transports = keep
