"""TorchRL's collectors as clients of a scheme (SPEC section 8).

TorchRL's collectors take ``weight_sync_schemes={"policy": scheme}`` and drive
the scheme themselves. In the trainer: ``init_on_sender(model_id,
context=<collector>, ctx=<multiprocessing context>)``, ``connect()``, then
``send(weights, worker_ids)`` at each ``update_policy_weights_()``; the
scheme is pickled into each worker process. In a worker:
``init_on_receiver(model=<the policy, its weights on the meta device>,
model_id="policy", worker_idx=i)``, ``connect(worker_idx=i)``; then the
collector sets ``scheme.context`` to its inner collector, may set
``scheme.model`` to the copy of the policy it moved to its device, and never
calls ``receive()``: updates must be applied by the scheme itself. The
collectors read ``initialized_on_sender``, ``initialized_on_receiver``,
``synchronized_on_sender``, ``synchronized_on_receiver`` and check
``isinstance(scheme, torchrl.weight_update.WeightSyncScheme)``.

What a weightsync scheme does for them (:class:`ClientMixin`): it answers
those properties; it registers weightsync's scheme class as a virtual
subclass of TorchRL's, once TorchRL is imported; it derives the number of
workers from the collector; and a scheme initialized by a collector tells its
workers (in the pickled handoff) to apply updates themselves, in a background
thread that never runs inside a forward pass of the policy (forward hooks
hold the scheme's ``weights_lock``). A worker's policy arrives with its
weights on the meta device: the first update gives it real memory. And
``collector.shutdown()`` shuts the scheme down with it.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch

from ..errors import ConfigurationError, WeightSyncError
from ..model_path import resolve_model
from ..tensors.copies import in_shared_memory, write_into
from ..tensors.strategy import check_spec, flatten_weights, weights_spec
from .engine import Outgoing, SenderEngine
from .states import RECEIVER_CONNECTED, RECEIVING, SENDER_CONNECTED, SENDING

__all__ = [
    "ClientMixin",
    "InProcessEngine",
    "check_receiver_context",
    "client_of",
    "collector_model",
    "follow_collector",
    "hold_policy",
    "in_process_engine",
    "register_with_torchrl",
]

_REGISTERED = threading.Lock()


def is_torchrl_collector(context: Any) -> bool:
    """Whether ``context`` is one of TorchRL's collectors (checked by module: TorchRL need not be imported)."""
    return any(cls.__module__.startswith("torchrl.collectors") for cls in type(context).__mro__)


def client_of(context: Any) -> dict[str, Any] | None:
    """What a scheme initialized on the sender with ``context`` must know, if ``context`` is a TorchRL collector:
    a collector with workers has its receivers apply updates themselves (its workers never call ``receive()``),
    and gives them indices that start at ``index_base`` (its distributed collectors count ranks from 1); a
    single-process collector (``Collector``) runs the policy in the trainer's process: ``in_process``."""
    if context is None or not is_torchrl_collector(context):
        return None
    if not hasattr(context, "num_workers"):
        return {"in_process": True}
    ranked = type(context).__name__ in ("DistributedCollector", "DistributedSyncCollector")
    return {"applies_itself": True, "index_base": 1 if ranked else 0}


def collector_model(collector: Any, model_id: str) -> Any:
    """The model ``model_id`` of a TorchRL collector: its policy (``get_model``), or, for a collector given only a
    ``policy_factory``, a policy built with it, as TorchRL's own schemes do (send it weights explicitly then:
    ``update_policy_weights_(weights)``)."""
    try:
        return resolve_model(collector, model_id)
    except (ValueError, ConfigurationError):
        factories = getattr(collector, "policy_factory", None)
        factories = factories if isinstance(factories, (list, tuple)) else [factories]
        if model_id != "policy" or not factories or not callable(factories[0]):
            raise
        return factories[0]()


def check_receiver_context(scheme: Any, context: Any) -> None:
    """A receiver a TorchRL collector initializes must come from a scheme initialized on the sender first (pickled
    after ``init_on_sender``). ``RPCCollector`` hands its workers the scheme before that, and runs the one RPC
    agent a process may have: refused, naming what works instead.

    Raises:
        ConfigurationError: ``scheme`` knows no sender and ``context`` is a TorchRL collector.
    """
    if scheme._handoff is None and is_torchrl_collector(context):
        raise ConfigurationError(
            f"{type(context).__name__} handed this worker the scheme before initializing it on the sender, so the "
            f"worker cannot know where the sender is ({type(scheme).__name__} is initialized on the sender first, "
            "then pickled to its workers). RPCCollector does this, and runs the one RPC agent a process may have: "
            "use it with TorchRL's own RPCWeightSyncScheme, or use DistributedCollector with "
            "weightsync's DistributedWeightSyncScheme, or RayCollector with RayWeightSyncScheme",
            model_id=scheme.model_id,
        )


def register_with_torchrl(cls: type) -> None:
    """Make ``cls`` pass TorchRL's ``isinstance(scheme, WeightSyncScheme)`` check (a virtual subclass of its ABC),
    if TorchRL is imported in this process; nothing is imported for it."""
    module = sys.modules.get("torchrl.weight_update")
    base = getattr(module, "WeightSyncScheme", None)
    if base is None or not hasattr(base, "register"):
        return
    with _REGISTERED:
        if not issubclass(cls, base):
            base.register(cls)


