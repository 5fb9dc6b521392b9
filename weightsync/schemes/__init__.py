"""Schemes: the lifecycle of one model across workers, one backend a module."""

from .base import WeightReceiver, WeightSender, WeightSyncScheme
from .distributed import DistributedWeightSyncScheme
from .multiprocess import MultiProcessWeightSyncScheme
from .no_sync import NoWeightSyncScheme
from .ray import (
    ModuleActor,
    RayModuleTransformReceiver,
    RayModuleTransformScheme,
    RayModuleTransformSender,
    RayWeightSyncScheme,
)
from .registry import available_backends, get_backend, register_backend
from .rpc import RPCWeightSyncScheme
from .shared_mem import SharedMemWeightSyncScheme

__all__ = [
    "DistributedWeightSyncScheme",
    "ModuleActor",
    "MultiProcessWeightSyncScheme",
    "NoWeightSyncScheme",
    "RPCWeightSyncScheme",
    "RayModuleTransformReceiver",
    "RayModuleTransformScheme",
    "RayModuleTransformSender",
    "RayWeightSyncScheme",
    "SharedMemWeightSyncScheme",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncScheme",
    "available_backends",
    "get_backend",
    "register_backend",
]
