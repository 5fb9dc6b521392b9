"""``RPCTransport``: weight updates to ONE ``torch.distributed.rpc`` worker, as RPCs the worker answers once
applied.

An update is one RPC per worker carrying the flat weights (one tensor,
whatever the model's); the worker keeps it until its loop calls
``receive()``, applies it, and only then answers: the answer is the ack.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed.rpc as rpc

from ..base import PeerTransport
from .mailbox import close_mailbox, deliver, last_answer
from .session import default_worker_name

if TYPE_CHECKING:
    from ...core.engine import Sink

__all__ = ["RPCTransport"]


class RPCTransport(PeerTransport):
    """Data plane to ONE RPC worker of :class:`~weightsync.schemes.rpc.RPCWeightSyncScheme` (sender side).

    Args:
        worker_idx: the worker this transport reaches.
        worker_name: its RPC name (default ``weightsync-worker-<worker_idx>``).
        model_id: the model the updates are for (the worker's mailbox).
        sink: where the older API's calls go (the sender's pipeline).
        sender: the id the calls carry (the sender's), whose calls alone the worker's receiver takes.
    """

    def __init__(
        self,
        worker_idx: int = 0,
        worker_name: str | None = None,
        model_id: str | None = None,
        sink: Sink | None = None,
        sender: str | None = None,
    ) -> None:
        super().__init__(worker_idx, sink)
        self.worker_name = worker_name or default_worker_name(worker_idx)
        self.model_id = model_id
        self.sender = sender
        self.in_flight: dict[int, torch.futures.Future] = {}  # version -> the RPC's future

    def submit(
        self,
        version: int,
        buffer: torch.Tensor,
        layout: dict | None,
        timeout: float,
        digest: str | None = None,
        delta: dict | None = None,
    ) -> torch.futures.Future:
        """Send ``version`` to the worker (``delta``: ``buffer`` is the body of the changes it describes); the
        returned future completes with its answer (the ack)."""
        future = rpc.rpc_async(
            self.worker_name,
            deliver,
            args=(self.model_id, version, buffer, layout, digest, delta, self.sender),
            timeout=timeout,
        )
        self.in_flight[version] = future
        return future

    def ask_last_answer(self, timeout: float) -> torch.futures.Future:
        """Ask the worker for the newest call it answered (:func:`~.mailbox.last_answer`), at most ``timeout``: a
        small call, for a version whose own call gave up waiting."""
        return rpc.rpc_async(self.worker_name, last_answer, args=(self.model_id, self.sender), timeout=timeout)

    def close(self, timeout: float, whole: bool = True) -> bool:
        """Tell the worker the sender is gone (best effort, bounded; ``timeout`` 0: not at all), and whether the
        world leaves whole (``whole``: every worker alive, which then leave by the world's barrier). Returns whether
        the worker heard it."""
        heard = False
        if timeout > 0:
            with contextlib.suppress(RuntimeError):
                said = (self.model_id, whole, self.sender)
                heard = bool(rpc.rpc_async(self.worker_name, close_mailbox, args=said, timeout=timeout).wait())
        self.in_flight.clear()
        return heard
