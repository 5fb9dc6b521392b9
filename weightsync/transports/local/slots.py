"""Versioned weight slots in anonymous shared memory.

Each slot is one ``memfd`` segment holding a whole copy of the weights laid
out by a :class:`~weightsync.layout.FlatLayout`. A memfd has no name in
``/dev/shm``: the memory is freed by the kernel when the last process that
maps it unmaps it or exits, so nothing can be left behind, SIGKILL included.
Workers get the segment as a file descriptor over their channel. Each memfd
is sealed once sized (no shrink, no grow, no new seals): a worker holding its
descriptor cannot truncate the segment under the trainer's mapping (a
truncated mapping kills its reader with SIGBUS at the next write). Workers that
only copy out of a slot (``multiprocess``) get a read-only descriptor of a
segment also sealed against new writable mappings (``F_SEAL_FUTURE_WRITE``:
the trainer's own mapping, made before, still writes); ``shared_mem`` workers
get a writable one, because their model *is* the slot's memory and a read-only
mapping would kill a worker with SIGSEGV at any in-place write into its
parameters or buffers (a BatchNorm's running statistics in training mode).

The sender writes a new version only into a slot no worker still needs: every
slot records the workers that must still read it (``readers``). A worker leaves
a slot's readers when it acks a newer version, or, for copying receivers, as
soon as it acked the slot's own version. Receivers that map their model onto
the slot (shared-memory scheme) stay readers of the version they hold. That
rule is what makes torn reads impossible.

When the trainer's weights are on a GPU, workers whose models are on a GPU of
this machine read :class:`DeviceSlot` s instead: device memory on the trainer's
GPU, shared once per worker through CUDA IPC, each with an interprocess event
recorded after every write (see :mod:`weightsync.tensors.cuda`). Host slots a
GPU writes into are pinned, so the copy out of the GPU runs at the bus's speed.
A pool of device slots holds at most :data:`DEVICE_MAX_SLOTS` (fewer where
the GPU's free memory says so: :func:`device_pool_size`).

A slot read by a worker that was given up on (dropped after a timeout, refused,
replaced by a rejoining process) is rewritten only once that worker's process
is known to have exited (:meth:`SlotPool.drop_worker`): until then it may still
read the slot, or run its model on it.

A slot read only by late workers (:meth:`SlotPool.set_aside`: a stopped worker
that sends pass by) is never rewritten either: it leaves the pool for good, a
new slot takes its place, and the late worker reads it on when it runs again.
The worker is told to let it go (``forget``) only once it acked past it: told
before, it would refuse the update on its way in that slot.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import warnings
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from ...core.interrupts import held_interrupts
from ...tensors import cuda
from ...tensors.layout import FlatLayout

__all__ = [
    "DEVICE_MAX_SLOTS",
    "DeviceSlot",
    "SharedSlot",
    "SlotPool",
    "device_pool_size",
    "slot_kind",
    "map_fd",
    "map_fd_read_only",
    "close_slot",
    "map_storage",
]

#: The most slots a pool in GPU memory holds: each is a whole copy of the model on the trainer's GPU.
DEVICE_MAX_SLOTS = 3
#: GPU memory left free beside the device slots (kernels' workspaces, the allocator's rounding).
DEVICE_HEADROOM = 1 << 28
#: Seals of every slot once sized: its size is fixed for good.
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: ``F_SEAL_FUTURE_WRITE`` (Linux 5.1): no new writable mapping, no write(); mappings made before still write.
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


class Holder(Protocol):
    """A process that may still map a slot (:class:`~weightsync.transports.local.peers.PeerProcess`)."""

    def gone(self) -> bool: ...


def slot_kind(trainer_uuid: str | None, worker_gpu: Any, *, checksum: bool) -> str:
    """Where a worker's slots live: ``"cuda"`` (device slots in the trainer's GPU memory) when the worker's model
    is on the trainer's very GPU (``worker_gpu``: the UUID its hello names; ``trainer_uuid``: the trainer's) and
    no checksum needs the payload in host memory; ``"host"`` otherwise (a worker on another GPU, on the CPU, on
    several devices, or saying something else)."""
    if trainer_uuid is None or checksum or not isinstance(worker_gpu, str):
        return "host"
    same = cuda.local_index(worker_gpu, [trainer_uuid]) == 0
    return "cuda" if same else "host"


def device_pool_size(requested: int, nbytes: int, free_bytes: int, *, pinning: bool, per_worker: bool) -> int:
    """How many device slots of ``nbytes`` a pool may hold: at most ``requested`` and :data:`DEVICE_MAX_SLOTS` (2
    for a pool per worker: every worker's pool is a copy more), and no more than fit in ``free_bytes`` of the
    trainer's GPU beside :data:`DEVICE_HEADROOM`. 0: the pool does not fit (its workers read pinned host slots):
    fewer than 2 slots where workers keep reading the slot of the version they hold (``pinning``), since the next
    version needs another, else fewer than 1.

    A 20 GB model with 4 workers on an 80 GB GPU: ``num_workers + 2`` device slots would be 120 GB; 3 are 60 GB,
    beside the trainer's 20 GB copy, or 2 where 3 do not fit.
    """
    if nbytes <= 0:
        return min(requested, DEVICE_MAX_SLOTS)
    cap = min(requested, 2 if per_worker else DEVICE_MAX_SLOTS)
    fit = max(0, free_bytes - DEVICE_HEADROOM) // nbytes
    n = min(cap, fit)
    return n if n >= (2 if pinning else 1) else 0


def map_storage(fd: int, nbytes: int) -> torch.UntypedStorage:
    """Map a shared-memory descriptor (the mapping outlives ``fd``, and ends with the storage)."""
    # torch annotates from_file once for every storage class; UntypedStorage's returns an UntypedStorage.
    return torch.UntypedStorage.from_file(  # type: ignore[return-value]
        f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes
    )


def map_fd(fd: int, nbytes: int) -> torch.Tensor:
    """Map a shared-memory descriptor as a uint8 tensor (the mapping outlives ``fd``)."""
    return torch.empty(0, dtype=torch.uint8).set_(map_storage(fd, nbytes))


def map_fd_read_only(fd: int, nbytes: int) -> torch.Tensor:
    """Map a shared-memory descriptor read-only as a uint8 tensor (the mapping outlives ``fd``, and ends with the
    tensor). Writing into it kills the process (SIGSEGV): for readers that only copy out."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    view = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    with warnings.catch_warnings():  # "the given buffer is not writable": that is the point
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def _seal(fd: int, read_only: bool) -> None:
    """Fix the size of the memfd ``fd`` for good; ``read_only``: and refuse new writable mappings."""
    seals = SIZE_SEALS
    if read_only:
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
        except OSError:  # a kernel before 5.1: readers get a read-only descriptor all the same
            pass
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)


