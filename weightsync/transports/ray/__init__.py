"""The Ray engine: workers are actors; each version is one object in Ray's store and one call per actor."""

from .transport import RayActorTransport, RayTransport, apply_in_actor, register_receiver, unregister_receiver

__all__ = ["RayActorTransport", "RayTransport", "apply_in_actor", "register_receiver", "unregister_receiver"]
