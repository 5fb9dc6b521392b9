"""The local transports' settings: ``mp`` (workers copy each update) and ``shared_mem`` (workers read the slot)."""

from __future__ import annotations

from ...core.settings import TransportSettings
from ...options import option, positive

__all__ = ["MAX_SLOTS", "MPSettings", "SharedMemSettings"]

MAX_SLOTS = positive(
    "max_slots",
    None,
    "Shared weight slots the sender may allocate (``None``: ``num_workers + 2``, which no send "
    "pattern exceeds); fewer make a send wait for lagging workers.",
)


class MPSettings(TransportSettings, name="mp", transport="weightsync.transports.local.mp:MPTransport"):
    """The channels to local workers that copy each update into their own model."""

    max_slots: int | None = option(MAX_SLOTS)


class SharedMemSettings(
    MPSettings, name="shared_mem", transport="weightsync.transports.local.shared_mem:SharedMemTransport"
):
    """The channels to local workers that read their model from the shared slots."""
