"""Schemes: the lifecycle of one model across workers, one backend a module (loaded on first use)."""

from __future__ import annotations

from .._lazy import lazy

_HOME = {
    name: module
    for module, names in {
        "multiprocess": ("MultiProcessWeightSyncScheme",),
        "shared_mem": ("SharedMemWeightSyncScheme",),
        "no_sync": ("NoWeightSyncScheme",),
        "distributed": ("DistributedWeightSyncScheme",),
        "rpc": ("RPCWeightSyncScheme",),
        "ray": (
            "ModuleActor",
            "RayModuleTransformReceiver",
            "RayModuleTransformScheme",
            "RayModuleTransformSender",
            "RayWeightSyncScheme",
        ),
        "registry": ("available_backends", "get_backend", "register_backend"),
    }.items()
    for name in names
}

__all__ = sorted(_HOME)

__getattr__, __dir__ = lazy(__name__, _HOME)
