"""The process at the other end of a worker's channel, and whether it is gone.

Memory a worker maps (a shared slot, a CUDA IPC share of the trainer's GPU
memory) may be rewritten or given back only once the process that maps it has
exited: a worker dropped after a timeout, refused, or replaced by a rejoining
process may still be alive and still reading it (for ``shared_mem``, its model
*is* that memory). :class:`PeerProcess` names that process by the kernel's
word (``SO_PEERCRED`` of the connected socket, not what the peer says) and
holds a ``pidfd`` on it, so its exit is seen without polling ``/proc`` and a
reused pid is never mistaken for it.
"""

from __future__ import annotations

import os
import select
import socket
import struct
from collections.abc import Callable

__all__ = ["PeerProcess"]

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
