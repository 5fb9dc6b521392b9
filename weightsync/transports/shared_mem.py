"""``SharedMemTransport``: the channel to one local worker whose model lives in shared memory.

Same protocol as :class:`~weightsync.transports.mp.MPTransport`; the
difference is on the receiver: it switches its model's tensors to the slot
that holds the new version instead of copying out of it, and keeps reading
that slot until it switches again. The sender therefore never reuses a slot
while a worker holds its version.
"""

from __future__ import annotations

from .mp import MPTransport

__all__ = ["SharedMemTransport"]


class SharedMemTransport(MPTransport):
    """Data plane to ONE worker of :class:`~weightsync.SharedMemWeightSyncScheme`."""

    pinning = True
