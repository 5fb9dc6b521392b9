"""``RayWeightSyncScheme``: workers are Ray actors; weights travel through Ray's object store once per send."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import (
    ConfigurationError,
    ReceiverError,
    WeightSyncError,
    WorkerDiedError,
    raise_failures,
)
from ..integrity import check_digest, digest
from ..layout import FlatLayout
from ..strategy import WeightStrategy, check_spec, flatten_weights, weights_spec, write_into
from ..transports.channel import deadline_after, remaining
from ..transports.distributed import is_loopback, local_interfaces
from ..transports.ray import RayActorTransport, RayTransport, apply_in_actor, register_receiver, unregister_receiver
from .acked import AckedScheme
from .base import SENDER_CONNECTED, WeightReceiver, WeightSender

# A tensor of at least this many bytes is put in the object store straight from its own memory; smaller
# ones are packed together first (one object store buffer costs about as much as copying 100 KB).
DIRECT_MIN_BYTES = 256 * 1024

__all__ = [
    "ModuleActor",
    "RayModuleTransformReceiver",
    "RayModuleTransformScheme",
    "RayModuleTransformSender",
    "RayWeightSyncScheme",
]


def _ray():
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - ray is a dependency; this guards slim installs
        raise ConfigurationError("RayWeightSyncScheme needs the 'ray' package: pip install ray") from exc
    return ray


class RayWeightSyncScheme(AckedScheme):
    """Synchronize a model to Ray actors.

    A send puts the weights in Ray's object store as one object, once however
    many actors (large tensors straight from their memory, small ones packed
    together: each byte is copied once), and asks each targeted actor to
    apply it: a call that Ray runs inside the actor, between its other method
    calls. Each actor copies the update into its own model; the call's
    completion is the ack. Updates to one actor are applied in the order sent.

    An actor whose model is on the CPU moves its tensors, at the first
    update, into one private buffer laid out like the payload (the Parameter
    objects stay, each now a view of that buffer), so that every update is
    one copy per buffer of the payload, whatever the number of tensors.

    An actor that died (or was dropped) is taken back with
    :meth:`rejoin`: a new actor for its index, or the same handle once Ray
    restarted it, gets the newest version published. The sender keeps that
    version's object in the store for this (one copy of the model).

    In the actor (typically in its ``__init__``)::

        scheme.init_on_receiver(model_id="policy", model=self.policy, worker_idx=i)
        scheme.connect()

    where ``scheme`` is the sender's scheme pickled into the actor, or
    ``weightsync.from_config(sender.receiver_config(i))``. ``receive()`` in the
    actor returns the weights if a new version was applied since the last
    call, else ``None``; it never blocks (the update itself is a call to the
    actor and could not run while the actor waits).

    Args:
        address: Ray cluster to join when Ray is not initialized yet (``None``:
            ``RAY_ADDRESS`` or a new local cluster).
        namespace: Ray namespace for that ``ray.init``.
        allow_pickle: run on a cluster of several machines. Ray unpickles what its peers send (that is
            how it calls functions and moves objects), so on a cluster whose nodes are not all on this
            machine, weights and acks cross the network as pickles: opt in only if every machine of the
            cluster is yours. Off, ``init_on_sender`` refuses a cluster with a node on another machine.
        keep_storage: actors copy each update into their model's tensors one
            by one, and never move them. Also what a model off the CPU, in
            shared memory at its first update (``share_memory()``), or with
            ``wire_dtype`` (cast back tensor by tensor) gets.
        flatten_sender: at ``init_on_sender``, the trainer's weights (the
            registered model; every tensor on the CPU) move into one buffer
            laid out like the payload: each tensor becomes a view of it, with
            its values, and the Parameter objects stay. A send then puts that
            buffer in the object store as it is, where small tensors are
            otherwise packed first (one more copy of their bytes). Off by
            default, because it changes the trainer's memory (see the guide);
            cannot be combined with ``wire_dtype``.
        Other arguments: see :class:`~weightsync.schemes.base.WeightSyncScheme`.

    Sender kwargs of ``init_on_sender``: ``remote_collectors=`` or ``actors=``
    (a list of actor handles; worker ``i`` is the ``i``-th), or a context with
    ``remote_collectors``.
    """

    backend = "ray"

    def __init__(
        self,
        strategy: str | WeightStrategy = "state_dict",
        sync: bool = True,
        timeout: float = 60.0,
        connect_timeout: float = 120.0,
        address: str | None = None,
        namespace: str | None = None,
        wire_dtype: str | None = None,
        on_failure: str = "raise",
        max_staleness: int | None = None,
        check_finite: bool = False,
        checksum: bool = False,
        allow_pickle: bool = False,
        keep_storage: bool = False,
        flatten_sender: bool = False,
    ) -> None:
        super().__init__(
            strategy=strategy,
            sync=sync,
            timeout=timeout,
            connect_timeout=connect_timeout,
            wire_dtype=wire_dtype,
            on_failure=on_failure,
            max_staleness=max_staleness,
            check_finite=check_finite,
            checksum=checksum,
            flatten_sender=flatten_sender,
        )
        self.address = address
        self.namespace = namespace
        self.allow_pickle = bool(allow_pickle)
        self.keep_storage = bool(keep_storage)

    def _config_fields(self) -> set[str]:
        return super()._config_fields() | {"address", "namespace", "allow_pickle", "keep_storage"}

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        self._layout: FlatLayout | None = None
        self._staging: torch.Tensor | None = None
        self._staging_views: dict[str, torch.Tensor] = {}
        self._newest: tuple[int, Any] | None = None  # (version, object ref) of the last send, for rejoins

    @property
    def layout(self) -> FlatLayout | None:
        return self._layout

    # ----------------------------------------------------------------- sender
    def _init_sender_impl(self, **kwargs: Any) -> None:
        actors = kwargs.pop("remote_collectors", None) or kwargs.pop("actors", None)
        if actors is None and self._context is not None:
            actors = getattr(self._context, "remote_collectors", None)
        super()._init_sender_impl(**kwargs)
        if not actors:
            raise ConfigurationError(
                "RayWeightSyncScheme.init_on_sender needs remote_collectors= (actor handles)", model_id=self._model_id
            )
        actors = list(actors)
        if self._num_workers is not None and self._num_workers != len(actors):
            raise ConfigurationError(
                f"num_workers={self._num_workers} but {len(actors)} actors were given", model_id=self._model_id
            )
        self._num_workers = len(actors)
        self._layout = self._sender_layout()  # before Ray starts: a missing model fails first
        self._adopt_sender_model(self._layout)
        self.join_ray()
        self._check_exposure()
        self._transports = {i: self.create_transport(actor=actor, worker_idx=i) for i, actor in enumerate(actors)}

    def join_ray(self, **options: Any) -> bool:
        """Unless Ray is up in this process, join the cluster this scheme names (``address``, else
        ``RAY_ADDRESS``, else a new local one) in its ``namespace``; ``options`` go to ``ray.init``.
        Returns whether this call initialized Ray."""
        ray = _ray()
        if ray.is_initialized():
            return False
        ray.init(address=self.address or os.environ.get("RAY_ADDRESS"), namespace=self.namespace, **options)
        return True

    def _check_exposure(self) -> None:
        """Refuse a cluster with nodes on other machines unless ``allow_pickle`` says so."""
        if self.allow_pickle:
            return
        here = local_interfaces()
        remote = sorted(
            address
            for address in {node["NodeManagerAddress"] for node in _ray().nodes() if node.get("Alive")}
            if address not in here and not is_loopback(address)
        )
        if remote:
            raise ConfigurationError(
                f"this Ray cluster has nodes on other machines ({', '.join(remote)}), and Ray unpickles what "
                "its peers send: set allow_pickle=True if every machine of the cluster is yours "
                "(see docs/multinode.md)",
                model_id=self._model_id,
            )

    def create_transport(self, **kwargs: Any) -> RayTransport:
        """The transport to one actor (``actor=``, ``worker_idx=``) bound to this scheme."""
        return RayTransport(scheme=self, **kwargs)

    def _rendezvous_complete(self) -> bool:
        return bool(self._transports)

    def _connect_sender_impl(self, weights: Any) -> None:
        self._send_initial(weights, self.connect_timeout)

    def send_to(self, weights: Any, targets: list[int], *, wait: bool, timeout: float | None = None) -> None:
        """Publish one new version to ``targets`` through the object store; wait for their acks when ``wait``."""
        assert self._layout is not None
        flat, whole = self._sender_weights(weights, self._layout)
        ray = _ray()
        failures = {w: self._failed[w] for w in targets if w in self._failed}
        live = [w for w in targets if w not in self._failed]
        # Take in calls that already finished; failures of earlier async sends are reported with this one.
        self._errors.update(self._collect(list(self._transports), None, {}))
        version = self._next_version
        if whole is not None:  # flatten_sender: the weights already lie in one buffer, in their places
            buffers, ranges = self._layout.whole(whole)
        else:
            if self._staging is None:  # reused by every send; ray.put copies out of it before returning
                self._staging = torch.empty(self._layout.nbytes, dtype=torch.uint8)
                self._staging_views = self._layout.views(self._staging)
            # Large tensors go as they are, small ones packed: ray.put copies each byte once into the store.
            buffers, ranges = self._layout.pieces(flat, self._staging, DIRECT_MIN_BYTES, self._staging_views)
        payload = ray.put((ranges, [b.numpy() for b in buffers], digest(buffers) if self.checksum else None))
        for w in live:
            # The layout travels until the worker has acked once (its first update carries it).
            transport = self._transports[w]
            transport.submit(version, payload, self._layout.to_plain() if transport.acked is None else None)
        self._next_version += 1
        self._version = version
        self._newest = (version, payload)
        if wait:
            deadline = deadline_after(self.timeout if timeout is None else timeout)
            failures.update(self._collect(live, deadline, {w: version for w in live}))
        failures.update({w: self._errors.pop(w) for w in list(self._errors) if w in targets and w not in failures})
        raise_failures(failures, model_id=self._model_id, version=version)

    def rejoin(self, worker_idx: int, actor: Any = None, timeout: float | None = None) -> int:
        """Sender: take worker ``worker_idx`` back after its actor died or was dropped, and send it the newest
        version published (the bytes the others got, even if the model has moved on since).

        Args:
            worker_idx: the worker's index.
            actor: its new actor, whose receiver is set up for ``worker_idx`` (``None``: the same handle,
                for an actor Ray restarted itself, ``max_restarts``).
            timeout: seconds to wait for it to apply (``None``: the scheme's ``timeout``).

        Returns:
            The version it now holds.

        Raises:
            ConfigurationError: ``worker_idx`` is not one of this scheme's workers.
            WorkerDiedError, ReceiverError, SyncTimeoutError: it could not take the version; it stays out.
        """
        self._require(SENDER_CONNECTED, action="rejoin")
        if isinstance(worker_idx, bool) or not isinstance(worker_idx, int) or worker_idx not in self._transports:
            raise ConfigurationError(
                f"worker_idx {worker_idx!r} is not in 0..{len(self._transports) - 1}", model_id=self._model_id
            )
        with self._lock:
            assert self._newest is not None and self._layout is not None  # connect() published version 0
            version, payload = self._newest
            old = self._transports[worker_idx]
            transport = self._transports[worker_idx] = self.create_transport(
                actor=old.actor if actor is None else actor, worker_idx=worker_idx
            )
            self._failed.pop(worker_idx, None)  # from here on, a failure is this actor's
            self._errors.pop(worker_idx, None)
            transport.submit(version, payload, self._layout.to_plain())
            deadline = deadline_after(self.timeout if timeout is None else timeout)
            failures = self._collect([worker_idx], deadline, {worker_idx: version})
            if failures:
                self._mark_dead(worker_idx, failures[worker_idx])
                raise_failures(failures, model_id=self._model_id, version=version)
            self._rejoined(worker_idx, version)
            return version

    def _collect(
        self, workers: list[int], deadline: float | None, expected: dict[int, int]
    ) -> dict[int, WeightSyncError]:
        """Resolve finished calls: those already done (``deadline`` None), or until each worker applied ``expected``."""
        ray = _ray()
        failures: dict[int, WeightSyncError] = {}
        while True:
            refs = {
                ref: (w, v)
                for w in workers
                if w not in self._failed
                for v, ref in self._transports[w].in_flight.items()
            }
            pending = self._missing_acks(expected, failures)
            if not refs or (expected and not pending):
                break
            wait_s = 0.0 if deadline is None else remaining(deadline)
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
            for ref in ready:
                w, v = refs[ref]
                transport = self._transports[w]
                del transport.in_flight[v]
                try:
                    held = ray.get(ref)
                    transport.acked = held if transport.acked is None else max(transport.acked, held)
                except ray.exceptions.RayActorError as exc:
                    what = (
                        "is unavailable (restarting, or out of reach)"
                        if isinstance(exc, ray.exceptions.ActorUnavailableError)
                        else "died"
                    )
                    failures[w] = self._mark_dead(
                        w,
                        WorkerDiedError(
                            f"its actor {what} ({type(exc).__name__})", model_id=self._model_id, worker_idx=w, version=v
                        ),
                    )
                except Exception as exc:  # noqa: BLE001 - the actor's failure, as Ray delivers it
                    cause = getattr(exc, "cause", None) or exc
                    failures[w] = ReceiverError(
                        type(cause).__name__,
                        str(cause).splitlines()[-1][:2000] if str(cause) else repr(cause),
                        model_id=self._model_id,
                        worker_idx=w,
                        version=v,
                    )
            if deadline is None:
                break
            if remaining(deadline) <= 0:
                failures.update(self._ack_timeouts([w for w in pending if w not in failures], expected))
                break
        failures.update(self._gone_before_acking(expected, failures))
        return failures

    # --------------------------------------------------------------- receiver
    def _init_receiver_impl(self, **kwargs: Any) -> None:
        super()._init_receiver_impl(**kwargs)
        if self._model is None:
            raise ConfigurationError(
                "init_on_receiver needs model= (or a context holding the model)", model_id=self._model_id
            )
        register_receiver(self._model_id, self)

    def _connect_receiver_impl(self) -> None:
        # Nothing to join: the sender's connect() delivers version 0 as a call to this actor.
        pass

    def _apply_payload(
        self, version: int, buffers: list[torch.Tensor], ranges: list, layout: dict | None, expected: str | None = None
    ) -> int:
        """Called inside the actor by the sender's call: check (``expected``: the payload's checksum), then copy
        the update into the model."""
        where = {"model_id": self._model_id, "worker_idx": self._worker_idx, "version": version}
        check_digest(buffers, expected, **where)
        if layout is not None:
            self._layout = FlatLayout.from_plain(layout)
        if self._layout is None:
            raise ConfigurationError("received an update before the layout", **where)
        dst = flatten_weights(self._model, self._strategy.extract_as)
        held = self._bound.holds(dst)  # the model exactly as bound: its keys, shapes, dtypes hold
        if not held:
            check_spec(self._layout.spec, weights_spec(dst), **where)
        ranges = [tuple(r) for r in ranges]
        pieces = self._layout.placed(buffers, ranges)
        with self.weights_lock:
            # One copy per buffer into the model bound to one storage; tensor by tensor where it cannot be.
            if self.keep_storage or not self._bound.load(dst, pieces, self._layout, held):
                write_into(dst, self._layout.unpack(buffers, ranges))
            self._version = version
        return version

    def _receive_impl(self, timeout: float) -> Any:
        return self._newly_applied()

    def _shutdown_impl(self) -> None:
        if self.is_receiver:
            unregister_receiver(self._model_id or "", self)
        self._transports.clear()
        self._newest = None
        self._bound.forget()


class RayModuleTransformSender(WeightSender):
    """Sender facade of :class:`RayModuleTransformScheme`: ``send`` updates the hosted module."""

    @property
    def actor(self) -> Any:
        """The actor hosting the module."""
        return self._scheme.sender_transports[0].actor


class RayModuleTransformReceiver(WeightReceiver):
    """Receiver facade of :class:`RayModuleTransformScheme`, inside the hosting actor."""


class RayModuleTransformScheme(RayWeightSyncScheme):
    """Synchronize a model hosted inside ONE Ray actor (a module that transforms data for many workers).

    The trainer keeps the model it trains; the actor holds its copy and
    serves it (for example a reward model or an encoder used as a transform).
    A send puts the weights in the object store once and calls the actor's
    ``update_weights_tensordict`` or ``update_weights_state_dict`` method (by
    strategy); the call runs between the actor's other calls, so a forward
    never sees half an update, and its completion is the ack.

    :class:`ModuleActor` provides those methods; wrap it with ``ray.remote``
    and give it the scheme (pickled, or its ``receiver_config(0)``)::

        host = ray.remote(ModuleActor).remote(make_module, scheme)  # before init_on_sender (pickled) ...
        scheme.init_on_sender(model_id="module", model=trained, actor=host)
        scheme.connect()
        ray.get(host.forward.remote(batch))

    An actor class of your own needs the two methods, each calling
    :func:`weightsync.transports.ray.apply_in_actor`, and a receiver set up
    with ``scheme.init_on_receiver(model=..., worker_idx=0)``.

    ``init_on_sender`` takes ``actor=`` (or ``remote_collectors=[actor]``, or a
    context with ``actor``).
    """

    backend = "ray_module_transform"
    needs_worker_idx = False

    def _init_sender_impl(self, **kwargs: Any) -> None:
        actor = kwargs.pop("actor", None)
        if actor is None and self._context is not None and "remote_collectors" not in kwargs:
            actor = getattr(self._context, "actor", None)
        if actor is not None:
            kwargs["remote_collectors"] = [actor]
        super()._init_sender_impl(**kwargs)
        if self._num_workers != 1:
            raise ConfigurationError(
                f"RayModuleTransformScheme hosts the module in ONE actor, got {self._num_workers}",
                model_id=self._model_id,
            )

    def create_transport(self, **kwargs: Any) -> RayActorTransport:
        return RayActorTransport(scheme=self, **kwargs)

    def _init_receiver_impl(self, **kwargs: Any) -> None:
        if self._worker_idx is None:
            self._worker_idx = 0
        super()._init_receiver_impl(**kwargs)

    def get_sender(self) -> RayModuleTransformSender:
        if not self.is_sender:
            super().get_sender()  # raises the lifecycle error
        if self._sender is None:
            self._sender = RayModuleTransformSender(self)
        return self._sender

    def get_receiver(self) -> RayModuleTransformReceiver:
        if not self.is_receiver:
            super().get_receiver()
        if self._receiver is None:
            self._receiver = RayModuleTransformReceiver(self)
        return self._receiver

    def create_sender(self) -> RayModuleTransformSender:
        return RayModuleTransformSender(self)

    def create_receiver(self) -> RayModuleTransformReceiver:
        return RayModuleTransformReceiver(self)


class ModuleActor:
    """A module served from a Ray actor and kept up to date by :class:`RayModuleTransformScheme`.

    Use as ``ray.remote(ModuleActor).remote(module, scheme, model_id="module")``.

    Args:
        module: an ``nn.Module``, or a callable that builds one inside the actor.
        scheme: the sender's scheme (pickled by Ray) or its ``receiver_config(0)``;
            ``None`` to call :meth:`join` later.
        model_id: the model's id, as the sender names it.
    """

    def __init__(self, module: Any, scheme: Any = None, model_id: str | None = None) -> None:
        import torch.nn as nn

        self.module = module if isinstance(module, nn.Module) else module()
        self.scheme: RayModuleTransformScheme | None = None
        if scheme is not None:
            self.join(scheme, model_id)

    def join(self, scheme: Any, model_id: str | None = None) -> None:
        """Set up this actor's receiver (the sender's ``connect()`` then delivers the initial weights)."""
        if isinstance(scheme, dict):
            from ..config import from_config

            scheme = from_config(scheme)
        scheme.init_on_receiver(model_id=model_id, model=self.module, worker_idx=0)
        scheme.connect()
        self.scheme = scheme

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module (without autograd) on the arguments."""
        with torch.no_grad():
            return self.module(*args, **kwargs)

    def update_weights_tensordict(self, model_id: str, version: int, payload: Any, layout: dict | None) -> int:
        """Called by the sender (strategy ``tensordict``): apply one update; return the version held."""
        return apply_in_actor(self, model_id, version, payload, layout)

    def update_weights_state_dict(self, model_id: str, version: int, payload: Any, layout: dict | None) -> int:
        """Called by the sender (strategy ``state_dict``): apply one update; return the version held."""
        return apply_in_actor(self, model_id, version, payload, layout)

    def weights_version(self) -> int | None:
        """The version this actor's module holds."""
        return self.scheme.version if self.scheme is not None else None

    def get_weights(self) -> dict[str, Any]:
        """A copy of the module's weights (strategy ``state_dict``)."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}
