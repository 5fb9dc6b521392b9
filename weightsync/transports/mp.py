"""``MPTransport``: the channel to one local worker process that keeps a private copy.

Sender side, it tells its worker which shared slot holds a new version (the
slot's descriptor goes along the first time) and collects the worker's acks.
Receiver side, it maps the slots it is given and yields pending updates; the
scheme copies them into the worker's own model and acks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..binding import BoundModel
from ..errors import ConnectionClosedError, ReceiverError, TransportError, WorkerDiedError
from .base import SenderBoundTransport, TransportBackend
from .channel import Channel
from .slots import SharedSlot, map_fd

if TYPE_CHECKING:
    from ..layout import FlatLayout
    from ..schemes.local import LocalScheme

__all__ = ["MPTransport", "Update"]


@dataclass
class Update:
    """A pending update on the receiver side: which version, in which slot."""

    version: int
    slot: int
    digest: str | None = None  # the sender's checksum of the slot, when it computes one


class MPTransport(SenderBoundTransport, TransportBackend):
    """Data plane to ONE worker of a local scheme (sender side) or from the sender (receiver side).

    Args:
        channel: the authenticated channel to the peer.
        worker_idx: the worker this transport serves.
        scheme: on the sender side, the scheme that owns the slots and versions.
    """

    #: Receivers of this transport keep the version they hold mapped in the slot (no private copy).
    pinning = False

    def __init__(self, channel: Channel, worker_idx: int, scheme: LocalScheme | None = None) -> None:
        self.channel = channel
        self.worker_idx = worker_idx
        self._scheme = scheme
        # Sender side.
        self.slots_sent: set[int] = set()
        self.acked: int | None = None
        self.sent: int | None = None
        self.dead: BaseException | None = None
        self.last_error: ReceiverError | None = None
        # Receiver side.
        self.slot_buffers: dict[int, torch.Tensor] = {}
        self.bad_slots: dict[int, str] = {}  # slots refused on arrival, with the reason
        self.closed_by_sender = False
        #: The model's tensors as views of one storage, once bound.
        self.bound = BoundModel()

    # ------------------------------------------------------------ sender side
    def notify(self, slot: SharedSlot, version: int) -> None:
        """Tell the worker that ``slot`` holds ``version``; ship the slot's descriptor on first use."""
        try:
            if slot.id not in self.slots_sent:
                self.channel.send_with_fds({"op": "slot", "slot": slot.id, "nbytes": slot.nbytes}, [slot.fd])
                self.slots_sent.add(slot.id)
            self.channel.send({"op": "update", "version": version, "slot": slot.id, "digest": slot.digest})
        except ConnectionClosedError as exc:
            raise WorkerDiedError(
                f"channel closed while sending ({exc.detail})", worker_idx=self.worker_idx, version=version
            ) from exc
        self.sent = version

    def handle_ack(self, msg: dict[str, Any], model_id: str | None) -> ReceiverError | None:
        """Record an ack; return the worker's error if it failed to apply."""
        if msg.get("op") != "ack":
            raise TransportError(f"unexpected message {msg.get('op')!r} from worker {self.worker_idx}")
        version = int(msg["version"])
        self.acked = version if self.acked is None else max(self.acked, version)
        err = msg.get("error")
        # The last failure stays known until a later success: if the worker then leaves, that is why.
        self.last_error = (
            ReceiverError(err["type"], err["message"], model_id=model_id, worker_idx=self.worker_idx, version=version)
            if err
            else None
        )
        return self.last_error

    def check_connection(self) -> bool:
        """``False`` once the peer is known dead or its channel closed."""
        if self.dead is not None or self.channel.closed:
            return False
        if self._scheme is not None and self.channel.poll(0):
            self._scheme.drain([self.worker_idx])
        return self.dead is None and not self.channel.closed

    # ---------------------------------------------------------- receiver side
    def poll(self, timeout: float = 0.0) -> bool:
        """``True`` when a message from the sender is waiting."""
        return self.channel.poll(timeout)

    def receive_weights(self, timeout: float | None = 0.0, **kwargs: Any) -> list[Update]:
        """Read every message the sender has queued (waiting up to ``timeout`` for the first).

        Maps newly announced slots and returns the pending updates, oldest
        first; an empty list when nothing arrived. Raises
        :class:`ConnectionClosedError` once the sender has said goodbye or died
        and nothing is left to apply.
        """
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        updates: list[Update] = []
        if self.closed_by_sender:
            raise ConnectionClosedError("the sender has shut down", worker_idx=self.worker_idx)
        try:
            msg = self.channel.recv(timeout or 0.0)
        except ConnectionClosedError:
            self.closed_by_sender = True
            raise ConnectionClosedError(
                "the sender closed the channel (shut down or died)", worker_idx=self.worker_idx
            ) from None
        while msg is not None:
            op = msg["op"]
            if op == "slot":
                (fd,) = self.channel.recv_fds(1, timeout=5.0)
                slot, nbytes = int(msg["slot"]), int(msg["nbytes"])
                try:
                    size = os.fstat(fd).st_size
                    if size < nbytes:  # mapping past the end of a segment would kill this process (SIGBUS)
                        self.bad_slots[slot] = f"slot {slot} holds {size} bytes, not the {nbytes} announced: truncated"
                    else:
                        self.slot_buffers[slot] = map_fd(fd, nbytes)
                        self._slot_mapped(slot, fd, nbytes)
                finally:
                    os.close(fd)
            elif op == "update":
                updates.append(Update(int(msg["version"]), int(msg["slot"]), msg.get("digest")))
            elif op == "bye":
                self.closed_by_sender = True
                break
            else:
                raise TransportError(f"unexpected message {op!r} from the sender", worker_idx=self.worker_idx)
            try:
                msg = self.channel.recv(0.0)
            except ConnectionClosedError:
                self.closed_by_sender = True
                break
        if not updates and self.closed_by_sender:
            raise ConnectionClosedError("the sender has shut down", worker_idx=self.worker_idx)
        return updates

    def _slot_mapped(self, slot: int, fd: int, nbytes: int) -> None:
        """A slot was just mapped into :attr:`slot_buffers` (``fd`` is open until this returns)."""

    def update_model(
        self, dst: dict[str, torch.Tensor], slot: int, layout: FlatLayout, held: bool
    ) -> dict[str, torch.Tensor] | None:
        """Copy ``slot`` into the model's tensors ``dst`` (checked against ``layout``; ``held``: what
        ``self.bound.holds(dst)`` says) in one copy, whatever the number of tensors, and return the views the
        tensors now are.

        At the first update, the model is bound to one private storage laid out like the slot (each tensor
        re-pointed at its view, with its values); so is a model whose tensors changed since (replaced, moved,
        re-pointed by the user). The tensors' memory then stays the same from update to update. ``None``,
        with nothing done, where the caller copies tensor by tensor instead: a model with a tensor off the
        CPU, or in shared memory at its first update (processes of the worker's own may read it).
        """
        buffer = self.slot_buffers.get(slot)
        if buffer is None or not self.bound.load(dst, [(0, buffer)], layout, held):
            return None
        return self.bound.views

    def release_model(self) -> None:
        """Before closing: move a model that reads a slot onto memory of its own (this transport: nothing to do)."""

    def send_ack(self, version: int, error: BaseException | None = None, held: int | None = None) -> None:
        """Tell the sender ``version`` was applied (or failed with ``error``); ``held`` is the version now in use."""
        msg: dict[str, Any] = {"op": "ack", "version": version, "held": held}
        if error is not None:
            msg["error"] = {"type": type(error).__name__, "message": str(error)}
        self.channel.send(msg)

    def close(self) -> None:
        self.channel.close()
        self.slot_buffers.clear()
        self.bad_slots.clear()
        self.bound.forget()
