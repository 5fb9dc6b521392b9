"""Which bytes of some CPU tensors were written since they were last looked at, asked of the kernel rather than
read: Linux's userfaultfd in its asynchronous write-protect mode (``UFFD_FEATURE_WP_ASYNC``) and the pagemap scan
(``PAGEMAP_SCAN``), both Linux 6.7 and later.

:meth:`WrittenPages.written` write-protects the tensors' pages; the first write to a protected page, by any code of
this process (through any view of it: ``.data``, numpy, a C library, the kernel's own ``read()`` into it), makes
the kernel lift the protection (a minor fault, about half a microsecond) and mark the page written; the next call
reads those marks and protects the pages again, in one ioctl per run of memory. A page is reported written
whenever the kernel cannot say otherwise: the first time a tensor is seen, memory unmapped and mapped again, a
tensor moved or resized. What it does not see: writes by another process into memory it shares (such memory is
never tracked: only memory that ``/proc/self/maps`` shows private and anonymous is registered, and any other
tensor counts as written whole), and writes by a device or by the kernel through pages pinned for it (DMA, an
io_uring fixed buffer's read, an RDMA registration: they reach the page without the fault that marks it). So GPU
tensors are not tracked, nor are CPU tensors page-locked for a device (``is_pinned``), and while this process pins
memory that way (``VmPin`` in ``/proc/self/status``, which the kernel counts and which says not where; pins it
counts elsewhere, VFIO's, are not seen) every tensor counts as written whole.

Where the kernel lacks either feature, or a seccomp profile refuses the ``userfaultfd`` system call (Docker's
default does), :func:`open_tracker` returns ``None`` and callers read everything, as without it.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import platform
import struct
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

__all__ = ["PAGE", "WrittenPages", "open_tracker"]

log = logging.getLogger("weightsync.tensors.written")

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
_UFFD_USER_MODE_ONLY = 1  # (faults in the kernel are not ours to handle: an unprivileged process may ask so)
_UFFD_API = 0xAA
_FEATURE_WP_UNPOPULATED, _FEATURE_WP_ASYNC = 1 << 13, 1 << 15
_REGISTER_MODE_WP = 2
_PM_SCAN_WP_MATCHING, _PM_SCAN_CHECK_WPASYNC = 1 << 0, 1 << 1
_PAGE_IS_WRITTEN = 1 << 1
_REGIONS = 1024  # page runs one scan returns at most (it is called again from where it stopped)


def _iowr(kind: int, number: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | number


_UFFDIO_API = _iowr(0xAA, 0x3F, 24)  # struct uffdio_api {api, features, ioctls}
_UFFDIO_REGISTER = _iowr(0xAA, 0x00, 32)  # struct uffdio_register {range {start, len}, mode, ioctls}
_UFFDIO_WRITEPROTECT = _iowr(0xAA, 0x06, 24)  # struct uffdio_writeprotect {range {start, len}, mode}
_PAGEMAP_SCAN = _iowr(ord("f"), 16, 96)  # struct pm_scan_arg (12 u64)

#: Byte ranges ``[lo, hi)`` of a tensor, from its first byte.
Ranges = list[tuple[int, int]]


class _Kernel:
    """This process's userfaultfd (asynchronous write-protect) and pagemap: which page runs are tracked, and by
    whom (a run is one owner's: another's scan would clear the marks it counts on)."""

    def __init__(self) -> None:
        number = _SYS_USERFAULTFD.get(platform.machine())
        if number is None:
            raise OSError(f"no userfaultfd on {platform.system()} {platform.machine()}")
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(number, os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY)
        if fd < 0:
            error = ctypes.get_errno()
            raise OSError(error, f"userfaultfd: {os.strerror(error)}")
        try:
            api = bytearray(struct.pack("QQQ", _UFFD_API, _FEATURE_WP_ASYNC | _FEATURE_WP_UNPOPULATED, 0))
            fcntl.ioctl(fd, _UFFDIO_API, api, True)  # (EINVAL: a feature this kernel does not have)
            self.pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(fd)
            raise
        self.uffd = fd
        #: The process whose memory this is (a forked child inherits the descriptors, which still speak of it).
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.claims: dict[int, list[tuple[int, int]]] = {}  # owner's id: the page runs it tracks
        self._regions = np.zeros(3 * _REGIONS, dtype=np.uint64)  # struct page_region {start, end, categories}

    def claim(self, owner: int, runs: list[tuple[int, int]]) -> list[bool]:
        """Give ``owner`` the page runs no other owner tracks (the rest it may not scan); whether each is its."""
        others = [run for who, held in self.claims.items() if who != owner for run in held]
        mine = [not any(a < hi and lo < b for a, b in others) for lo, hi in runs]
        self.claims[owner] = [run for run, ok in zip(runs, mine) if ok]
        return mine

    def scan(self, lo: int, hi: int) -> list[tuple[int, int]] | None:
        """The runs of pages of ``[lo, hi)`` written since protected (addresses), which are protected again;
        ``None`` where a page of it is not tracked (not registered, or the mapping changed since)."""
        out: list[tuple[int, int]] = []
        at = lo
        while at < hi:
            arg = bytearray(
                struct.pack(
                    "12Q",
                    96,  # (the struct's size)
                    _PM_SCAN_WP_MATCHING | _PM_SCAN_CHECK_WPASYNC,
                    at,
                    hi,
                    0,  # walk_end, written back: where the scan stopped
                    self._regions.ctypes.data,
                    _REGIONS,
                    0,  # max_pages: no limit
                    0,  # category_inverted
                    _PAGE_IS_WRITTEN,  # category_mask: pages written
                    0,  # category_anyof_mask
                    _PAGE_IS_WRITTEN,  # return_mask
                )
            )
            try:
                found = fcntl.ioctl(self.pagemap, _PAGEMAP_SCAN, arg, True)
            except OSError:  # (EPERM: a page without write-protect tracking; EINVAL: no such ioctl)
                return None
            out.extend((int(a), int(b)) for a, b, _ in self._regions[: 3 * found].reshape(-1, 3).tolist())
            walked = struct.unpack_from("Q", arg, 32)[0]
            if walked <= at:
                return None
            at = walked
        return out

    def register(self, lo: int, hi: int) -> bool:
        """Track ``[lo, hi)``'s pages and protect them; whether they could be (anonymous memory private to this
        process: the kernel would take shared memory too, whose writes by another process it cannot see)."""
        if not _private_anonymous(lo, hi):
            return False
        arg = bytearray(struct.pack("QQQQ", lo, hi - lo, _REGISTER_MODE_WP, 0))
        try:
            fcntl.ioctl(self.uffd, _UFFDIO_REGISTER, arg, True)
        except OSError as exc:
            log.debug("pages %#x..%#x not tracked: %s", lo, hi, exc)
            return False
        return self.scan(lo, hi) is not None

    def unprotect(self, lo: int, hi: int) -> None:
        """Lift ``[lo, hi)``'s protection (its pages then count as written); nothing where the kernel refuses."""
        try:
            fcntl.ioctl(self.uffd, _UFFDIO_WRITEPROTECT, bytearray(struct.pack("QQQ", lo, hi - lo, 0)), True)
        except OSError as exc:
            log.debug("pages %#x..%#x left protected: %s", lo, hi, exc)


