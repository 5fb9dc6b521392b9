"""The local transports' settings: ``mp`` (workers copy each update) and ``shared_mem`` (workers read the slot)."""

from __future__ import annotations

from typing import Optional

from ... import checks
from ...core.settings import TransportSettings
from ...options import Option, option, positive

__all__ = ["MAX_SLOTS", "MPSettings", "SHARED_MAX_SLOTS", "SharedMemSettings"]

_SLOTS_DOC = (
    "Shared weight slots the sender may allocate (``None``: ``num_workers + 2``, which no send "
    "pattern exceeds); fewer make a send wait for lagging workers."
)
MAX_SLOTS = positive("max_slots", None, _SLOTS_DOC)
#: Under ``shared_mem`` a worker reads its model from the slot of the version it holds until it applies the next,
#: which is written into another: one slot would make every send wait its whole timeout, then fail.
SHARED_MAX_SLOTS = Option(
    "max_slots",
    None,
    Optional[int],  # noqa: UP045 - omegaconf 2.3
    _SLOTS_DOC + " At least 2: a worker reads the slot of the version it holds while the next is written.",
    checks.optional(checks.integer(2, 2**31 - 1, what="an int of at least 2 or None")),
)


class MPSettings(TransportSettings, name="mp", transport="weightsync.transports.local.mp:MPTransport"):
    """The channels to local workers that copy each update into their own model."""

    max_slots: int | None = option(MAX_SLOTS)


class SharedMemSettings(
    MPSettings, name="shared_mem", transport="weightsync.transports.local.shared_mem:SharedMemTransport"
):
    """The channels to local workers that read their model from the shared slots."""

    max_slots: int | None = option(SHARED_MAX_SLOTS)
