"""weightsync: move model weights from a trainer to the workers that use them.

Pick a scheme per model (``MultiProcessWeightSyncScheme``,
``SharedMemWeightSyncScheme``, ``RayWeightSyncScheme``,
``DistributedWeightSyncScheme``, ...), call
``init_on_sender`` and ``connect`` in the trainer, ``init_on_receiver`` and
``connect`` in each worker, then ``send()`` and ``receive()``.
"""

from .errors import (
    AuthenticationError,
    ConfigurationError,
    ConnectionClosedError,
    IntegrityError,
    InvalidWeightsError,
    LifecycleError,
    ReceiverError,
    SendFailedError,
    SyncTimeoutError,
    TransportError,
    WeightMismatchError,
    WeightSyncError,
    WorkerDiedError,
)
from .layout import FlatLayout
from .metrics import SendRecord
from .model_path import resolve_model
from .schemes import (
    DistributedWeightSyncScheme,
    ModuleActor,
    MultiProcessWeightSyncScheme,
    NoWeightSyncScheme,
    RayModuleTransformReceiver,
    RayModuleTransformScheme,
    RayModuleTransformSender,
    RayWeightSyncScheme,
    RPCWeightSyncScheme,
    SharedMemWeightSyncScheme,
    WeightReceiver,
    WeightSender,
    WeightSyncScheme,
    available_backends,
    get_backend,
    register_backend,
)
from .strategy import WeightStrategy
from .transports import (
    DistributedTransport,
    MPTransport,
    RayActorTransport,
    RayTransport,
    RPCTransport,
    SharedMemTransport,
    TransportBackend,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    # The Hydra layer is imported on first use, so `import weightsync` does not pay for Hydra.
    if name == "from_config":
        from .config import from_config

        return from_config
    raise AttributeError(f"module 'weightsync' has no attribute {name!r}")


__all__ = [
    "AuthenticationError",
    "ConfigurationError",
    "ConnectionClosedError",
    "DistributedTransport",
    "DistributedWeightSyncScheme",
    "FlatLayout",
    "IntegrityError",
    "InvalidWeightsError",
    "LifecycleError",
    "MPTransport",
    "ModuleActor",
    "MultiProcessWeightSyncScheme",
    "NoWeightSyncScheme",
    "RPCTransport",
    "RPCWeightSyncScheme",
    "RayActorTransport",
    "RayModuleTransformReceiver",
    "RayModuleTransformScheme",
    "RayModuleTransformSender",
    "RayTransport",
    "RayWeightSyncScheme",
    "ReceiverError",
    "SendFailedError",
    "SendRecord",
    "SharedMemTransport",
    "SharedMemWeightSyncScheme",
    "SyncTimeoutError",
    "TransportBackend",
    "TransportError",
    "WeightMismatchError",
    "WeightReceiver",
    "WeightSender",
    "WeightStrategy",
    "WeightSyncError",
    "WeightSyncScheme",
    "WorkerDiedError",
    "available_backends",
    "from_config",
    "get_backend",
    "register_backend",
    "resolve_model",
]