class WrittenPages:
    """One owner's view of the kernel's record: which bytes of its tensors were written since it last looked.

    Made by :func:`open_tracker`; thread-safe; :meth:`close` gives its memory back to other owners. In a process
    forked from the one that made it, it knows nothing (every tensor is written whole) and changes nothing.
    """

    def __init__(self, kernel: _Kernel) -> None:
        self._kernel = kernel
        # Per key: (first byte's address, bytes) when last protected; a key seen otherwise is written whole.
        self._seen: dict[str, tuple[int, int]] = {}

    def written(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Ranges | None]:
        """For each tensor, the byte ranges written since the last call that saw it under the same key, at the same
        address and size (``None``: all of it, for one not seen so or not trackable: not a contiguous CPU tensor,
        memory the kernel will not protect, memory another owner tracks); the tensors' pages are then protected
        again, so that the next call reports the writes from now on.

        Blocks for the ioctls (one per run of pages, microseconds each), a read of ``/proc/self/status`` and, where
        a device runtime runs, a question to it per tensor.
        """
        kernel = self._kernel
        out: dict[str, Ranges | None] = dict.fromkeys(tensors)
        if kernel.pid != os.getpid():  # (made before a fork: its record is of the parent's pages)
            return out
        if _pins_memory():  # (writes through a pin leave no mark, and the kernel does not say which pages it pins)
            self._seen = {}  # (each tensor is written whole at the next call too, which protects its pages again)
            return out
        # (a tensor page-locked for a device is never claimed, so protect and unprotect, within claims, skip it too)
        extents = [
            (where, key)
            for key, tensor in tensors.items()
            if (where := _extent(tensor)) is not None and not _pinned(tensor)
        ]
        # (tensors sharing a page are scanned as one run: a scan clears the marks of the whole page)
        runs: list[tuple[int, int, list[tuple[str, tuple[int, int]]]]] = []
        for where, key in sorted(extents):
            lo, hi = _pages(*where)
            if runs and lo <= runs[-1][1]:
                runs[-1] = (runs[-1][0], max(runs[-1][1], hi), [*runs[-1][2], (key, where)])
            else:
                runs.append((lo, hi, [(key, where)]))
        seen: dict[str, tuple[int, int]] = {}
        with kernel.lock:
            granted = kernel.claim(id(self), [(lo, hi) for lo, hi, _ in runs])
            for (lo, hi, held), ok in zip(runs, granted):
                if not ok:
                    continue
                marks = kernel.scan(lo, hi)
                if marks is None:  # (not tracked yet, or mapped anew)
                    if kernel.register(lo, hi):
                        seen.update(held)
                    continue
                seen.update(held)
                for key, where in held:
                    if self._seen.get(key) == where:
                        out[key] = _within(marks, *where)
        self._seen = seen
        return out

    def protect(self, tensors: Sequence[torch.Tensor]) -> None:
        """Protect the pages of ``tensors`` (those this owner tracks) again after writing them: what was written
        there so far is forgotten, the marks of the other pages are kept."""
        self._each_run(tensors, lambda kernel, lo, hi: kernel.scan(lo, hi))

    def unprotect(self, tensors: Sequence[torch.Tensor]) -> None:
        """Lift the protection of the pages of ``tensors`` (those this owner tracks) before writing them whole:
        one call for each, where a write would fault once per page. They count as written until the next
        :meth:`written` protects them again."""
        self._each_run(tensors, _Kernel.unprotect)

    def _each_run(self, tensors: Sequence[torch.Tensor], call: Callable[[_Kernel, int, int], object]) -> None:
        """``call(kernel, lo, hi)`` on each run of the pages of ``tensors`` (merged where they touch) inside the
        runs this owner tracks."""
        pages = sorted(_pages(*where) for where in map(_extent, tensors) if where is not None)
        runs: list[tuple[int, int]] = []
        for lo, hi in pages:
            if runs and lo <= runs[-1][1]:
                runs[-1] = (runs[-1][0], max(runs[-1][1], hi))
            else:
                runs.append((lo, hi))
        kernel = self._kernel
        if kernel.pid != os.getpid():
            return
        with kernel.lock:
            mine = kernel.claims.get(id(self), [])
            for lo, hi in runs:
                if any(a <= lo and hi <= b for a, b in mine):
                    call(kernel, lo, hi)

    def close(self) -> None:
        """Stop tracking (other owners may then track this memory)."""
        with self._kernel.lock:
            self._kernel.claims.pop(id(self), None)
        self._seen = {}

    def __del__(self) -> None:
        claims = getattr(getattr(self, "_kernel", None), "claims", None)
        if claims is not None:
            claims.pop(id(self), None)


