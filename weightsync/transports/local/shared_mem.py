"""``SharedMemTransport``: the channel to one local worker whose model lives in shared memory.

Same protocol as :class:`~weightsync.transports.local.mp.MPTransport`; the
difference is on the receiver: it switches its model's tensors to the slot
that holds the new version instead of copying out of it, and keeps reading
that slot until it switches again. The sender therefore never reuses a slot
while a worker holds its version.

The switch costs the same whatever the number of tensors, for a slot in host
memory or in GPU memory (the model then lives in the trainer's GPU memory,
on the trainer's GPU). The receiver maps every slot twice: once to check and
read it, and once as a spare storage, which the model takes (the receiver core
swaps the memory behind the model's one storage with it,
``UntypedStorage._swap_data_ptr_``); the mapping the model leaves becomes the
spare of the slot it left. Re-pointing each tensor instead (``tensor.data =
view``, what a torch older than 2.12 must do) cost about 1.2 us a tensor: 2.4
ms per worker and per update for a model of 2000 tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .channel import Channel
from .mp import MPTransport

if TYPE_CHECKING:
    from ...core.engine import Sink

__all__ = ["SharedMemTransport"]


class SharedMemTransport(MPTransport):
    """Data plane to ONE worker of :class:`~weightsync.SharedMemWeightSyncScheme`."""

    pinning = True

    def __init__(self, channel: Channel, worker_idx: int, sink: Sink | None = None) -> None:
        super().__init__(channel, worker_idx, sink)
        # Receiver side: a second mapping of every slot the model does not read, and the slot it reads.
        self._spares: dict[int, torch.UntypedStorage] = {}
        self._slot: int | None = None

    def _slot_mapped(self, slot: int, second: Callable[[], torch.UntypedStorage]) -> None:
        self._spares[slot] = second()

    def _slot_unmapped(self, slot: int) -> None:
        self._spares.pop(slot, None)

    def spare(self, slot: int) -> torch.UntypedStorage | None:
        """The second mapping of ``slot``, for the model to take (``None``: the model reads it already)."""
        return None if slot == self._slot else self._spares.get(slot)

    def took(self, slot: int, left: torch.UntypedStorage | None) -> None:
        self._spares.pop(slot, None)
        if left is not None and self._slot is not None:
            self._spares[self._slot] = left  # it holds the mapping of the slot the model left
        self._slot = slot

    def close(self) -> None:
        super().close()
        self._spares.clear()
        self._slot = None
