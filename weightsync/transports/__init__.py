"""Transports: the data plane to one receiver, one backend a module."""

from .base import TransportBackend
from .mp import MPTransport
from .shared_mem import SharedMemTransport

__all__ = ["MPTransport", "SharedMemTransport", "TransportBackend"]
