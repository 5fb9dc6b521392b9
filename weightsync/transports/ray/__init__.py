"""The Ray engine: workers are actors; each version is one object in Ray's store and one call per actor."""

from __future__ import annotations

from ..._lazy import lazy

# Loaded on first use: defining a scheme loads its transport's settings (``settings``), never the engine.
__getattr__, __dir__ = lazy(
    __name__,
    {
        name: "transport"
        for name in ("RayActorTransport", "RayTransport", "apply_in_actor", "register_receiver", "unregister_receiver")
    },
)
