"""What a scheme tells about itself: its role and state, its model, context and weights, versions, acks,
transports, metrics. A program that drives a scheme (:mod:`weightsync.core.drivers`) reads its lifecycle here too,
and may set its ``context`` and ``model``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import LifecycleError, WeightSyncError
from ..metrics import SendMetrics, SendRecord
from ..model_path import resolve_weights
from ..tensors.bound import one_device
from ..tensors.copies import in_shared_memory
from ..tensors.strategy import check_sendable, flatten_weights
from .external import ExternalModel
from .runtime import Runtime
from .states import RECEIVER_CONNECTED, RECEIVING, SENDER_CONNECTED, SENDING

if TYPE_CHECKING:
    from ..tensors.layout import FlatLayout
    from ..tensors.strategy import WeightStrategy
    from .sender import Sender

__all__ = ["SchemeProperties"]


class SchemeProperties:
    """What :class:`~weightsync.core.scheme.WeightSyncScheme` tells about itself; only ``context`` and ``model``
    may be set. Everything it tells is read from the scheme's :class:`~weightsync.core.runtime.Runtime`, which this
    class holds: ``_start_runtime`` makes a new one."""

    def _start_runtime(self, strategy: WeightStrategy) -> None:
        """Start from a new :class:`Runtime` (at construction and unpickling): no model, no workers, state new."""
        self._runtime = Runtime(strategy)
        #: Held while a receiver writes or switches its model's weights; a worker whose forward pass runs
        #: beside a background receiver thread holds it too.
        self.weights_lock = self._runtime.weights_lock

    # What tests and tools inspect of a live scheme (its sender core, what a pickled scheme carries).
    @property
    def _sending(self) -> Sender | None:
        return self._runtime.sending

    @property
    def _handoff(self) -> dict[str, Any] | None:
        return self._runtime.handoff

    # ------------------------------------------------------------------- facts
    @property
    def state(self) -> str:
        """Where the scheme is in its lifecycle (``'new'``, ``'connected sender'``, ...)."""
        return self._runtime.state

    @property
    def strategy(self) -> str | WeightStrategy:  # typed as the option is given; the value is a WeightStrategy
        """How weights are extracted from the model and put back."""
        return self._runtime.strategy

    @property
    def model_id(self) -> str | None:
        """The model's name (or path inside the context)."""
        return self._runtime.model_id

    @property
    def worker_idx(self) -> int | None:
        """Receiver: which worker this is."""
        return self._runtime.worker_idx

    @property
    def num_workers(self) -> int | None:
        """How many workers the sender serves."""
        return self._runtime.num_workers

    @property
    def model_device(self) -> torch.device | None:
        """The device every weight of the registered model is on (``None``: no model yet, or several devices)."""
        rt = self._runtime
        if isinstance(rt.model, ExternalModel):
            return rt.model.device
        return None if rt.model is None else one_device(list(rt.strategy.flat(rt.model).values()))

    @property
    def _model_gpu(self) -> torch.device | None:
        """The GPU every weight of the registered model is on, if one."""
        device = self.model_device
        return device if device is not None and device.type == "cuda" else None

    @property
    def initialized_on_sender(self) -> bool:
        """``init_on_sender`` ran (and the scheme is not shut down)."""
        return self._runtime.state in SENDING

    @property
    def initialized_on_receiver(self) -> bool:
        """``init_on_receiver`` ran (and the scheme is not shut down)."""
        return self._runtime.state in RECEIVING

    is_sender = initialized_on_sender
    is_receiver = initialized_on_receiver

    @property
    def synchronized_on_sender(self) -> bool:
        """The sender's ``connect()`` ran: every worker joined and holds version 0."""
        return self._runtime.state == SENDER_CONNECTED

    @property
    def synchronized_on_receiver(self) -> bool:
        """The receiver's ``connect()`` ran: it holds the sender's version 0."""
        return self._runtime.state == RECEIVER_CONNECTED

    @property
    def strategy_str(self) -> str:
        """The strategy's format, ``"tensordict"`` or ``"state_dict"``."""
        return self._runtime.strategy.extract_as

    @property
    def context(self) -> Any:
        """The object the model was found in (a driving program may set it: in a worker, to its own part there)."""
        return self._runtime.context

    @context.setter
    def context(self, context: Any) -> None:
        self._runtime.context = context

    @property
    def model(self) -> Any:
        """The registered model (sender: or its weights). A receiver's may be replaced: later updates go to the new
        one (a driving program may move its copy of the model to its device after ``connect``)."""
        return self._runtime.model

    @model.setter
    def model(self, model: Any) -> None:
        rt = self._runtime
        with rt.weights_lock:
            rt.model = model
            if rt.receiving is not None:
                rt.receiving.set_model(model)
            if rt.hold.holding:  # the new model's forward passes take turns with updates too
                rt.hold.hold(model)

    @property
    def _applies_itself(self) -> bool:
        """A program drives this receiver: it applies updates itself, and its model's sharing is the program's."""
        return self._runtime.applies_itself

    def _kept_shared(self, flat: dict[str, torch.Tensor]) -> bool:
        """Whether the model's tensors ``flat`` are in shared memory that must stay theirs: processes of the worker's
        own may read it. Not where a driving program put them there (it pickled the trainer's model into the
        worker): that sharing would let the trainer's steps reach the worker, and is undone at the first update."""
        return in_shared_memory(flat) and not self._runtime.applies_itself

    @property
    def _model_kept_shared(self) -> bool:
        """Whether the registered model's tensors are in shared memory that must stay theirs (:meth:`_kept_shared`);
        never for a model a program loads itself (:class:`~weightsync.core.external.ExternalModel`)."""
        rt = self._runtime
        if isinstance(rt.model, ExternalModel):
            return False
        return self._kept_shared(flatten_weights(rt.model, rt.strategy.extract_as))

    @property
    def version(self) -> int | None:
        """Sender: the last version published. Receiver: the version it holds. ``None`` before any."""
        rt = self._runtime
        if rt.sending is not None:
            return rt.sending.version
        return rt.receiving.version if rt.receiving is not None else None

    @property
    def applied_on_arrival(self) -> bool:
        """Receiver: its engine's updates are calls into this process, applied as they arrive (Ray's): there is
        nothing to :meth:`take` or wait for. ``False`` on a sender and before ``init_on_receiver``."""
        receiving = self._runtime.receiving
        return receiving is not None and receiving.engine.pushes

    @property
    def layout(self) -> FlatLayout | None:
        """Where each tensor sits in the bytes of a version (``None`` before it is known)."""
        rt = self._runtime
        if rt.sending is not None:
            return rt.sending.layout
        return rt.receiving.engine.layout if rt.receiving is not None else None

    def _senders_alone(self, what: str) -> Sender | None:
        """The sender's state, read by ``what`` (``None`` before ``init_on_sender``).

        Raises:
            LifecycleError: this scheme is a worker's, which holds none of it: an empty answer would read as
                "nothing sent, no worker acked".
        """
        if self._runtime.receiving is not None:
            raise LifecycleError(
                f"{what} tells what the trainer's sends did: ask the sender's scheme; this one is a worker's "
                "(the version it holds: scheme.version)",
                model_id=self._runtime.model_id,
                worker_idx=self._runtime.worker_idx,
            )
        return self._runtime.sending

    @property
    def acked_versions(self) -> dict[int, int | None]:
        """Sender only: the last version each worker acked (``None`` if none yet; empty before ``init_on_sender``).

        Raises:
            LifecycleError: on a worker's scheme (as ``failed_workers``, ``last_send`` and ``stats()``).
        """
        sending = self._senders_alone("acked_versions")
        peers = sending.ledger.peers if sending is not None else {}
        return {w: p.acked for w, p in sorted(peers.items())}

    @property
    def failed_workers(self) -> dict[int, WeightSyncError]:
        """Sender only: workers found dead, with the error that revealed it."""
        sending = self._senders_alone("failed_workers")
        return dict(sending.ledger.dead) if sending is not None else {}

    @property
    def weights(self) -> Any:
        """The weights of the registered model, in the strategy's format (no copy)."""
        rt = self._runtime
        return None if rt.model is None else rt.strategy.extract_weights(rt.model)

    def prepare_weights(
        self, weights: Any, model_id: str | None = None, strategy: WeightStrategy | None = None, context: Any = None
    ) -> Any:
        """Resolve ``weights`` to the strategy's format (no copy).

        ``None`` reads the model registered for ``model_id`` (or found in
        ``context``); a module, TensorDict or dict is converted.

        Raises:
            InvalidWeightsError: nothing to send, or non-tensor values.
        """
        strategy = strategy or self._runtime.strategy
        return strategy.format(self._flat_weights(weights, model_id, context, strategy))

    def _flat_weights(
        self,
        weights: Any,
        model_id: str | None = None,
        context: Any = None,
        strategy: Any = None,
        *,
        detach: bool = True,
    ) -> dict:
        """``{dotted_key: tensor}`` of ``weights`` (``None``: the registered model). ``detach=False`` keeps the
        source's own tensors, for callers that only copy them out under ``no_grad`` (no per-tensor alias)."""
        rt = self._runtime
        strategy = strategy or rt.strategy
        context = context if context is not None else rt.context
        if weights is None and rt.model is not None and (model_id or rt.model_id) == rt.model_id:
            weights = rt.model
        source = resolve_weights(weights, context, model_id or rt.model_id)
        flat = strategy.flat(source) if detach else flatten_weights(source, strategy.extract_as)
        if source is not rt.model or rt.skeleton:  # (the registered model was checked at init: its sends stay cheap)
            check_sendable(flat, model_id=model_id or rt.model_id)
        return flat

    @property
    def sender_transports(self) -> dict[int, Any]:
        """Sender: the transport to each worker."""
        engine = self._runtime.sending.engine if self._runtime.sending is not None else None
        return dict(engine.transports) if engine is not None else {}

    @property
    def receiver_transport(self) -> Any:
        """Receiver: its transport from the sender (``None`` where the engine has none)."""
        receiving = self._runtime.receiving
        return getattr(receiving.engine, "transport", None) if receiving is not None else None

    @property
    def shared_transport(self) -> Any:
        """Sender: the buffer every worker reads (the local schemes' slot pool), or ``None``."""
        sending = self._runtime.sending
        return sending.engine.shared if sending is not None and sending.engine is not None else None

    @property
    def last_send(self) -> SendRecord | None:
        """Sender only: what the last send did (version, workers, bytes, seconds, per-worker ack times, failures)."""
        sending = self._senders_alone("last_send")
        return sending.metrics.last if sending is not None else None

    def stats(self) -> dict[str, Any]:
        """Sender only: a summary of every send so far: counts, bytes, send-time and ack-time medians and
        maxima, failures, dropped workers (with the cause), rejoins, staleness, and each worker's
        last acked version and lag."""
        with self._runtime.lock:  # a rejoin may be admitted from the listener's thread meanwhile
            sending = self._senders_alone("stats()")
            if sending is None:
                return SendMetrics().summary(version=self.version, acked={}, failed={})
            return sending.stats()
