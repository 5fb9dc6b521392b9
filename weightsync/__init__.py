"""weightsync: move model weights from a trainer to the workers that use them.

Pick a scheme per model (``MultiProcessWeightSyncScheme``,
``SharedMemWeightSyncScheme``, ``RayWeightSyncScheme``,
``DistributedWeightSyncScheme``, ...), call
``init_on_sender`` and ``connect`` in the trainer, ``init_on_receiver`` and
``connect`` in each worker, then ``send()`` and ``receive()``.

``import weightsync`` loads the error tree only: every other name, each
scheme's engine and the Hydra layer load on first use.
"""

from __future__ import annotations

from . import errors
from ._lazy import lazy
from .errors import *  # noqa: F403 - the error tree is public, and costs nothing to load

__version__ = "0.1.0"

# Where each public name lives (a module of this package), imported when the name is first asked for.
_HOME = {
    name: module
    for module, names in {
        "core.scheme": ("WeightSyncScheme",),
        "core.facade": ("WeightReceiver", "WeightSender"),
        "schemes.multiprocess": ("MultiProcessWeightSyncScheme",),
        "schemes.shared_mem": ("SharedMemWeightSyncScheme",),
        "schemes.no_sync": ("NoWeightSyncScheme",),
        "schemes.distributed": ("DistributedWeightSyncScheme",),
        "schemes.rpc": ("RPCWeightSyncScheme",),
        "schemes.ray": (
            "ModuleActor",
            "RayModuleTransformReceiver",
            "RayModuleTransformScheme",
            "RayModuleTransformSender",
            "RayWeightSyncScheme",
        ),
        "schemes.registry": ("available_backends", "get_backend", "register_backend"),
        "transports.base": ("TransportBackend",),
        "transports.local": ("MPTransport", "SharedMemTransport"),
        "transports.distributed": ("DistributedTransport",),
        "transports.rpc": ("RPCTransport",),
        "transports.ray": ("RayActorTransport", "RayTransport"),
        "tensors.strategy": ("WeightStrategy",),
        "tensors.layout": ("FlatLayout",),
        "metrics": ("SendRecord",),
        "model_path": ("resolve_model",),
        "config": ("from_config",),
    }.items()
    for name in names
}

__getattr__, __dir__ = lazy(__name__, _HOME)

__all__ = sorted([*errors.__all__, *_HOME])
