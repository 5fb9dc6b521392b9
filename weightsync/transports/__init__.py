"""Transports: the data plane to one receiver, one backend a module."""

from .base import TransportBackend
from .distributed import DistributedTransport
from .mp import MPTransport
from .ray import RayActorTransport, RayTransport
from .rpc import RPCTransport
from .shared_mem import SharedMemTransport

__all__ = [
    "DistributedTransport",
    "MPTransport",
    "RPCTransport",
    "RayActorTransport",
    "RayTransport",
    "SharedMemTransport",
    "TransportBackend",
]
