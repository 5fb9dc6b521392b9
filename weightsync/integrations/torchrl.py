"""TorchRL's collectors drive weightsync schemes (SPEC section 8).

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

What :class:`TorchRLDriver` tells the core: a collector is recognized by the module of its class (TorchRL is
never imported for it); its policy is the model, built with its ``policy_factory`` if it has no policy; its
workers apply updates themselves (the scheme applies them in a background thread whose updates never land
inside a forward pass of the policy, and each bumps the inner collector's policy version), and the
distributed collectors count them from 1; a single-process ``Collector`` runs the policy in the trainer's
process (:class:`InProcessEngine`). Once initialized, weightsync's scheme class passes TorchRL's type check,
and ``collector.shutdown()`` shuts the sender down with it. A worker's policy arrives with its weights on the
meta device: the first update gives it real memory.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from typing import Any

from ..core.drivers import Drive, Driver
from ..core.engine import Outgoing, SenderEngine, Sink
from ..core.scheme import WeightSyncScheme
from ..errors import ConfigurationError, WeightSyncError
from ..model_path import resolve_model
from ..tensors.copies import write_into
from ..tensors.layout import FlatLayout
from ..tensors.strategy import check_spec, flatten_weights, weights_spec

__all__ = [
    "InProcessEngine",
    "TorchRLDriver",
    "client_of",
    "collector_model",
    "is_torchrl_collector",
    "register_with_torchrl",
]

_REGISTERED = threading.Lock()


def is_torchrl_collector(context: Any) -> bool:
    """Whether ``context`` is one of TorchRL's collectors (checked by module: TorchRL need not be imported)."""
    return any(cls.__module__.startswith("torchrl.collectors") for cls in type(context).__mro__)


def client_of(context: Any) -> dict[str, Any] | None:
    """How a TorchRL collector ``context`` drives a scheme it initializes on the sender (``None``: not a
    collector): a collector with workers has its receivers apply updates themselves (its workers never call
    ``receive()``), and gives them indices that start at ``index_base`` (its distributed collectors count ranks
    from 1); a single-process collector (``Collector``) runs the policy in the trainer's process: ``in_process``."""
    if context is None or not is_torchrl_collector(context):
        return None
    if not hasattr(context, "num_workers"):
        return {"in_process": True}
    ranked = type(context).__name__ in ("DistributedCollector", "DistributedSyncCollector")
    return {"applies_itself": True, "index_base": 1 if ranked else 0}


def collector_model(collector: Any, model_id: str) -> Any:
    """The model ``model_id`` of a TorchRL collector: its policy (``get_model``), or, for a collector given only a
    ``policy_factory``, a policy built with it, as TorchRL's own schemes do (send it weights explicitly then:
    ``update_policy_weights_(weights)``).

    Raises:
        ConfigurationError: the collector holds no such model and has no policy factory for it.
    """
    try:
        return resolve_model(collector, model_id)
    except (ValueError, ConfigurationError):
        factories = getattr(collector, "policy_factory", None)
        factories = factories if isinstance(factories, (list, tuple)) else [factories]
        if model_id != "policy" or not factories or not callable(factories[0]):
            raise
        return factories[0]()


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


