"""The Hydra layer: structured configs, ConfigStore groups, receiver configs.

Importing this module registers every config in Hydra's ConfigStore (see
:mod:`weightsync.config.store` for the group names).
"""

from .configs import (
    DistributedSchemeConfig,
    DistributedTransportConfig,
    LocalSchemeConfig,
    MPTransportConfig,
    MultiProcessSchemeConfig,
    NoSyncSchemeConfig,
    RayActorTransportConfig,
    RayModuleTransformSchemeConfig,
    RaySchemeConfig,
    RayTransportConfig,
    RPCSchemeConfig,
    RPCTransportConfig,
    SchemeConfig,
    SharedMemSchemeConfig,
    SharedMemTransportConfig,
    WeightStrategyConfig,
)
from .receiver import allow_targets, allowed_targets, check_receiver_config, from_config, make_receiver
from .store import SCHEMES, STRATEGIES, TRANSPORTS, register_configs

register_configs()

__all__ = [
    "SCHEMES",
    "STRATEGIES",
    "TRANSPORTS",
    "DistributedSchemeConfig",
    "DistributedTransportConfig",
    "LocalSchemeConfig",
    "MPTransportConfig",
    "MultiProcessSchemeConfig",
    "NoSyncSchemeConfig",
    "RPCSchemeConfig",
    "RPCTransportConfig",
    "RayActorTransportConfig",
    "RayModuleTransformSchemeConfig",
    "RaySchemeConfig",
    "RayTransportConfig",
    "SchemeConfig",
    "SharedMemSchemeConfig",
    "SharedMemTransportConfig",
    "WeightStrategyConfig",
    "allow_targets",
    "allowed_targets",
    "check_receiver_config",
    "from_config",
    "make_receiver",
    "register_configs",
]
