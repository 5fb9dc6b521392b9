"""Structured configs: one dataclass per scheme, transport and strategy, each with a ``_target_``.

Fields mirror the target's constructor arguments one to one (a test checks it),
so ``hydra.utils.instantiate(cfg)`` builds the object and every timeout and
backend setting can be overridden from the command line. Arguments that only
exist at run time (a transport's channel, its scheme) are not fields; they are
passed to ``instantiate`` as keyword arguments.

They use only what omegaconf 2.3 supports: no ``Literal``, no unions of
dataclasses; choices are validated by the targets themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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


# ----------------------------------------------------------------- strategy
@dataclass
class WeightStrategyConfig:
    """How weights are extracted: ``"tensordict"`` (all parameters and buffers) or ``"state_dict"``."""

    _target_: str = "weightsync.WeightStrategy"
    extract_as: str = "tensordict"


# ------------------------------------------------------------------ schemes
@dataclass
class SchemeConfig:
    """Fields every scheme has.

    Attributes:
        strategy: ``"tensordict"`` or ``"state_dict"``.
        sync: ``send()`` blocks until every targeted worker applied and acked.
        timeout: seconds any single wait may last after connect.
        connect_timeout: seconds the rendez-vous may last.
        on_failure: ``"raise"`` (default) or ``"drop"``: what a send does about a worker
            that died or did not ack in time.
        max_staleness: in asynchronous sends, how many versions a worker may lag
            (``None``: no bound).
        check_finite: refuse weights holding NaN or Inf before sending anything.
    """

    _target_: str = "weightsync.NoWeightSyncScheme"
    strategy: str = "tensordict"
    sync: bool = True
    timeout: float = 60.0
    connect_timeout: float = 120.0
    on_failure: str = "raise"
    max_staleness: Optional[int] = None  # noqa: UP045
    check_finite: bool = False


@dataclass
class NoSyncSchemeConfig(SchemeConfig):
    """Synchronization switched off: every call succeeds and nothing moves."""

    _target_: str = "weightsync.NoWeightSyncScheme"


@dataclass
class LocalSchemeConfig(SchemeConfig):
    """Fields the schemes reaching worker processes on this machine share.

    Attributes:
        background_thread: receivers apply updates in a thread of their own.
        latest_wins: a worker that fell behind applies only the newest version.
        max_slots: shared staging slots the sender may allocate (``None``: ``num_workers + 2``).
        checksum: receivers check each version's XXH3-64 before applying it.
        flatten_sender: the trainer's weights move, at init, into one buffer laid out like the slots (each
            tensor a view of it), so a send is one copy whatever the number of tensors. Off by default: it
            changes the trainer's memory.
    """

    _target_: str = "weightsync.MultiProcessWeightSyncScheme"
    background_thread: bool = False
    latest_wins: bool = True
    max_slots: Optional[int] = None  # noqa: UP045 - omegaconf 2.3 reads typing.Optional, not `int | None`
    checksum: bool = False
    flatten_sender: bool = False


@dataclass
class MultiProcessSchemeConfig(LocalSchemeConfig):
    """Local worker processes, each with a private copy.

    Attributes:
        keep_storage: workers copy each update into their model's tensors one by one and never move them;
            by default a CPU model moves, at its first update, into one buffer laid out like the slot.
    """

    _target_: str = "weightsync.MultiProcessWeightSyncScheme"
    keep_storage: bool = False


@dataclass
class SharedMemSchemeConfig(LocalSchemeConfig):
    """Local worker processes reading the published weights in shared memory.

    Attributes:
        per_worker_weights: every worker gets slots of its own.
    """

    _target_: str = "weightsync.SharedMemWeightSyncScheme"
    per_worker_weights: bool = False


@dataclass
class RaySchemeConfig(SchemeConfig):
    """Workers are Ray actors.

    Attributes:
        address: Ray cluster address (``None``: ``RAY_ADDRESS`` or a local cluster).
        namespace: Ray namespace.
        wire_dtype: floating weights travel as this dtype (e.g. ``"bfloat16"``), cast back on apply.
        allow_pickle: run on a cluster of several machines, whose peers' messages Ray unpickles.
        keep_storage: actors copy each update into their model's tensors one by one and never move them;
            by default a CPU model moves, at its first update, into one buffer laid out like the payload.
        flatten_sender: the trainer's weights move, at init, into one buffer laid out like the payload (each
            tensor a view of it), put in the object store as it is: no packing copy. Off by default: it
            changes the trainer's memory. Not with ``wire_dtype``.
    """

    _target_: str = "weightsync.schemes.ray.RayWeightSyncScheme"
    strategy: str = "state_dict"
    address: Optional[str] = None  # noqa: UP045
    namespace: Optional[str] = None  # noqa: UP045
    wire_dtype: Optional[str] = None  # noqa: UP045
    checksum: bool = False
    allow_pickle: bool = False
    keep_storage: bool = False
    flatten_sender: bool = False


@dataclass
class RayModuleTransformSchemeConfig(RaySchemeConfig):
    """A model hosted inside one Ray actor (`weightsync.ModuleActor` or an actor of your own)."""

    _target_: str = "weightsync.schemes.ray.RayModuleTransformScheme"


@dataclass
class RPCSchemeConfig(SchemeConfig):
    """``torch.distributed.rpc`` (TensorPipe) between the trainer and named workers.

    Attributes:
        master_addr: the trainer's host as workers reach it (``None``: ``MASTER_ADDR`` or 127.0.0.1).
        master_port: rendez-vous port (``None``: ``MASTER_PORT`` or a free port).
        latest_wins: a worker that fell behind applies only the newest update.
        max_buffers: staging buffers the trainer may hold for updates not acked yet.
        wire_dtype: floating weights travel as this dtype (e.g. ``"bfloat16"``), cast back on apply.
        keep_storage: workers copy each update into their model's own memory; by default a CPU model
            switches to the buffer the update arrived in (one copy fewer).
        allow_pickle: let ``master_addr`` be a network address, whose peers' messages RPC unpickles.
        flatten_sender: the trainer's weights move, at init, into one buffer laid out like the payload (each
            tensor a view of it), so a send copies one buffer into staging. Off by default: it changes the
            trainer's memory. Not with ``wire_dtype``.
    """

    _target_: str = "weightsync.schemes.rpc.RPCWeightSyncScheme"
    strategy: str = "state_dict"
    master_addr: Optional[str] = None  # noqa: UP045
    master_port: Optional[int] = None  # noqa: UP045
    latest_wins: bool = True
    max_buffers: int = 2
    wire_dtype: Optional[str] = None  # noqa: UP045
    keep_storage: bool = False
    checksum: bool = False
    allow_pickle: bool = False
    flatten_sender: bool = False


@dataclass
class DistributedSchemeConfig(SchemeConfig):
    """A ``torch.distributed`` process group of the scheme's own (the default group is left alone).

    Attributes:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA).
        master_addr: the trainer's host as workers reach it (``None``: ``MASTER_ADDR`` or 127.0.0.1).
        master_port: TCP store port (``None``: ``MASTER_PORT`` or a free port).
        latest_wins: a worker that fell behind applies only the newest update.
        max_buffers: staging buffers the trainer may hold while workers still receive earlier versions.
        wire_dtype: floating weights travel as this dtype (e.g. ``"bfloat16"``), cast back on apply.
        bucket_mb: send the weights in buckets of at most this many MB, each copied while the previous
            one is on the wire (``None``: one message).
        keep_storage: workers copy each update into their model's own memory; by default a CPU model
            switches to the buffer the update arrived in (one copy fewer, same memory).
        flatten_sender: the trainer's weights move, at init, into one buffer laid out like the payload (each
            tensor a view of it), so a send copies one buffer into staging. Off by default: it changes the
            trainer's memory. CPU weights only, not with ``wire_dtype``.
    """

    _target_: str = "weightsync.schemes.distributed.DistributedWeightSyncScheme"
    backend: str = "gloo"
    master_addr: Optional[str] = None  # noqa: UP045
    master_port: Optional[int] = None  # noqa: UP045
    latest_wins: bool = True
    max_buffers: int = 2
    wire_dtype: Optional[str] = None  # noqa: UP045
    bucket_mb: Optional[float] = None  # noqa: UP045
    keep_storage: bool = False
    checksum: bool = False
    flatten_sender: bool = False


# --------------------------------------------------------------- transports
@dataclass
class MPTransportConfig:
    """The channel to one local worker; ``channel`` (and ``scheme``) are given at instantiate time."""

    _target_: str = "weightsync.MPTransport"
    worker_idx: int = 0


@dataclass
class SharedMemTransportConfig(MPTransportConfig):
    _target_: str = "weightsync.SharedMemTransport"


@dataclass
class RayTransportConfig:
    """Transport to one Ray actor (the `actor` handle is given at instantiate time)."""

    _target_: str = "weightsync.transports.ray.RayTransport"
    worker_idx: int = 0


@dataclass
class RayActorTransportConfig(RayTransportConfig):
    _target_: str = "weightsync.transports.ray.RayActorTransport"


@dataclass
class RPCTransportConfig:
    """Transport to one RPC worker (``worker_name``: its RPC name, default ``weightsync-worker-<idx>``)."""

    _target_: str = "weightsync.transports.rpc.RPCTransport"
    worker_idx: int = 0
    worker_name: Optional[str] = None  # noqa: UP045


@dataclass
class DistributedTransportConfig:
    """Transport to one torch.distributed rank (``worker_idx + 1``)."""

    _target_: str = "weightsync.transports.distributed.DistributedTransport"
    worker_idx: int = 0
    sync: bool = True
