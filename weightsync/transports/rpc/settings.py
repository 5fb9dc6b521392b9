"""The ``rpc`` transport's settings."""

from __future__ import annotations

from ...core.settings import TransportSettings
from ...options import MAX_BUFFERS, WIRE_DTYPE, option

__all__ = ["RPCSettings"]


class RPCSettings(TransportSettings, name="rpc", transport="weightsync.transports.rpc.transport:RPCTransport"):
    """One RPC per worker and update, answered once applied."""

    wire_dtype: str | None = option(WIRE_DTYPE)
    max_buffers: int = option(MAX_BUFFERS)
