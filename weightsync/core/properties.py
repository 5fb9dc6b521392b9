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
from ..tensors.strategy import flatten_weights
from .states import RECEIVER_CONNECTED, RECEIVING, SENDER_CONNECTED, SENDING

if TYPE_CHECKING:
    from ..tensors.layout import FlatLayout
    from ..tensors.strategy import WeightStrategy
    from .drivers import Drive, ModelHold
    from .receiver import Receiver
    from .sender import Sender
    from .settings import TransportSettings

__all__ = ["SchemeProperties"]


def _read(attr: str, doc: str) -> property:
    return property(lambda self: getattr(self, attr), doc=doc)


class SchemeProperties:
    """What :class:`~weightsync.core.scheme.WeightSyncScheme` tells about itself; only ``context`` and ``model``
    may be set."""

    _state: str
    _strategy: WeightStrategy
    _sending: Sender | None
    _receiving: Receiver | None
    _model_id: str | None
    _worker_idx: int | None
    _lock: Any
    _context: Any
    _model: Any
    _drive: Drive | None
    _hold: ModelHold
    settings: TransportSettings | None
    weights_lock: Any

    state = _read("_state", "Where the scheme is in its lifecycle (``'new'``, ``'connected sender'``, ...).")
    strategy = _read("_strategy", "How weights are extracted from the model and put back.")
    model_id = _read("_model_id", "The model's name (or path inside the context).")
    worker_idx = _read("_worker_idx", "Receiver: which worker this is.")
    num_workers = _read("_num_workers", "How many workers the sender serves.")

    @property
    def model_device(self) -> torch.device | None:
        """The device every weight of the registered model is on (``None``: no model yet, or several devices)."""
        model = getattr(self, "_model", None)
        return None if model is None else one_device(list(self._strategy.flat(model).values()))

    @property
    def _model_gpu(self) -> torch.device | None:
        """The GPU every weight of the registered model is on, if one."""
        device = self.model_device
        return device if device is not None and device.type == "cuda" else None

    @property
    def initialized_on_sender(self) -> bool:
        """``init_on_sender`` ran (and the scheme is not shut down)."""
        return self._state in SENDING

    @property
    def initialized_on_receiver(self) -> bool:
        """``init_on_receiver`` ran (and the scheme is not shut down)."""
        return self._state in RECEIVING

    is_sender = initialized_on_sender
    is_receiver = initialized_on_receiver

    @property
    def transport_class(self) -> Any:
        """The class of this scheme's transport to one worker, as the older API builds it (``create_transport``)."""
        return self.settings.transport_class() if self.settings is not None else None

    @property
    def synchronized_on_sender(self) -> bool:
        """The sender's ``connect()`` ran: every worker joined and holds version 0."""
        return self._state == SENDER_CONNECTED

    @property
    def synchronized_on_receiver(self) -> bool:
        """The receiver's ``connect()`` ran: it holds the sender's version 0."""
        return self._state == RECEIVER_CONNECTED

    @property
    def strategy_str(self) -> str:
        """The strategy's format, ``"tensordict"`` or ``"state_dict"``."""
        return self._strategy.extract_as

    @property
    def context(self) -> Any:
        """The object the model was found in (a driving program may set it: in a worker, to its own part there)."""
        return self._context

    @context.setter
    def context(self, context: Any) -> None:
        self._context = context

    @property
    def model(self) -> Any:
        """The registered model (sender: or its weights). A receiver's may be replaced: later updates go to the new
        one (a driving program may move its copy of the model to its device after ``connect``)."""
        return self._model

    @model.setter
    def model(self, model: Any) -> None:
        with self.weights_lock:
            self._model = model
            if self._receiving is not None:
                self._receiving.set_model(model)
            if self._hold.holding:  # the new model's forward passes take turns with updates too
                self._hold.hold(model)

    @property
    def _applies_itself(self) -> bool:
        """A program drives this receiver: it applies updates itself, and its model's sharing is the program's."""
        return self._drive is not None and self._drive.applies_itself

    def _kept_shared(self, flat: dict[str, torch.Tensor]) -> bool:
        """Whether the model's tensors ``flat`` are in shared memory that must stay theirs: processes of the worker's
        own may read it. Not where a driving program put them there (it pickled the trainer's model into the
        worker): that sharing would let the trainer's steps reach the worker, and is undone at the first update."""
        return in_shared_memory(flat) and not self._applies_itself

    def _require(self, *states: str, action: str) -> None:
        if self._state not in states:
            raise LifecycleError(
                f"cannot {action}: scheme is {self._state}; {action} needs it {' or '.join(states)}",
                model_id=self._model_id,
                worker_idx=self._worker_idx,
            )

    @property
    def version(self) -> int | None:
        """Sender: the last version published. Receiver: the version it holds. ``None`` before any."""
        if self._sending is not None:
            return self._sending.version
        return self._receiving.version if self._receiving is not None else None

    @property
    def layout(self) -> FlatLayout | None:
        """Where each tensor sits in the bytes of a version (``None`` before it is known)."""
        if self._sending is not None:
            return self._sending.layout
        return self._receiving.engine.layout if self._receiving is not None else None

    @property
    def acked_versions(self) -> dict[int, int | None]:
        """Sender only: the last version each worker acked (``None`` if none yet)."""
        peers = self._sending.ledger.peers if self._sending is not None else {}
        return {w: p.acked for w, p in sorted(peers.items())}

    @property
    def failed_workers(self) -> dict[int, WeightSyncError]:
        """Sender only: workers found dead, with the error that revealed it."""
        return dict(self._sending.ledger.dead) if self._sending is not None else {}

    @property
    def weights(self) -> Any:
        """The weights of the registered model, in the strategy's format (no copy)."""
        model = getattr(self, "_model", None)
        return None if model is None else self._strategy.extract_weights(model)

    def prepare_weights(
        self, weights: Any, model_id: str | None = None, strategy: WeightStrategy | None = None, context: Any = None
    ) -> Any:
        """Resolve ``weights`` to the strategy's format (no copy).

        ``None`` reads the model registered for ``model_id`` (or found in
        ``context``); a module, TensorDict or dict is converted.

        Raises:
            InvalidWeightsError: nothing to send, or non-tensor values.
        """
        strategy = strategy or self._strategy
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
        strategy = strategy or self._strategy
        context = context if context is not None else self._context
        if weights is None and self._model is not None and (model_id or self._model_id) == self._model_id:
            weights = self._model
        source = resolve_weights(weights, context, model_id or self._model_id)
        return strategy.flat(source) if detach else flatten_weights(source, strategy.extract_as)

    @property
    def sender_transports(self) -> dict[int, Any]:
        """Sender: the transport to each worker."""
        engine = self._sending.engine if self._sending is not None else None
        return dict(engine.transports) if engine is not None else {}

    @property
    def receiver_transport(self) -> Any:
        """Receiver: its transport from the sender (``None`` where the engine has none)."""
        return getattr(self._receiving.engine, "transport", None) if self._receiving is not None else None

    @property
    def shared_transport(self) -> Any:
        """Sender: the buffer every worker reads (the local schemes' slot pool), or ``None``."""
        engine = self._sending.engine if self._sending is not None else None
        return getattr(engine, "shared", None)

    @property
    def last_send(self) -> SendRecord | None:
        """Sender: what the last send did (version, workers, bytes, seconds, per-worker ack times, failures)."""
        return self._sending.metrics.last if self._sending is not None else None

    def stats(self) -> dict[str, Any]:
        """Sender: a summary of every send so far: counts, bytes, send-time and ack-time medians and
        maxima, failures, dropped workers (with the cause), rejoins, staleness, and each worker's
        last acked version and lag."""
        with self._lock:  # a rejoin may be admitted from the listener's thread meanwhile
            if self._sending is None:
                return SendMetrics().summary(version=self.version, acked={}, failed={})
            return self._sending.stats()