class SharedSlot:
    """One shared buffer in host memory: its descriptor, its typed views and the version it holds.

    ``pin``: register it with CUDA as page-locked (the trainer's weights are on a GPU). ``read_only``: workers
    only read it: they are handed :attr:`reader_fd`, a read-only descriptor of a segment sealed against new
    writable mappings; else :attr:`reader_fd` is :attr:`fd` (sealed against resizing all the same)."""

    #: What kind of memory the slot is (the key of its pool, with the worker it serves, if one).
    kind = "host"
    #: Interprocess event recorded after each write (device slots only).
    event: cuda.SlotEvent | None = None

    def __init__(
        self, slot_id: int, layout: FlatLayout, tag: str, pin: bool = False, *, read_only: bool = False
    ) -> None:
        self.id = slot_id
        self.nbytes = layout.nbytes
        self.fd = os.memfd_create(f"weightsync-{tag}-{slot_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.reader_fd = self.fd
        try:
            os.ftruncate(self.fd, self.nbytes)
            self.buffer = map_fd(self.fd, self.nbytes)  # the trainer's writable mapping: made before the seals
            _seal(self.fd, read_only)
            if read_only:
                self.reader_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(self.fd)
            raise
        self.pinned = cuda.Pinned(self.buffer) if pin else None
        self.views = layout.views(self.buffer)
        self.version: int | None = None
        self.digest: str | None = None  # checksum of the version it holds, when the scheme computes one
        self.readers: set[int] = set()
        self.holders: list[Holder] = []  # processes given up on that may still read it

    def close(self) -> None:
        if self.pinned is not None:  # before the mapping goes
            self.pinned.release()
            self.pinned = None
        if self.reader_fd >= 0 and self.reader_fd != self.fd:
            os.close(self.reader_fd)
        self.reader_fd = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.views = {}
        self.buffer = torch.empty(0, dtype=torch.uint8)


class DeviceSlot:
    """One buffer in the trainer's GPU memory, shared with workers through CUDA IPC, and its event."""

    kind = "cuda"

    def __init__(self, slot_id: int, layout: FlatLayout, device: torch.device) -> None:
        self.id = slot_id
        self.nbytes = layout.nbytes
        self.device = device
        self.uuid = cuda.device_uuid(device)  # how a worker finds this GPU, whatever its index there
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.views = layout.views(self.buffer)
        self.event: cuda.SlotEvent | None = cuda.SlotEvent.create(device)
        self.version: int | None = None
        self.digest: str | None = None  # (never set: a checksum keeps the payload in host memory)
        self.readers: set[int] = set()
        self.holders: list[Holder] = []  # processes given up on that may still read it

    def close(self, processes: Iterable[Any] = ()) -> None:
        """Let the slot go: its memory is freed once every worker's mapping is gone (torch counts them); its event
        is kept until ``processes`` (every process it was handed to) have exited, since destroying an event
        another process opened is undefined for that process."""
        self.views = {}
        if self.event is not None:
            cuda.keep_until_gone([self.event], list(processes))
        self.event = None
        self.buffer = torch.empty(0, dtype=torch.uint8)


def close_slot(slot: SharedSlot | DeviceSlot, processes: Iterable[Any]) -> None:
    """Close ``slot`` on the sender's side (``processes``: every process it was handed to, for a device slot's
    event)."""
    if isinstance(slot, DeviceSlot):
        slot.close(processes)
    else:
        slot.close()


class SlotPool:
    """The sender's slots, allocated lazily up to ``max_slots``.

    Args:
        layout: placement of the weights in each slot.
        max_slots: how many slots may exist at once (one or more: the settings checked ``max_slots``).
        pinning: receivers keep reading the slot of the version they hold
            (shared-memory receivers) instead of copying out of it.
        tag: a label in the memfd names, for ``/proc/<pid>/fd`` readers.
        device: a GPU: the slots are :class:`DeviceSlot` s on it; ``None``: host memory.
        pin: host slots are pinned (a GPU writes into them).

    Host slots of a pool whose receivers copy (not ``pinning``) are handed to workers read-only.
    """

    def __init__(
        self,
        layout: FlatLayout,
        max_slots: int,
        *,
        pinning: bool,
        tag: str = "w",
        device: torch.device | None = None,
        pin: bool = False,
    ) -> None:
        self.layout = layout
        self.max_slots = max_slots
        self.pinning = pinning
        self.tag = tag
        self.device, self.pin = device, pin
        self.slots: list[SharedSlot | DeviceSlot] = []
        #: Slots taken out of the pool because processes given up on may still read them (the sender closes them).
        self.retired: list[SharedSlot | DeviceSlot] = []
        #: Late workers (:meth:`set_aside`): a slot only they read leaves the pool.
        self.aside: set[int] = set()
        #: Slots that left the pool still read by late workers (their readers): each is told to let its slot go
        #: once it acked past it (:meth:`on_ack` returns them).
        self.left: list[SharedSlot | DeviceSlot] = []
        self._next_id = 0

    def acquire(self) -> SharedSlot | DeviceSlot | None:
        """A slot nobody reads, allocating one if allowed; ``None`` when all are busy.

        A slot read only by processes given up on (see :meth:`drop_worker`) or by late workers (see
        :meth:`set_aside`) is never rewritten: it leaves the pool for :attr:`retired` (the sender closes it; its
        memory lives on while those processes map it: the kernel keeps a memfd's pages, torch an IPC-shared block)
        and a new slot takes its place. The slot of the newest version stays (late readers or not: a worker that
        rejoins is handed it)."""
        newest = max((slot.version for slot in self.slots if slot.version is not None), default=None)
        for slot in list(self.slots):
            if slot.readers - self.aside or (slot.readers and slot.version == newest):
                continue
            slot.holders = [holder for holder in slot.holders if not holder.gone()]
            if not slot.holders and not slot.readers:
                return slot
            with held_interrupts():  # (out of the pool and into what the sender closes, in one step)
                self.slots.remove(slot)
                self.retired.append(slot)
                if slot.readers:
                    self.left.append(slot)
        if len(self.slots) < self.max_slots:
            n = self._next_id
            self._next_id += 1  # ids are never reused: a worker may still know a retired slot by its id
            slot = (
                DeviceSlot(n, self.layout, self.device)
                if self.device is not None
                else SharedSlot(n, self.layout, self.tag, pin=self.pin, read_only=not self.pinning)
            )
            self.slots.append(slot)
            return slot
        return None

    def publish(self, slot: SharedSlot | DeviceSlot, version: int, readers: Iterable[int]) -> None:
        slot.version = version
        slot.readers = set(readers)

    def unpublish(self, version: int | None, notified: dict[int, int]) -> None:
        """``version`` was staged and not submitted (a Ctrl-C): its slot holds no version, and nobody reads it, unless
        a reader was told of it (``notified``: per worker, the newest version it was told of). A rejoin was handed
        its bytes under a number that the next send then gave other weights."""
        for slot in self.slots:
            if version is not None and slot.version == version:
                if not any(notified.get(w, -1) >= version for w in slot.readers):
                    slot.version, slot.readers = None, set()

    def on_ack(self, worker: int, acked: int, held: int | None) -> list[SharedSlot | DeviceSlot]:
        """Record that ``worker`` is done with every version up to ``acked`` and now holds ``held`` (it runs: no
        longer set aside, until the next send that passes it by says so again). Returns the slots that left the
        pool it is done with now: it is to let them go."""
        self.aside.discard(worker)
        done = [slot for slot in [*self.slots, *self.left] if worker in slot.readers and self._past(slot, acked, held)]
        for slot in done:
            slot.readers.discard(worker)
        self.left = [slot for slot in self.left if slot.readers]
        return [slot for slot in done if slot not in self.slots]

    def _past(self, slot: SharedSlot | DeviceSlot, acked: int, held: int | None) -> bool:
        """Whether a reader that acked ``acked`` and holds ``held`` is done with ``slot``."""
        if slot.version is None or slot.version > acked:
            return False
        return not (slot.version == held and self.pinning)

    def set_aside(self, worker: int) -> None:
        """``worker`` is late (sends pass it by): the slots only it reads leave the pool at the next
        :meth:`acquire` that meets them, so that they hold up no send; it reads them on once it runs."""
        self.aside.add(worker)

    def drop_worker(self, worker: int, process: Holder | None = None) -> None:
        """``worker`` no longer counts as a reader. ``process``: the process it was, which may still map the slots
        it read: they stay out of use until it has exited (``None``, or a process gone: free them now)."""
        holder = process if process is not None and not process.gone() else None
        self.aside.discard(worker)
        for slot in self.slots:
            if worker in slot.readers:
                slot.readers.discard(worker)
                if holder is not None:
                    slot.holders.append(holder)
        for slot in self.left:  # (closed here already: its memory is the process's)
            slot.readers.discard(worker)
        self.left = [slot for slot in self.left if slot.readers]

    def busy_workers(self) -> set[int]:
        """The workers that hold up slots: every slot's readers but the late (their slots leave the pool)."""
        return set().union(*(s.readers for s in self.slots)) - self.aside if self.slots else set()

    def stuck(self, busy: list[int]) -> str:
        """Why no slot will be free (``busy``, every slot's readers, each holding the version of its slot, with no
        ack on its way that would let one go): for the error that says so at once, not after the send's timeout."""
        return (
            f"no free weight slot: workers {busy} hold the versions of all max_slots={self.max_slots} slots, their "
            "models mapped onto them (shared_mem), and no newer version is on its way to them that would free one: "
            "sends to some workers only leave the others on older slots; raise max_slots (to one more than the "
            "versions the workers hold at once) or leave it None"
        )

    def held(self) -> list[str]:
        """The processes given up on that still keep slots out of use (for a timeout's message)."""
        return sorted({repr(h) for slot in self.slots for h in slot.holders if not h.gone()})

    def close(self, processes: Iterable[Any] = ()) -> None:
        """Let every slot go (``processes``: every worker process the slots were handed to)."""
        processes = list(processes)
        for slot in [*self.slots, *self.retired]:
            close_slot(slot, [*processes, *slot.holders])
        self.slots, self.retired, self.left = [], [], []
