"""``RayTransport``: weight updates to ONE Ray actor, as calls that run inside the actor.

The sender puts each version in Ray's object store once; for every targeted
actor it submits ``actor.__ray_call__(apply_in_actor, ...)``, which Ray runs
inside that actor between its other method calls (so a synchronous actor
never sees a half-applied update). The call's completion is the ack; its
exception is the actor's failure; ``RayActorError`` means the actor is dead.
"""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...errors import ConfigurationError, LifecycleError
from ..base import PeerTransport

if TYPE_CHECKING:
    from ...core.engine import Sink

__all__ = [
    "LayoutWanted",
    "RayActorTransport",
    "RayTransport",
    "apply_in_actor",
    "register_receiver",
    "unregister_receiver",
]

# The receivers living in this process (an actor's worker process), by model id: each takes
# ``(version, buffers, ranges, layout, checksum, changes)`` and returns the version it holds.
_RECEIVERS: dict[str, Any] = {}


class LayoutWanted(LifecycleError):
    """An update without the layout reached an actor that holds none: a new process behind the same handle (Ray
    restarted the actor, which joined again). The sender takes it for a worker that rejoined, and sends it the
    version whole, with the layout, in the same send."""


#: The models whose receiver in this process shut down (the actor lives on): their updates are answered so.
_ENDED: set[str] = set()


class ReceiverShutDown(LifecycleError):
    """An update reached an actor whose receiver of that model shut down: the sender names the worker gone (it was
    taken for a refusal, raised at every send, and never dropped under ``on_failure="drop"``)."""


def register_receiver(model_id: str, receiver: Any) -> None:
    """Make ``receiver`` (its ``push``) the receiver of ``model_id`` in this process (the actor's).

    Raises:
        ConfigurationError: another receiver of ``model_id`` is open here (the second replaced the first, whose
            model was then never written again while the sender's acks said it was).
    """
    if model_id in _RECEIVERS:
        gc.collect()  # (a scheme dropped unclosed is shut down by its finalizer, which a reference cycle defers)
    if model_id in _RECEIVERS:
        raise ConfigurationError(
            f"this actor already has a receiver of model {model_id!r}: shut it down first, or give each its own "
            "model_id",
            model_id=model_id,
        )
    _ENDED.discard(model_id)
    _RECEIVERS[model_id] = receiver


def unregister_receiver(model_id: str, receiver: Any) -> None:
    if _RECEIVERS.get(model_id) is receiver:
        del _RECEIVERS[model_id]
        _ENDED.add(model_id)


def apply_in_actor(actor: Any, model_id: str, version: int, payload: tuple, layout: dict | None) -> int:
    """Runs inside the actor: apply ``payload`` (the weights' buffers) as ``version``; return the version held.

    An actor class of your own that hosts a module for
    :class:`~weightsync.schemes.ray.RayModuleTransformScheme` calls this from
    its ``update_weights_tensordict`` / ``update_weights_state_dict`` methods.
    """
    receiver = _RECEIVERS.get(model_id)
    if receiver is None and model_id in _ENDED:
        raise ReceiverShutDown(f"this actor's receiver of model {model_id!r} shut down", model_id=model_id)
    if receiver is None:
        raise LifecycleError(
            f"this actor has no receiver for model {model_id!r}: call scheme.init_on_receiver(model_id="
            f"{model_id!r}, model=..., worker_idx=...) in the actor before the sender connects",
            model_id=model_id,
        )
    ranges, arrays, expected, *changes = payload  # (changes: the description of a body of changes)
    with warnings.catch_warnings():
        # The object store hands out read-only arrays; we only read from them.
        warnings.simplefilter("ignore", UserWarning)
        buffers = [torch.from_numpy(np.asarray(a)) for a in arrays]
    return receiver.push(version, buffers, ranges, layout, expected, changes[0] if changes else None)


