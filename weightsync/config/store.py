"""ConfigStore registration: the stable group names other Hydra apps put in their defaults list.

Groups (each option is the dataclass of the same name in :mod:`weightsync.config.configs`)::

    weightsync/scheme/{multiprocess,shared_mem,no_sync,ray,ray_module_transform,rpc,distributed}
    weightsync/scheme/vllm   (VLLMWeightSyncScheme: serving vLLM engines over the scheme at its ``scheme``)
    weightsync/scheme/transport/{mp,shared_mem,ray,ray_actor,rpc,distributed}   (a scheme's transport)
    weightsync/transport/{mp,shared_mem,ray,ray_actor,rpc,distributed}
    weightsync/strategy/{tensordict,state_dict}

(and a scheme or transport an installed package registers, under its name).

In an app's defaults list: ``- weightsync/scheme: multiprocess`` puts the
scheme at ``cfg.weightsync.scheme``; ``- weightsync/scheme@sync.policy: shared_mem``
puts it wherever you like. Swap it from the command line with
``weightsync/scheme=ray`` (or ``weightsync/scheme@sync.policy=ray``). A scheme
composes its transport with a defaults entry: ``weightsync/scheme/transport=shared_mem``
swaps it, ``weightsync.scheme.transport.max_slots=4`` sets one of its settings.

TorchRL's trainer configs choose a scheme from TorchRL's group ``weight_sync_scheme``; weightsync's schemes are
there too, as ``weightsync_<name>``, so that one override switches a TorchRL app to weightsync
(``weight_sync_scheme@collector.weight_sync_schemes.policy=weightsync_shared_mem``; docs/torchrl.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from .configs import SCHEMES, TRANSPORTS, VLLMWeightSyncSchemeConfig, WeightStrategyConfig

__all__ = [
    "SCHEMES",
    "Composed",
    "STRATEGIES",
    "TRANSPORTS",
    "composed",
    "register_configs",
    "register_scheme_group",
    "serving_vllm",
]

STRATEGIES: dict[str, WeightStrategyConfig] = {
    "tensordict": WeightStrategyConfig(extract_as="tensordict"),
    "state_dict": WeightStrategyConfig(extract_as="state_dict"),
}


def _transport_name(cls: type) -> str | None:
    field = {f.name: f for f in dataclasses.fields(cls)}.get("transport")
    if field is None:
        return None
    kind: Any = field.default_factory
    return next(name for name, node in TRANSPORTS.items() if node is kind)


def composed(cls: type) -> Any:
    """``cls`` as its group stores it: with a defaults entry that composes its transport from the
    ``transport`` group beside it, so that the command line can swap the transport (one class per ``cls``)."""
    name = _transport_name(cls)
    if name is None:
        return cls
    entries = [{"transport": name}, "_self_"]
    fields = [
        ("defaults", list[Any], dataclasses.field(default_factory=lambda: list(entries))),
        # Left to the group: a default of a transport's own type would refuse another transport's config.
        ("transport", Any, dataclasses.field(default=MISSING)),
    ]
    return _stored(cls, fields)


class Composed:
    """The config classes the groups store (:func:`composed`, :func:`serving_vllm`), each an attribute here: a
    config composed from a group is of that class, and pickles (into a spawned process, say) only where the class
    is found by its module and name (it was ``types.MultiProcessSchemeConfig``: a Hydra user's audit)."""


_COMPOSED: dict[type, type] = {}


def _stored(base: type, fields: list[Any]) -> type:
    """``base`` with ``fields`` added, made once, and found as an attribute of :class:`Composed`."""
    if base not in _COMPOSED:
        cls = dataclasses.make_dataclass(base.__name__, fields, bases=(base,))
        cls.__module__, cls.__qualname__ = __name__, f"{Composed.__name__}.{cls.__name__}"
        setattr(Composed, cls.__name__, cls)
        _COMPOSED[base] = cls
    return _COMPOSED[base]


#: TorchRL's group of scheme configs (``torchrl.trainers.algorithms.configs``), and the prefix of weightsync's
#: options in it.
TORCHRL_GROUP, TORCHRL_PREFIX = "weight_sync_scheme", "weightsync_"


def register_scheme_group(group: str, prefix: str = "") -> None:
    """Store every scheme config in ``group`` (named ``prefix + name``) and every transport config in
    ``<group>/transport`` (the main job has its own ``scheme`` group; apps use ``weightsync/scheme``)."""
    cs = ConfigStore.instance()
    for name, node in SCHEMES.items():
        cs.store(group=group, name=prefix + name, node=composed(node))
    for name, node in TRANSPORTS.items():
        cs.store(group=f"{group}/transport", name=name, node=node)


def serving_vllm() -> Any:
    """:class:`VLLMWeightSyncSchemeConfig` as the scheme groups store it (``vllm``): its ``scheme`` composed from
    weightsync's scheme group, ``shared_mem`` unless the command line says another
    (``weightsync/scheme@weightsync.scheme.scheme=distributed``)."""
    fields = [
        (
            "defaults",
            list[Any],
            dataclasses.field(default_factory=lambda: [{"/weightsync/scheme@scheme": "shared_mem"}, "_self_"]),
        ),
        ("scheme", Any, dataclasses.field(default=MISSING)),
    ]
    return _stored(VLLMWeightSyncSchemeConfig, fields)


_registered = False


def register_configs() -> None:
    """Store every config under its group (idempotent; runs on ``import weightsync.config``)."""
    global _registered
    if _registered:
        return
    register_scheme_group("weightsync/scheme")
    register_scheme_group(TORCHRL_GROUP, TORCHRL_PREFIX)
    cs = ConfigStore.instance()
    for group, name in (("weightsync/scheme", "vllm"), (TORCHRL_GROUP, TORCHRL_PREFIX + "vllm")):
        cs.store(group=group, name=name, node=serving_vllm())
    for name, node in TRANSPORTS.items():
        cs.store(group="weightsync/transport", name=name, node=node)
    for name, strategy in STRATEGIES.items():
        cs.store(group="weightsync/strategy", name=name, node=strategy)
    _registered = True
