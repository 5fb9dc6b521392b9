"""``RayWeightSyncScheme``: workers are Ray actors; weights travel through Ray's object store once per send."""

from __future__ import annotations

import contextlib
import os
from typing import Any, ClassVar

import torch

from .. import checks, options, registry
from ..core.engine import ReceiverEngine, SenderEngine, Sink
from ..core.facade import WeightReceiver, WeightSender
from ..core.settings import TransportSettings
from ..core.states import SENDER_CONNECTED
from ..core.timing import deadline_after
from ..errors import ConfigurationError, raise_failures
from ..options import DELTA, TRACK_WRITES, WIRE_DTYPE, option
from ..tensors.layout import FlatLayout
from ..transports.ray.settings import RayActorSettings, RaySettings
from .payload import PayloadScheme

__all__ = [
    "ModuleActor",
    "RayModuleTransformReceiver",
    "RayModuleTransformScheme",
    "RayModuleTransformSender",
    "RayWeightSyncScheme",
]


class RayWeightSyncScheme(PayloadScheme, name="ray"):
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
    ``keep_storage``, a model off the CPU or in shared memory at its first
    update, or a ``wire_dtype`` to cast back from copy tensor by tensor.

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

    Ray unpickles what its peers send, so ``init_on_sender`` refuses a cluster
    with a node on another machine unless ``allow_pickle=True``.

    Sender kwargs of ``init_on_sender``: ``remote_collectors=`` or ``actors=``
    (a list of actor handles; worker ``i`` is the ``i``-th), or a context with
    ``remote_collectors``.
    """

    address: str | None = option(options.ADDRESS)
    namespace: str | None = option(options.NAMESPACE)
    keep_storage: bool = option(options.KEEP_STORAGE)
    allow_pickle: bool = option(options.ALLOW_PICKLE)
    wire_dtype: str | None = option(WIRE_DTYPE)
    delta: Any = option(DELTA)  # false, true or "auto"
    track_writes: bool = option(TRACK_WRITES)
    latest_wins: bool = option(options.LATEST_WINS)

    TRANSPORTS: ClassVar[tuple[type[TransportSettings], ...]] = (RaySettings, RayActorSettings)
    SENDER_HANDLES = ("remote_collectors", "actors", "actor")

    def join_ray(self, **options: Any) -> bool:
        """Unless Ray is up in this process, join the cluster this scheme names (``address``, else
        ``RAY_ADDRESS``, else a new local one: never the one Ray's own default would join, which another user of
        the host can name, :mod:`~weightsync.transports.ray.cluster`) in its ``namespace``; ``options`` go to
        ``ray.init``. A new local cluster keeps its files where only this user may enter, unless ``options`` give
        ``_temp_dir`` (:func:`~weightsync.transports.ray.cluster.private_temp_dir`). Returns whether this call
        initialized Ray.

        Raises:
            ConfigurationError: ``"auto"`` names no cluster of this user's.
        """
        from ..transports.network import await_listener
        from ..transports.ray.auth_token import keep_token_private
        from ..transports.ray.cluster import LOCAL, bootstrap_address, private_ray_files
        from ..transports.ray.sender import ray

        if ray().is_initialized():
            keep_token_private(new_cluster=False)  # (a token open to others lets them run code in the cluster)
            return False
        address = bootstrap_address(self.address or os.environ.get("RAY_ADDRESS"), options.get("_temp_dir"))
        keep_token_private(new_cluster=address == LOCAL)
        given = options.pop("_temp_dir", None)
        # (a new local cluster's files: Ray's default temp dir is open to every user)
        files = private_ray_files() if address == LOCAL and given is None else contextlib.nullcontext(given)
        host, colon, port = address.removeprefix("ray://").rpartition(":")
        if colon and host and port.isdigit():  # (Ray's own connect retries for minutes, past connect_timeout)
            timeout = float(self.connect_timeout)
            await_listener(host.strip("[]"), int(port), deadline_after(timeout), timeout, "Ray cluster")
        with files as temp_dir:
            ray().init(address=address, namespace=self.namespace, _temp_dir=temp_dir, **options)
        return True

    def _check_exposure(self) -> None:
        """Refuse a cluster with nodes on other machines unless ``allow_pickle`` says so."""
        from ..transports.network import is_loopback, local_interfaces
        from ..transports.ray.sender import ray

        if self.allow_pickle:
            return
        here = local_interfaces()
        remote = sorted(
            address
            for address in {node["NodeManagerAddress"] for node in ray().nodes() if node.get("Alive")}
            if address not in here and not is_loopback(address)
        )
        if remote:
            raise ConfigurationError(
                f"this Ray cluster has nodes on other machines ({', '.join(remote)}), and Ray unpickles what "
                "its peers send: set allow_pickle=True if every machine of the cluster is yours "
                "(see docs/multinode.md)",
                model_id=self.model_id,
            )

    def create_transport(self, **kwargs: Any) -> Any:
        """The transport to one actor (``actor=``, ``worker_idx=``)."""
        sink = self._sending if self.is_sender else None
        return self.transport_class(
            kwargs["actor"], kwargs["worker_idx"], self.model_id, self._strategy.extract_as, sink
        )

    def _actors(self, kwargs: dict[str, Any]) -> list[Any]:
        actors = kwargs.get("remote_collectors") or kwargs.get("actors")
        if actors is None and self.context is not None:
            actors = getattr(self.context, "remote_collectors", None)
        if not actors:
            raise ConfigurationError(
                f"{type(self).__name__}.init_on_sender needs remote_collectors= (actor handles)",
                model_id=self.model_id,
            )
        held = sorted({type(a).__name__ for a in actors} - {"ActorHandle"}) if isinstance(actors, (list, tuple)) else []
        if held or not isinstance(actors, (list, tuple)):
            raise ConfigurationError(
                f"{type(self).__name__}.init_on_sender takes a list of Ray actor handles (ray.remote(Cls).remote(...)"
                f"), got {f'a list holding {held}' if held else type(actors).__name__}",
                model_id=self.model_id,
            )
        return list(actors)

    def _count_workers(self, kwargs: dict[str, Any]) -> int:
        actors = self._actors(kwargs)
        if self.num_workers is not None and self.num_workers != len(actors):
            raise ConfigurationError(
                f"num_workers={self.num_workers} but {len(actors)} actors were given", model_id=self.model_id
            )
        return len(actors)

    def _sender_engine(self, sink: Sink, layout: FlatLayout, num_workers: int, kwargs: dict[str, Any]) -> SenderEngine:
        from ..transports.ray.sender import RaySender

        actors = self._actors(kwargs)
        _one_worker_each(dict(enumerate(actors)), self.model_id)
        self.join_ray()
        self._check_exposure()
        settings = self.settings
        assert isinstance(settings, RaySettings)
        return RaySender(
            sink,
            layout,
            num_workers,
            settings,
            actors=actors,
            extract_as=self._strategy.extract_as,
            checksum=self.checksum,
            gpu=self._model_gpu,
            latest_wins=self.latest_wins,
        )

    def _receiver_engine(
        self, handoff: dict[str, Any], kwargs: dict[str, Any], where: dict[str, Any]
    ) -> ReceiverEngine:
        from ..transports.ray.receiver import RayReceiver

        return RayReceiver(placement="write" if self.keep_storage else "load", where=where)

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
        self._runtime.require(SENDER_CONNECTED, action="rejoin")
        assert self._sending is not None and self._sending.engine is not None
        sending = self._sending
        if isinstance(worker_idx, bool) or not isinstance(worker_idx, int) or worker_idx not in sending.ledger.peers:
            raise ConfigurationError(
                f"worker_idx {worker_idx!r} is not in 0..{len(sending.ledger.peers) - 1}", model_id=self.model_id
            )
        within = checks.within(timeout, self.timeout, "rejoin(timeout)")  # (before the actor is sent anything)
        with self._runtime.lock:
            # this scheme's engine (RaySender), or a driver's wrapping it (vLLM engines: VLLMEngines.replace)
            engine: Any = sending.engine
            if actor is not None:
                held = {w: getattr(t, "actor", None) for w, t in self.sender_transports.items()}
                _one_worker_each({**held, worker_idx: actor}, self.model_id)
            version = engine.resubmit(worker_idx, actor)
            deadline = deadline_after(within)
            failures = sending.collect({worker_idx: version}, deadline, within)
            if failures:
                sending.mark_dead(worker_idx, failures[worker_idx])
                raise_failures(failures, model_id=self.model_id, version=version)
            sending.rejoined(worker_idx, version)
            return version


def _one_worker_each(actors: dict[int, Any], model_id: str | None) -> None:
    """Refuse one actor given for two workers (``actors``: by worker): it holds one receiver of a model, so the two
    would be told apart by nothing.

    Raises:
        ConfigurationError: naming the two workers.
    """
    first: dict[Any, int] = {}
    for w, actor in sorted(actors.items()):
        if actor is not None and actor in first:  # (a handle compares, and hashes, by its actor's id)
            raise ConfigurationError(
                f"workers {first[actor]} and {w} were given the same actor: give each worker an actor of its own",
                model_id=model_id,
            )
        first.setdefault(actor, w)


@registry.public
class RayModuleTransformSender(WeightSender):
    """Sender facade of :class:`RayModuleTransformScheme`: ``send`` updates the hosted module."""

    @property
    def actor(self) -> Any:
        """The actor hosting the module."""
        return self._scheme.sender_transports[0].actor


@registry.public
class RayModuleTransformReceiver(WeightReceiver):
    """Receiver facade of :class:`RayModuleTransformScheme`, inside the hosting actor."""


class RayModuleTransformScheme(RayWeightSyncScheme, name="ray_module_transform"):
    """Synchronize a model hosted inside ONE Ray actor (a module that transforms data for many workers).

    The trainer keeps the model it trains; the actor holds its copy and
    serves it (for example a reward model or an encoder used as a transform).
    A send puts the weights in the object store once and calls the actor's
    ``update_weights_tensordict`` or ``update_weights_state_dict`` method (by
    strategy); it applies the update under the scheme's ``weights_lock``, which
    :meth:`ModuleActor.forward` holds too, so a forward never sees half an
    update (in an actor that runs calls side by side, ``max_concurrency`` above 1,
    as well), and its completion is the ack.

    :class:`ModuleActor` provides those methods; wrap it with ``ray.remote``
    and give it the scheme (pickled, or its ``receiver_config(0)``)::

        scheme.join_ray()  # before any actor: Ray's own start would join the cluster a world-writable file names
        host = ray.remote(ModuleActor).remote(make_module, scheme, model_id="module")  # pickled before init
        scheme.init_on_sender(model_id="module", model=trained, actor=host)
        scheme.connect()
        ray.get(host.forward.remote(batch))

    An actor class of your own needs the two methods, each calling
    :func:`weightsync.transports.ray.apply_in_actor`, and a receiver set up
    with ``scheme.init_on_receiver(model=..., worker_idx=0)``.

    ``init_on_sender`` takes ``actor=`` (or ``remote_collectors=[actor]``, or a
    context with ``actor``).
    """

    needs_worker_idx = False
    TRANSPORTS = (RayActorSettings, RaySettings)
    sender_facade = RayModuleTransformSender
    receiver_facade = RayModuleTransformReceiver

    def _actors(self, kwargs: dict[str, Any]) -> list[Any]:
        actor = kwargs.pop("actor", None)
        if actor is None and self.context is not None and "remote_collectors" not in kwargs:
            actor = getattr(self.context, "actor", None)
        if actor is not None:
            kwargs["remote_collectors"] = [actor]
        actors = super()._actors(kwargs)
        if len(actors) != 1:
            raise ConfigurationError(
                f"RayModuleTransformScheme hosts the module in ONE actor, got {len(actors)}", model_id=self.model_id
            )
        return actors

    def _open_receiver(self, kwargs: dict[str, Any]) -> None:
        if self.worker_idx is None:
            self._runtime.worker_idx = 0
        super()._open_receiver(kwargs)


@registry.public
class ModuleActor:
    """A module served from a Ray actor and kept up to date by :class:`RayModuleTransformScheme`.

    Use as ``ray.remote(ModuleActor).remote(module, scheme, model_id="module")``, after ``scheme.join_ray()``.

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
        """Run the module (without autograd) on the arguments, under the receiver's ``weights_lock``: in an actor
        that runs calls side by side (``max_concurrency`` above 1), an update waits for the forward passes under
        way, and they for it (without it, 9 of 144 forwards beside updates computed with two versions at once)."""
        lock = self.scheme.weights_lock if self.scheme is not None else contextlib.nullcontext()
        with lock, torch.no_grad():
            return self.module(*args, **kwargs)

    def update_weights_tensordict(self, model_id: str, version: int, payload: Any, layout: dict | None) -> int:
        """Called by the sender (strategy ``tensordict``): apply one update; return the version held."""
        from ..transports.ray.transport import apply_in_actor

        return apply_in_actor(self, model_id, version, payload, layout)

    def update_weights_state_dict(self, model_id: str, version: int, payload: Any, layout: dict | None) -> int:
        """Called by the sender (strategy ``state_dict``): apply one update; return the version held."""
        from ..transports.ray.transport import apply_in_actor

        return apply_in_actor(self, model_id, version, payload, layout)

    def weights_version(self) -> int | None:
        """The version this actor's module holds."""
        return self.scheme.version if self.scheme is not None else None

    def get_weights(self) -> dict[str, Any]:
        """A copy of the module's weights (strategy ``state_dict``)."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}