class RayTransport(PeerTransport):
    """Data plane to ONE Ray actor of :class:`~weightsync.schemes.ray.RayWeightSyncScheme` (sender side).

    Args:
        actor: the actor's handle.
        worker_idx: the worker this actor is.
        model_id: the model the updates are for.
        extract_as: the scheme's strategy (``"tensordict"`` or ``"state_dict"``).
        sink: where the older API's calls go (the sender's pipeline).
    """

    def __init__(
        self,
        actor: Any,
        worker_idx: int,
        model_id: str | None = None,
        extract_as: str = "tensordict",
        sink: Sink | None = None,
    ) -> None:
        super().__init__(worker_idx, sink)
        self.actor = actor
        self.model_id = model_id
        self.extract_as = extract_as
        self.in_flight: dict[int, Any] = {}  # version -> ObjectRef of the call applying it (read: :meth:`refs`)
        #: What the actor runs for each update: :func:`apply_in_actor`, or an integration's call around it with the
        #: same arguments and return (:meth:`~weightsync.transports.ray.sender.RaySender.run_in_actor`).
        self.in_actor: Callable[..., int] = apply_in_actor
        #: ``latest_wins``: while a call is on its way, a whole version waits in :attr:`pending`, and a newer one
        #: replaces it (its object let go); it goes as soon as Ray says that call ended. An actor that is behind
        #: gets the newest next, not every version in turn.
        self.coalesce = False
        self.pending: tuple[int, Any, dict | None] | None = None
        # (the trainer's thread submits; Ray's thread that learns a call ended submits what was held back)
        self._lock = threading.RLock()
        #: The calls (their futures) whose end is not reported yet, where versions are held back. A call counts
        #: from one step (its append), and its end is reported once whoever sees it first (Ray's thread, or a look
        #: here: :meth:`_reap`): a Ctrl-C that cut its callback's registration short leaves no call counted for good.
        self._unended: list[Any] = []
        self._closed = False

    def submit(self, version: int, payload_ref: Any, layout: dict | None, *, whole: bool = True) -> None:
        """Ask the actor to apply ``version`` (queued after its earlier calls, in order); a whole version, while
        a call is on its way and :attr:`coalesce` says so, is held back until that call ended."""
        with self._lock:
            self._reap()
            if self.coalesce and whole and self._unended:
                self.pending = (version, payload_ref, layout if self.pending is None else self.pending[2] or layout)
                return
            self._send_pending()  # (one held back goes first: what comes after it is newer)
            self._call(version, payload_ref, layout)

    def refs(self) -> dict[int, Any]:
        """``{version: ObjectRef}`` of the calls on their way (a copy)."""
        with self._lock:
            return dict(self.in_flight)

    def holds_back(self) -> bool:
        """Whether a version may still go from here with no call on its way that the trainer can wait for: one
        held back, or a call read as ended whose end Ray's thread has not reported yet (it then sends the one
        held back)."""
        with self._lock:
            self._reap()
            return self.pending is not None or bool(self._unended)

    def forget(self, version: int) -> None:
        """The call for ``version`` was read."""
        with self._lock:
            self.in_flight.pop(version, None)

    def close(self) -> None:
        """No more calls: a version held back is let go."""
        with self._lock:
            self._closed, self.pending = True, None

    def _send_pending(self) -> None:
        held = self.pending
        if held is not None:
            # Let go once its call went out: a Ctrl-C in the call (from the trainer's :meth:`_reap`) leaves it to
            # go again, and an actor that got it skips it as a version it holds.
            self._call(*held)
            if self.pending is held:
                self.pending = None

    def _call(self, version: int, payload_ref: Any, layout: dict | None) -> None:
        ref = self._remote(version, payload_ref, layout)
        self.in_flight[version] = ref
        if self.coalesce:
            future = ref.future()
            self._unended.append(future)
            future.add_done_callback(self._ended)

    def _ended(self, call: Any) -> None:
        """(Ray's thread, or :meth:`_reap`) A call ended: the version held back goes now, unless the actor is gone.
        Reported once: a second report of the same call does nothing."""
        from ray.exceptions import RayActorError

        with self._lock:
            if not any(future is call for future in self._unended):
                return
            self._unended = [future for future in self._unended if future is not call]
            if isinstance(call.exception(), RayActorError) or self._closed:
                self.pending = None
            elif not self._unended:
                self._send_pending()

    def _reap(self) -> None:
        """Report the calls that ended whose end Ray's thread has not reported (yet, or ever: a Ctrl-C cut their
        callback's registration short); and send a version held back with no call left on its way (its sending
        was cut short)."""
        for future in [f for f in self._unended if f.done()]:
            self._ended(future)
        if self.pending is not None and not self._unended and not self._closed:
            self._send_pending()

    def _remote(self, version: int, payload_ref: Any, layout: dict | None) -> Any:
        return self.actor.__ray_call__.remote(self.in_actor, self.model_id, version, payload_ref, layout)


class RayActorTransport(RayTransport):
    """Data plane to the ONE actor hosting a module (:class:`~weightsync.schemes.ray.RayModuleTransformScheme`).

    Updates are calls to the actor's own ``update_weights_tensordict`` or
    ``update_weights_state_dict`` method (the scheme's strategy picks which),
    queued like any other call to it, so they run between its forward calls.
    """

    def __init__(self, actor: Any, worker_idx: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(actor, worker_idx, *args, **kwargs)
        name = f"update_weights_{self.extract_as}"
        try:
            self.method = getattr(actor, name)
        except AttributeError:
            raise ConfigurationError(
                f"actor {worker_idx} has no method {name}(model_id, version, payload, layout): the ray_actor "
                "transport calls it with each update (it returns apply_in_actor(self, model_id, version, payload, "
                "layout)); any other actor takes its updates over the ray transport (RayWeightSyncScheme)",
                worker_idx=worker_idx,
            ) from None

    def _remote(self, version: int, payload_ref: Any, layout: dict | None) -> Any:
        return self.method.remote(self.model_id, version, payload_ref, layout)
