"""Schemes: the lifecycle of one model across workers, one backend a module."""

from .base import WeightReceiver, WeightSender, WeightSyncScheme
from .multiprocess import MultiProcessWeightSyncScheme
from .no_sync import NoWeightSyncScheme
from .ray import RayWeightSyncScheme
from .registry import available_backends, get_backend, register_backend
from .shared_mem import SharedMemWeightSyncScheme

__all__ = [
    "MultiProcessWeightSyncScheme",
    "NoWeightSyncScheme",
    "RayWeightSyncScheme",
    "SharedMemWeightSyncScheme",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncScheme",
    "available_backends",
    "get_backend",
    "register_backend",
]
