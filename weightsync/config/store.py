"""ConfigStore registration: the stable group names other Hydra apps put in their defaults list.

Groups (each option is the dataclass of the same name in :mod:`weightsync.config.configs`)::

    weightsync/scheme/{multiprocess,shared_mem,no_sync,ray,ray_module_transform,rpc,distributed}
    weightsync/transport/{mp,shared_mem,ray,ray_actor,rpc,distributed}
    weightsync/strategy/{tensordict,state_dict}

In an app's defaults list: ``- weightsync/scheme: multiprocess`` puts the
scheme at ``cfg.weightsync.scheme``; ``- weightsync/scheme@sync.policy: shared_mem``
puts it wherever you like. Swap it from the command line with
``weightsync/scheme=ray`` (or ``weightsync/scheme@sync.policy=ray``).
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from .configs import (
    DistributedSchemeConfig,
    DistributedTransportConfig,
    MPTransportConfig,
    MultiProcessSchemeConfig,
    NoSyncSchemeConfig,
    RayActorTransportConfig,
    RayModuleTransformSchemeConfig,
    RaySchemeConfig,
    RayTransportConfig,
    RPCSchemeConfig,
    RPCTransportConfig,
    SharedMemSchemeConfig,
    SharedMemTransportConfig,
    WeightStrategyConfig,
)

__all__ = ["SCHEMES", "STRATEGIES", "TRANSPORTS", "register_configs"]

SCHEMES: dict[str, type] = {
    "multiprocess": MultiProcessSchemeConfig,
    "shared_mem": SharedMemSchemeConfig,
    "no_sync": NoSyncSchemeConfig,
    "ray": RaySchemeConfig,
    "ray_module_transform": RayModuleTransformSchemeConfig,
    "rpc": RPCSchemeConfig,
    "distributed": DistributedSchemeConfig,
}
TRANSPORTS: dict[str, type] = {
    "mp": MPTransportConfig,
    "shared_mem": SharedMemTransportConfig,
    "ray": RayTransportConfig,
    "ray_actor": RayActorTransportConfig,
    "rpc": RPCTransportConfig,
    "distributed": DistributedTransportConfig,
}
STRATEGIES: dict[str, WeightStrategyConfig] = {
    "tensordict": WeightStrategyConfig(extract_as="tensordict"),
    "state_dict": WeightStrategyConfig(extract_as="state_dict"),
}

_registered = False


def register_configs() -> None:
    """Store every config under its group (idempotent; runs on ``import weightsync.config``)."""
    global _registered
    if _registered:
        return
    cs = ConfigStore.instance()
    for name, node in SCHEMES.items():
        cs.store(group="weightsync/scheme", name=name, node=node)
    for name, node in TRANSPORTS.items():
        cs.store(group="weightsync/transport", name=name, node=node)
    for name, node in STRATEGIES.items():
        cs.store(group="weightsync/strategy", name=name, node=node)
    _registered = True
