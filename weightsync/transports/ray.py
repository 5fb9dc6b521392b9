"""``RayTransport``: weight updates to ONE Ray actor, as calls that run inside the actor.

The sender puts each version in Ray's object store once; for every targeted
actor it submits ``actor.__ray_call__(apply_in_actor, ...)``, which Ray runs
inside that actor between its other method calls (so a synchronous actor
never sees a half-applied update). The call's completion is the ack; its
exception is the actor's failure; ``RayActorError`` means the actor is dead.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import LifecycleError
from .base import SenderBoundTransport

if TYPE_CHECKING:
    from ..schemes.ray import RayWeightSyncScheme

__all__ = ["RayActorTransport", "RayTransport", "apply_in_actor", "register_receiver", "unregister_receiver"]

# The receivers living in this process (an actor's worker process), by model id.
_RECEIVERS: dict[str, RayWeightSyncScheme] = {}


def register_receiver(model_id: str, scheme: RayWeightSyncScheme) -> None:
    """Make ``scheme`` the receiver of ``model_id`` in this process (the actor's)."""
    _RECEIVERS[model_id] = scheme


def unregister_receiver(model_id: str, scheme: RayWeightSyncScheme) -> None:
    if _RECEIVERS.get(model_id) is scheme:
        del _RECEIVERS[model_id]


def apply_in_actor(actor: Any, model_id: str, version: int, payload: tuple, layout: dict | None) -> int:
    """Runs inside the actor: apply ``payload`` (the weights' buffers) as ``version``; return the version held.

    An actor class of your own that hosts a module for
    :class:`~weightsync.schemes.ray.RayModuleTransformScheme` calls this from
    its ``update_weights_tensordict`` / ``update_weights_state_dict`` methods.
    """
    scheme = _RECEIVERS.get(model_id)
    if scheme is None:
        raise LifecycleError(
            f"this actor has no receiver for model {model_id!r}: call scheme.init_on_receiver(model_id="
            f"{model_id!r}, model=..., worker_idx=...) in the actor before the sender connects",
            model_id=model_id,
        )
    ranges, arrays, expected = payload
    with warnings.catch_warnings():
        # The object store hands out read-only arrays; we only read from them.
        warnings.simplefilter("ignore", UserWarning)
        buffers = [torch.from_numpy(np.asarray(a)) for a in arrays]
    return scheme._apply_payload(version, buffers, ranges, layout, expected)


class RayTransport(SenderBoundTransport):
    """Data plane to ONE Ray actor of :class:`~weightsync.schemes.ray.RayWeightSyncScheme` (sender side).

    Args:
        actor: the actor's handle.
        worker_idx: the worker this actor is.
        scheme: the sender scheme that owns versions and payloads.
    """

    def __init__(self, actor: Any, worker_idx: int, scheme: RayWeightSyncScheme | None = None) -> None:
        self.actor = actor
        self.worker_idx = worker_idx
        self._scheme = scheme
        self.acked: int | None = None
        self.sent: int | None = None
        self.dead: BaseException | None = None
        self.in_flight: dict[int, Any] = {}  # version -> ObjectRef of the call applying it

    def submit(self, version: int, payload_ref: Any, layout: dict | None) -> None:
        """Ask the actor to apply ``version`` (queued after its earlier calls, in order)."""
        model_id = self._sender().model_id
        self.in_flight[version] = self.actor.__ray_call__.remote(apply_in_actor, model_id, version, payload_ref, layout)
        self.sent = version

    def receive_weights(self, timeout: float | None = None, **kwargs: Any) -> Any:
        raise LifecycleError("Ray actors receive updates as calls from the sender; use scheme.receive() in the actor")

    def send_ack(self, version: int, error: BaseException | None = None, held: int | None = None) -> None:
        raise LifecycleError("a Ray actor acks by completing the sender's call; there is nothing to send")

    def check_connection(self) -> bool:
        return self.dead is None


class RayActorTransport(RayTransport):
    """Data plane to the ONE actor hosting a module (:class:`~weightsync.schemes.ray.RayModuleTransformScheme`).

    Updates are calls to the actor's own ``update_weights_tensordict`` or
    ``update_weights_state_dict`` method (the scheme's strategy picks which),
    queued like any other call to it, so they run between its forward calls.
    """

    def submit(self, version: int, payload_ref: Any, layout: dict | None) -> None:
        scheme = self._sender()
        method = getattr(self.actor, f"update_weights_{scheme.strategy.extract_as}")
        self.in_flight[version] = method.remote(scheme.model_id, version, payload_ref, layout)
        self.sent = version
