"""Structured configs: one dataclass per scheme, transport and strategy, each with a ``_target_``.

They are made from the options each scheme and transport declares
(:mod:`weightsync.options`), so a field, its type, its default and its
documentation are written once, where the option is. A scheme's config holds
its own options and composes its transport's config under ``transport``
(Hydra's ``_partial_``: the scheme builds one transport per worker from it),
which holds the transport's own settings (slots, buckets, wire dtype,
backend): ``scheme.transport.bucket_mb=4`` sets one, and choosing another
transport of the same engine (``scheme/transport=shared_mem``) takes effect.
``hydra.utils.instantiate(cfg)`` builds the object.

They use only what omegaconf 2.3 supports: no ``Literal``, no unions of
dataclasses; choices are checked by the options themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import options
from ..options import Option
from ..schemes.distributed import DistributedWeightSyncScheme
from ..schemes.local import LocalScheme
from ..schemes.multiprocess import MultiProcessWeightSyncScheme
from ..schemes.no_sync import NoWeightSyncScheme
from ..schemes.ray import RayModuleTransformScheme, RayWeightSyncScheme
from ..schemes.rpc import RPCWeightSyncScheme
from ..schemes.shared_mem import SharedMemWeightSyncScheme

__all__ = [
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
]


def _doc(summary: str, opts: tuple[Option, ...]) -> str:
    lines = [summary]
    if opts:
        lines += ["", "Attributes:"] + [f"    {o.name}: {o.doc}" for o in opts]
    return "\n".join(lines)


def _config(
    name: str, target: str, opts: tuple[Option, ...], summary: str, base: type | None = None, **extra: Any
) -> type:
    """A dataclass named ``name`` with ``_target_`` and one field per option not already in ``base``."""
    inherited = {f.name for f in dataclasses.fields(base)} if base else set()
    fields: list[Any] = [("_target_", str, dataclasses.field(default=target))]
    fields += [(o.name, o.annotation, dataclasses.field(default=o.default)) for o in opts if o.name not in inherited]
    fields += [(key, annotation, value) for key, (annotation, value) in extra.items()]
    cls = dataclasses.make_dataclass(name, fields, bases=(base,) if base else ())
    cls.__module__ = __name__
    cls.__doc__ = _doc(summary, tuple(o for o in opts if o.name not in inherited))
    return cls


def _own(scheme: type) -> tuple[Option, ...]:
    """A scheme's options that are not its transport's settings (those live in its transport's config)."""
    settings = {o.name for o in scheme.TRANSPORT_SETTINGS}
    return tuple(o for o in scheme.OPTIONS if o.name not in settings)


# ----------------------------------------------------------------- strategy
@dataclasses.dataclass
class WeightStrategyConfig:
    """How weights are extracted: ``"tensordict"`` (all parameters and buffers) or ``"state_dict"``."""

    _target_: str = "weightsync.WeightStrategy"
    extract_as: str = "tensordict"


# --------------------------------------------------------------- transports
_PARTIAL = {"_partial_": (bool, dataclasses.field(default=True))}

MPTransportConfig = _config(
    "MPTransportConfig",
    "weightsync.MPTransport",
    options.LOCAL_SETTINGS,
    "The channels to local workers that copy each update into their own model.",
    **_PARTIAL,
)
SharedMemTransportConfig = _config(
    "SharedMemTransportConfig",
    "weightsync.SharedMemTransport",
    options.LOCAL_SETTINGS,
    "The channels to local workers that read their model from the shared slots.",
    base=MPTransportConfig,
)
RayTransportConfig = _config(
    "RayTransportConfig",
    "weightsync.transports.ray.RayTransport",
    options.RAY_SETTINGS,
    "Updates as calls that run inside each Ray actor.",
    **_PARTIAL,
)
RayActorTransportConfig = _config(
    "RayActorTransportConfig",
    "weightsync.transports.ray.RayActorTransport",
    options.RAY_SETTINGS,
    "Updates as calls to the ``update_weights_*`` methods of the one actor hosting a module.",
    base=RayTransportConfig,
)
RPCTransportConfig = _config(
    "RPCTransportConfig",
    "weightsync.transports.rpc.RPCTransport",
    options.RPC_SETTINGS,
    "One RPC per worker and update, answered once applied.",
    **_PARTIAL,
)
DistributedTransportConfig = _config(
    "DistributedTransportConfig",
    "weightsync.transports.distributed.DistributedTransport",
    options.DISTRIBUTED_SETTINGS,
    "Point-to-point sends over a torch.distributed group of the scheme's own, signalled through its store.",
    **_PARTIAL,
)

#: Each transport's config, by the name a scheme's ``TRANSPORTS`` gives it.
TRANSPORT_OF: dict[str, type] = {
    "mp": MPTransportConfig,
    "shared_mem": SharedMemTransportConfig,
    "ray": RayTransportConfig,
    "ray_actor": RayActorTransportConfig,
    "rpc": RPCTransportConfig,
    "distributed": DistributedTransportConfig,
}


def _transport_field(scheme: type) -> dict[str, tuple[Any, Any]]:
    default = TRANSPORT_OF[next(iter(scheme.TRANSPORTS))]
    return {"transport": (Any, dataclasses.field(default_factory=default))}


# ------------------------------------------------------------------ schemes
SchemeConfig = _config(
    "SchemeConfig",
    "weightsync.NoWeightSyncScheme",
    options.COMMON,
    "Fields every scheme has.",
)
NoSyncSchemeConfig = _config(
    "NoSyncSchemeConfig",
    "weightsync.NoWeightSyncScheme",
    NoWeightSyncScheme.OPTIONS,
    "Synchronization switched off: every call succeeds and nothing moves.",
    base=SchemeConfig,
)
LocalSchemeConfig = _config(
    "LocalSchemeConfig",
    "weightsync.MultiProcessWeightSyncScheme",
    _own(LocalScheme),
    "Fields the schemes reaching worker processes on this machine share.",
    base=SchemeConfig,
    **_transport_field(LocalScheme),
)
MultiProcessSchemeConfig = _config(
    "MultiProcessSchemeConfig",
    "weightsync.MultiProcessWeightSyncScheme",
    _own(MultiProcessWeightSyncScheme),
    "Local worker processes, each with a private copy.",
    base=LocalSchemeConfig,
)
SharedMemSchemeConfig = _config(
    "SharedMemSchemeConfig",
    "weightsync.SharedMemWeightSyncScheme",
    _own(SharedMemWeightSyncScheme),
    "Local worker processes reading the published weights in shared memory.",
    base=LocalSchemeConfig,
    **_transport_field(SharedMemWeightSyncScheme),
)
RaySchemeConfig = _config(
    "RaySchemeConfig",
    "weightsync.schemes.ray.RayWeightSyncScheme",
    _own(RayWeightSyncScheme),
    "Workers are Ray actors.",
    base=SchemeConfig,
    **_transport_field(RayWeightSyncScheme),
)
RayModuleTransformSchemeConfig = _config(
    "RayModuleTransformSchemeConfig",
    "weightsync.schemes.ray.RayModuleTransformScheme",
    _own(RayModuleTransformScheme),
    "A model hosted inside one Ray actor (`weightsync.ModuleActor` or an actor of your own).",
    base=RaySchemeConfig,
    **_transport_field(RayModuleTransformScheme),
)
RPCSchemeConfig = _config(
    "RPCSchemeConfig",
    "weightsync.schemes.rpc.RPCWeightSyncScheme",
    _own(RPCWeightSyncScheme),
    "``torch.distributed.rpc`` (TensorPipe) between the trainer and named workers.",
    base=SchemeConfig,
    **_transport_field(RPCWeightSyncScheme),
)
DistributedSchemeConfig = _config(
    "DistributedSchemeConfig",
    "weightsync.schemes.distributed.DistributedWeightSyncScheme",
    _own(DistributedWeightSyncScheme),
    "A ``torch.distributed`` process group of the scheme's own (the default group is left alone).",
    base=SchemeConfig,
    **_transport_field(DistributedWeightSyncScheme),
)
