"""The Ray transports' settings: ``ray`` (a call run inside each actor) and ``ray_actor`` (the actor's methods)."""

from __future__ import annotations

from ...core.settings import TransportSettings
from ...options import WIRE_DTYPE, option

__all__ = ["RayActorSettings", "RaySettings"]


class RaySettings(TransportSettings, name="ray", transport="weightsync.transports.ray.transport:RayTransport"):
    """Updates as calls that run inside each Ray actor."""

    wire_dtype: str | None = option(WIRE_DTYPE)


class RayActorSettings(
    RaySettings, name="ray_actor", transport="weightsync.transports.ray.transport:RayActorTransport"
):
    """Updates as calls to the ``update_weights_*`` methods of the one actor hosting a module."""