class TorchRLDriver(Driver, name="torchrl"):
    """TorchRL's collectors, as the core sees them (see the module's docstring)."""

    sender_extras = ("ctx",)  # the collectors' multiprocessing context: weightsync's channels are its own
    holds_its_schemes = True

    def drives(self, context: Any) -> bool:
        return is_torchrl_collector(context)

    def terms(self, context: Any) -> Drive:
        client = client_of(context) or {}
        return Drive(self.name, bool(client.get("applies_itself")), client.get("index_base", 0))

    def extras(self, context: Any, given: dict[str, Any]) -> None:
        """``ctx``: the collector starts its workers with it. Refused where it forks them: a forked worker would
        refuse the scheme (it holds the trainer's copy, not one pickled for it) and exit, and the trainer would
        wait for it until ``connect_timeout``, without its reason."""
        method = getattr(given.get("ctx"), "get_start_method", None)
        if callable(method) and method() == "fork":
            raise ConfigurationError(
                f"{type(context).__name__} starts its workers with multiprocessing's 'fork': a weightsync scheme "
                "reaches each worker pickled, which fork does not do. Start them with 'spawn' or 'forkserver' "
                "(multiprocessing.set_start_method('spawn') before the collector is made)"
            )

    def model(self, context: Any, model_id: str) -> Any:
        return collector_model(context, model_id)

    def num_workers(self, context: Any) -> int | None:
        # A single-process collector has no num_workers: its one worker is its own policy.
        return getattr(context, "num_workers", 1)

    def sender_engine(self, scheme: Any, sink: Sink, layout: FlatLayout) -> SenderEngine | None:
        client = client_of(scheme.context) or {}
        return InProcessEngine(sink, layout, scheme) if client.get("in_process") else None

    def follow(self, scheme: Any, context: Any) -> None:
        """Pass TorchRL's type check; a sender shuts down with its collector, which never shuts its schemes down
        itself."""
        register_with_torchrl(WeightSyncScheme)
        if scheme.is_sender and context is not None:
            _shut_down_with(context, scheme)

    def check_receiver(self, scheme: Any, context: Any, *, knows_sender: bool) -> None:
        """A receiver a collector initializes must come from a scheme initialized on the sender first (pickled
        after ``init_on_sender``). ``RPCCollector`` hands its workers the scheme before that, and runs the one RPC
        agent a process may have: refused, naming what works instead.

        Raises:
            ConfigurationError: ``scheme`` knows no sender and ``context`` is a collector.
        """
        if knows_sender or not is_torchrl_collector(context):
            return
        raise ConfigurationError(
            f"{type(context).__name__} handed this worker the scheme before initializing it on the sender, so the "
            f"worker cannot know where the sender is ({type(scheme).__name__} is initialized on the sender first, "
            "then pickled to its workers). RPCCollector does this, and runs the one RPC agent a process may have: "
            "use it with TorchRL's own RPCWeightSyncScheme, or use DistributedCollector with "
            "weightsync's DistributedWeightSyncScheme, or RayCollector with RayWeightSyncScheme",
            model_id=scheme.model_id,
        )

    def last_words(self, context: Any, workers: list[int]) -> list[str]:
        """A collector's worker that failed at its start sends its error on its pipe and exits (code 0); the
        collector reads it only once the scheme connected, which it never does then."""
        pipes = getattr(context, "pipes", None)
        said = []
        for w in workers:
            try:
                pipe = pipes[w] if isinstance(pipes, list) and w < len(pipes) else None
                message = pipe.recv() if pipe is not None and pipe.poll(0) else None
            except Exception:  # noqa: BLE001 - (closed, nothing whole on it, or not a message): the death is named as is
                continue
            if isinstance(message, dict) and message.get("error"):
                error = f"{message.get('exception_type')}: {message.get('exception_msg')}"
                said.append(f"worker {w} said: {error[:2000]}")
        return said

    def applied(self, scheme: Any) -> None:
        context = scheme.context
        if hasattr(context, "num_workers") and scheme.applied_on_arrival:
            # A collector with workers of its own, in the actor of a RayCollector (each update is a call into the
            # actor, which runs one call at a time: never beside the collector's): the update goes on to its
            # workers before it is acked, as TorchRL's own schemes pass it on.
            context.update_policy_weights_(collector_model(context, scheme.model_id), model_id=scheme.model_id)
            return
        # The inner collector counts the policy's versions, as with TorchRL's own schemes.
        bump = getattr(context, "increment_version", None)
        if callable(bump):
            bump()


#: Where a collector keeps (weakly) the schemes its ``shutdown()`` shuts down after it.
_FOLLOWERS = "_weightsync_followers"


def _shut_down_with(collector: Any, scheme: Any) -> None:
    """``collector.shutdown()`` shuts ``scheme`` down after it, and neither keeps the other alive: the collector's
    class's ``shutdown`` is wrapped (once), so nothing holds the collector but its owners (a wrapper on the instance
    held its bound ``shutdown``: its ``__del__``, which ends its workers, ran only at a garbage collection, and its
    process hung at exit joining them; one holding it weakly found it gone in a collection, which clears weak
    references before it finalizes)."""
    vars(collector).setdefault(_FOLLOWERS, []).append(weakref.ref(scheme))
    cls = type(collector)
    if getattr(cls.shutdown, _FOLLOWERS, False):
        return
    original = cls.shutdown

    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            for follower in [ref() for ref in vars(self).get(_FOLLOWERS, ())]:
                if follower is not None:
                    follower.shutdown()

    functools.update_wrapper(shutdown, original)
    setattr(shutdown, _FOLLOWERS, True)
    cls.shutdown = shutdown


class InProcessEngine(SenderEngine):
    """The engine of a scheme a single-process TorchRL ``Collector`` drives: its one worker is the collector's
    policy, in this process. A send writes the weights into it (nothing, when they are its own tensors: the
    collector runs the trainer's module unless it moved it to another device) and acks at once."""

    def __init__(self, sink: Sink, layout: FlatLayout, scheme: Any) -> None:
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
