"""Versioned weight slots in anonymous shared memory.

Each slot is one ``memfd`` segment holding a whole copy of the weights laid
out by a :class:`~weightsync.layout.FlatLayout`. A memfd has no name in
``/dev/shm``: the memory is freed by the kernel when the last process that
maps it unmaps it or exits, so nothing can be left behind, SIGKILL included.
Workers get the segment as a file descriptor over their channel.

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
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from ...errors import ConfigurationError
from ...tensors import cuda
from ...tensors.layout import FlatLayout

__all__ = ["DeviceSlot", "SharedSlot", "SlotPool", "map_fd", "map_storage"]


def map_storage(fd: int, nbytes: int) -> torch.UntypedStorage:
    """Map a shared-memory descriptor (the mapping outlives ``fd``, and ends with the storage)."""
    return torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)


def map_fd(fd: int, nbytes: int) -> torch.Tensor:
    """Map a shared-memory descriptor as a uint8 tensor (the mapping outlives ``fd``)."""
    return torch.empty(0, dtype=torch.uint8).set_(map_storage(fd, nbytes))


class SharedSlot:
    """One shared buffer in host memory: its descriptor, its typed views and the version it holds.

    ``pin``: register it with CUDA as page-locked (the trainer's weights are on a GPU)."""

    #: What kind of memory the slot is (the key of its pool, with the worker it serves, if one).
    kind = "host"
    #: Interprocess event recorded after each write (device slots only).
    event: cuda.SlotEvent | None = None

    def __init__(self, slot_id: int, layout: FlatLayout, tag: str, pin: bool = False) -> None:
        self.id = slot_id
        self.nbytes = layout.nbytes
        self.fd = os.memfd_create(f"weightsync-{tag}-{slot_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self.buffer = map_fd(self.fd, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.pinned = cuda.Pinned(self.buffer) if pin else None
        self.views = layout.views(self.buffer)
        self.version: int | None = None
        self.digest: str | None = None  # checksum of the version it holds, when the scheme computes one
        self.readers: set[int] = set()

    def close(self) -> None:
        if self.pinned is not None:  # before the mapping goes
            self.pinned.release()
            self.pinned = None
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
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.views = layout.views(self.buffer)
        self.event: cuda.SlotEvent | None = cuda.SlotEvent.create(device)
        self.version: int | None = None
        self.digest: str | None = None  # (never set: a checksum keeps the payload in host memory)
        self.readers: set[int] = set()

    def close(self) -> None:
        self.views = {}
        self.event = None
        self.buffer = torch.empty(0, dtype=torch.uint8)  # freed once every worker's mapping is gone


class SlotPool:
    """The sender's slots, allocated lazily up to ``max_slots``.

    Args:
        layout: placement of the weights in each slot.
        max_slots: how many slots may exist at once.
        pinning: receivers keep reading the slot of the version they hold
            (shared-memory receivers) instead of copying out of it.
        tag: a label in the memfd names, for ``/proc/<pid>/fd`` readers.
        device: a GPU: the slots are :class:`DeviceSlot` s on it; ``None``: host memory.
        pin: host slots are pinned (a GPU writes into them).
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
        if max_slots < 1:
            raise ConfigurationError(f"max_slots must be >= 1, got {max_slots}")
        self.layout = layout
        self.max_slots = max_slots
        self.pinning = pinning
        self.tag = tag
        self.device, self.pin = device, pin
        self.slots: list[SharedSlot | DeviceSlot] = []

    def acquire(self) -> SharedSlot | DeviceSlot | None:
        """A slot nobody reads, allocating one if allowed; ``None`` when all are busy."""
        for slot in self.slots:
            if not slot.readers:
                return slot
        if len(self.slots) < self.max_slots:
            n = len(self.slots)
            slot: SharedSlot | DeviceSlot = (
                DeviceSlot(n, self.layout, self.device)
                if self.device is not None
                else SharedSlot(n, self.layout, self.tag, pin=self.pin)
            )
            self.slots.append(slot)
            return slot
        return None

    def publish(self, slot: SharedSlot | DeviceSlot, version: int, readers: Iterable[int]) -> None:
        slot.version = version
        slot.readers = set(readers)

    def on_ack(self, worker: int, acked: int, held: int | None) -> None:
        """Record that ``worker`` is done with every version up to ``acked`` and now holds ``held``."""
        for slot in self.slots:
            if worker not in slot.readers or slot.version is None or slot.version > acked:
                continue
            if slot.version == held and self.pinning:
                continue
            slot.readers.discard(worker)

    def drop_worker(self, worker: int) -> None:
        for slot in self.slots:
            slot.readers.discard(worker)

    def busy_workers(self) -> set[int]:
        return set().union(*(s.readers for s in self.slots)) if self.slots else set()

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
        self.slots = []