class ClientMixin:
    """The part of :class:`~weightsync.core.scheme.WeightSyncScheme` TorchRL's collectors read and write."""

    _state: str
    _context: Any
    _model: Any
    _receiving: Any
    _strategy: Any
    weights_lock: Any

    @property
    def initialized_on_sender(self) -> bool:
        """``init_on_sender`` ran (and the scheme is not shut down)."""
        return self._state in SENDING

    @property
    def initialized_on_receiver(self) -> bool:
        """``init_on_receiver`` ran (and the scheme is not shut down)."""
        return self._state in RECEIVING

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
        """The strategy's format, ``"tensordict"`` or ``"state_dict"`` (TorchRL's name for it)."""
        return self._strategy.extract_as

    @property
    def _applies_itself(self) -> bool:
        """A collector drives this receiver: it applies updates itself, and its model's sharing is the collector's."""
        client = getattr(self, "_client", None)
        return bool(client and client.get("applies_itself"))

    def _kept_shared(self, flat: dict[str, torch.Tensor]) -> bool:
        """Whether the model's tensors ``flat`` are in shared memory that must stay theirs: processes of the worker's
        own may read it. Not where a TorchRL collector put them there (it pickled the trainer's policy into the
        worker): that sharing would let the trainer's steps reach the worker, and is undone at the first update."""
        return in_shared_memory(flat) and not self._applies_itself

    @property
    def context(self) -> Any:
        """The object the model was found in (TorchRL: the collector; in a worker, its inner collector)."""
        return self._context

    @context.setter
    def context(self, context: Any) -> None:
        self._context = context

    @property
    def model(self) -> Any:
        """The registered model (sender: or its weights). A receiver's may be replaced: later updates go to the new
        one (a TorchRL worker moves its policy to its device after ``connect``)."""
        return self._model

    @model.setter
    def model(self, model: Any) -> None:
        with self.weights_lock:
            self._model = model
            if self._receiving is not None:
                self._receiving.set_model(model)
            if getattr(self, "_hooks", None):  # the new model's forward passes take turns with updates too
                hold_policy(self)


def forward_lock_hooks(model: Any, lock: Any) -> list[Any]:
    """Hooks on ``model`` (an ``nn.Module``) that hold ``lock`` for the whole of each forward pass, so an update
    applied under it never lands inside one; the handles, to remove them."""
    if not isinstance(model, torch.nn.Module):
        return []

    def hold(module: Any, args: Any) -> None:  # (a pre-hook that returns something replaces the inputs)
        lock.acquire()

    def let_go(module: Any, args: Any, out: Any) -> None:
        lock.release()

    return [model.register_forward_pre_hook(hold), model.register_forward_hook(let_go, always_call=True)]


def hold_policy(scheme: Any) -> None:
    """A receiver a collector drives, just connected: its policy's forward passes and its updates take turns, and
    each update it applies bumps the inner collector's policy version (as TorchRL's own schemes do)."""
    for hook in scheme._hooks:
        hook.remove()
    scheme._hooks = forward_lock_hooks(scheme._model, scheme.weights_lock)
    scheme._receiving.on_applied = lambda: _bump_version(scheme._context)


def _bump_version(context: Any) -> None:
    bump = getattr(context, "increment_version", None)
    if callable(bump):
        bump()


def follow_collector(scheme: Any, context: Any) -> None:
    """A scheme just initialized with ``context``: if that is a TorchRL collector, pass TorchRL's type check, and
    (sender) shut down with the collector, which never shuts its schemes down itself."""
    if not is_torchrl_collector(context):
        return
    register_with_torchrl(_base_class())
    if scheme.is_sender:
        scheme_ref = weakref.ref(scheme)
        original = context.shutdown

        def shutdown(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                follower = scheme_ref()
                if follower is not None:
                    follower.shutdown()

        context.shutdown = shutdown


def _base_class() -> type:
    from .scheme import WeightSyncScheme

    return WeightSyncScheme


def in_process_engine(scheme: Any, sink: Any, layout: Any) -> Any:
    """The engine of a scheme a single-process collector drives (TorchRL's ``Collector``: its policy is in the
    trainer's process), else ``None``."""
    if not (scheme._client and scheme._client.get("in_process")):
        return None
    return InProcessEngine(sink, layout, scheme)


class InProcessEngine(SenderEngine):
    """The engine of a scheme a single-process TorchRL ``Collector`` drives: its one worker is the collector's
    policy, in this process. A send writes the weights into it (nothing, when they are its own tensors: the
    collector runs the trainer's module unless it moved it to another device) and acks at once."""

    def __init__(self, sink: Any, layout: Any, scheme: Any) -> None:
        super().__init__(sink, layout, 1)
        self.scheme = scheme

    def rendezvous(self, deadline: float, timeout: float) -> dict[int, WeightSyncError]:
        return {}

    def rendezvous_complete(self) -> bool:
        return True

    def stage(self, out: Outgoing, deadline: float) -> None:
        scheme = self.scheme
        policy = resolve_model(scheme.context, scheme.model_id)
        dst = flatten_weights(policy, scheme.strategy.extract_as)
        if (
            all(dst[k].data_ptr() == t.data_ptr() for k, t in out.flat.items() if k in dst)
            and dst.keys() == out.flat.keys()
        ):
            return  # the collector runs these very tensors
        check_spec(self.layout.spec, weights_spec(dst), model_id=scheme.model_id, worker_idx=0, version=out.version)
        with scheme.weights_lock:
            write_into(dst, out.flat)

    def submit(self, out: Outgoing, staged: Any) -> None:
        for w in out.workers:
            self.sink.acked(w, out.version)

    def poll(self, workers: list[int]) -> None:
        return None

    def wait(self, workers: list[int], deadline: float) -> None:
        return None

    def close(self, timeout: float) -> None:
        return None
