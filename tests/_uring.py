"""The kernel writing into a process's memory through pages pinned for it, as a device's DMA into registered host
memory does: an io_uring fixed buffer (registered once: its pages pinned) read into with ``READ_FIXED``. Plain
system calls through ctypes, x86-64 and aarch64 Linux (5.1 and later).

    ring = FixedBuffer(tensor)           # OSError where io_uring is not allowed here
    ring.read_into(fd, nbytes)           # the kernel writes the file's first bytes into the tensor
    ring.close()
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

import torch

_SETUP, _ENTER, _REGISTER = 425, 426, 427  # (the same numbers on every architecture)
_REGISTER_BUFFERS, _OP_READ_FIXED, _ENTER_GETEVENTS = 0, 4, 1
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class FixedBuffer:
    """A ring of one entry whose one fixed buffer is ``tensor``'s memory (contiguous, on the CPU)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        params = ctypes.create_string_buffer(120)  # struct io_uring_params
        fd = self._libc.syscall(_SETUP, 1, params)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "io_uring_setup")
        self.fd = fd
        sq_entries, cq_entries = struct.unpack_from("II", params, 0)
        self._sq_off = struct.unpack_from("7I", params, 40)  # head, tail, ring_mask, entries, flags, dropped, array
        self._cq_off = struct.unpack_from("6I", params, 80)  # head, tail, ring_mask, entries, overflow, cqes
        self._sq = mmap.mmap(fd, self._sq_off[6] + 4 * sq_entries, offset=_OFF_SQ_RING)
        self._cq = mmap.mmap(fd, self._cq_off[5] + 16 * cq_entries, offset=_OFF_CQ_RING)
        self._sqes = mmap.mmap(fd, 64 * sq_entries, offset=_OFF_SQES)
        self.tensor = tensor
        self._iov = _Iovec(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if self._libc.syscall(_REGISTER, fd, _REGISTER_BUFFERS, ctypes.byref(self._iov), 1) < 0:
            error = ctypes.get_errno()
            self.close()
            raise OSError(error, "io_uring_register")

    def read_into(self, source_fd: int, nbytes: int) -> int:
        """The kernel reads ``nbytes`` of ``source_fd`` (from its start) into the buffer; the bytes it read."""
        tail = struct.unpack_from("I", self._sq, self._sq_off[1])[0]
        index = tail & struct.unpack_from("I", self._sq, self._sq_off[2])[0]
        sqe = bytearray(64)
        struct.pack_into("<BBHiQQI", sqe, 0, _OP_READ_FIXED, 0, 0, source_fd, 0, self.tensor.data_ptr(), nbytes)
        self._sqes[64 * index : 64 * index + 64] = bytes(sqe)  # (buf_index 0: the one fixed buffer)
        struct.pack_into("I", self._sq, self._sq_off[6] + 4 * index, index)
        struct.pack_into("I", self._sq, self._sq_off[1], tail + 1)
        if self._libc.syscall(_ENTER, self.fd, 1, 1, _ENTER_GETEVENTS, None, 0) < 0:
            raise OSError(ctypes.get_errno(), "io_uring_enter")
        head = struct.unpack_from("I", self._cq, self._cq_off[0])[0]
        entry = self._cq_off[5] + 16 * (head & struct.unpack_from("I", self._cq, self._cq_off[2])[0])
        result = struct.unpack_from("i", self._cq, entry + 8)[0]
        struct.pack_into("I", self._cq, self._cq_off[0], head + 1)
        if result < 0:
            raise OSError(-result, "READ_FIXED")
        return result

    def close(self) -> None:
        for name in ("_sq", "_cq", "_sqes"):
            if hasattr(self, name):
                getattr(self, name).close()
        os.close(self.fd)
