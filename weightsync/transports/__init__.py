"""Transports: the data plane to one receiver, one backend a module."""

from .base import TransportBackend
from .mp import MPTransport
from .ray import RayTransport
from .shared_mem import SharedMemTransport

__all__ = ["MPTransport", "RayTransport", "SharedMemTransport", "TransportBackend"]