def _within(marks: list[tuple[int, int]], start: int, nbytes: int) -> Ranges:
    """The byte ranges of ``[start, start + nbytes)`` inside ``marks`` (address runs, in order), from its start."""
    out: Ranges = []
    for first, end in marks:
        a, b = max(first, start) - start, min(end, start + nbytes) - start
        if a >= b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _private_anonymous(lo: int, hi: int) -> bool:
    """Whether every byte of ``[lo, hi)`` is mapped, privately and without a file behind it (``/proc/self/maps``:
    read once per run of memory registered, about 1 ms)."""
    at = lo
    with open("/proc/self/maps") as maps:
        for line in maps:  # (in address order)
            fields = line.split(maxsplit=5)
            first, end = (int(x, 16) for x in fields[0].split("-"))
            if end <= at:
                continue
            if first > at:
                return False  # a hole
            if fields[1][3] != "p" or fields[4] != "0":  # shared, or a file's pages
                return False
            at = end
            if at >= hi:
                return True
    return False


def _pages(start: int, nbytes: int) -> tuple[int, int]:
    return start - start % PAGE, -(-(start + nbytes) // PAGE) * PAGE


def _extent(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The tensor's bytes as ``(address, size)``, where the kernel can track them (contiguous, on the CPU, not
    empty)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


def _pinned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory is page-locked for a device, whose copies into it are DMA (torch asks the
    device's runtime only where it started: a microsecond or so then); where the question fails (a process forked
    from one that ran CUDA), it counts as pinned."""
    try:
        return bool(tensor.is_pinned())
    except RuntimeError:
        return True


_said_pinned = False


def _pins_memory() -> bool:
    """Whether this process holds memory pinned for a device or for the kernel (``VmPin``: io_uring's fixed
    buffers, RDMA registrations), said once in the log; about 30 microseconds."""
    global _said_pinned
    try:
        with open("/proc/self/status") as status:
            pinned = next((int(line.split()[1]) for line in status if line.startswith("VmPin:")), 0)
    except (OSError, ValueError, IndexError):
        return False
    if pinned and not _said_pinned:
        _said_pinned = True
        log.warning(
            "track_writes: this process pins %d kB of memory for a device or the kernel (VmPin: io_uring, RDMA, an "
            "InfiniBand connection), whose writes there leave no mark: every tensor is read whole while it does",
            pinned,
        )
    return pinned > 0


_kernels: dict[int, _Kernel | None] = {}  # per process (a forked child opens its own)
_open_lock = threading.Lock()


def open_tracker() -> WrittenPages | None:
    """A :class:`WrittenPages` of one's own, or ``None`` where the kernel keeps no record of written pages (said
    once per process, in the log)."""
    with _open_lock:
        pid = os.getpid()
        if pid not in _kernels:
            try:
                _kernels[pid] = _Kernel()
            except OSError as exc:
                log.info("no record of written pages here (%s): every byte is read", exc)
                _kernels[pid] = None
        kernel = _kernels[pid]
    return None if kernel is None else WrittenPages(kernel)
