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
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from ...errors import ConfigurationError
from ...tensors.layout import FlatLayout

__all__ = ["SharedSlot", "SlotPool", "map_fd", "map_storage"]


def map_storage(fd: int, nbytes: int) -> torch.UntypedStorage:
    """Map a shared-memory descriptor (the mapping outlives ``fd``, and ends with the storage)."""
    return torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)


def map_fd(fd: int, nbytes: int) -> torch.Tensor:
    """Map a shared-memory descriptor as a uint8 tensor (the mapping outlives ``fd``)."""
    return torch.empty(0, dtype=torch.uint8).set_(map_storage(fd, nbytes))


class SharedSlot:
    """One shared buffer: its descriptor, its typed views and the version it holds."""

    def __init__(self, slot_id: int, layout: FlatLayout, tag: str) -> None:
        self.id = slot_id
        self.nbytes = layout.nbytes
        self.fd = os.memfd_create(f"weightsync-{tag}-{slot_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self.buffer = map_fd(self.fd, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.views = layout.views(self.buffer)
        self.version: int | None = None
        self.digest: str | None = None  # checksum of the version it holds, when the scheme computes one
        self.readers: set[int] = set()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.views = {}
        self.buffer = torch.empty(0, dtype=torch.uint8)


class SlotPool:
    """The sender's slots, allocated lazily up to ``max_slots``.

    Args:
        layout: placement of the weights in each slot.
        max_slots: how many slots may exist at once.
        pinning: receivers keep reading the slot of the version they hold
            (shared-memory receivers) instead of copying out of it.
        tag: a label in the memfd names, for ``/proc/<pid>/fd`` readers.
    """

    def __init__(self, layout: FlatLayout, max_slots: int, *, pinning: bool, tag: str = "w") -> None:
        if max_slots < 1:
            raise ConfigurationError(f"max_slots must be >= 1, got {max_slots}")
        self.layout = layout
        self.max_slots = max_slots
        self.pinning = pinning
        self.tag = tag
        self.slots: list[SharedSlot] = []

    def acquire(self) -> SharedSlot | None:
        """A slot nobody reads, allocating one if allowed; ``None`` when all are busy."""
        for slot in self.slots:
            if not slot.readers:
                return slot
        if len(self.slots) < self.max_slots:
            slot = SharedSlot(len(self.slots), self.layout, self.tag)
            self.slots.append(slot)
            return slot
        return None

    def publish(self, slot: SharedSlot, version: int, readers: Iterable[int]) -> None:
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
