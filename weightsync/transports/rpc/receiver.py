"""A worker's side of the RPC engine: join the sender's RPC world, take updates from the model's mailbox."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from ...core.engine import Delivery, ReceiverEngine
from ...core.timing import remaining
from ...errors import ConfigurationError, ConnectionClosedError
from ...tensors.delta import Delta, chunks_of
from ...tensors.layout import FlatLayout
from ..store import SILENT_TIMEOUTS
from ..storeclient import hung_up_at
from .mailbox import Arrival, drop_mailbox, open_mailbox
from .session import (
    Session,
    default_worker_name,
    forget_ended,
    join_worker_session,
    leave_session,
    sender_gone,
    sender_said,
    start_agent,
)

__all__ = ["RPCReceiver"]

#: A worker that got no update checks, at most this often (seconds), that its sender is still there: RPC
#: tells a process about a dead peer only when a call to it is pending.
SENDER_PROBE_EVERY = 0.5
#: The longest error message a worker answers the sender with.
MAX_ERROR_TEXT = 4000
#: Seconds a worker leaving the RPC world gives its last answer to reach the sender: the agent stops without
#: waiting for its peers (a dead one would hold it up), which drops an answer still on its way.
ANSWER_FLUSH_S = 0.5


class RPCReceiver(ReceiverEngine):
    """The worker's RPC session (unless it runs RPC itself) and its mailbox for one model.

    A sender whose store leaves a call unanswered for four times the core's ``timeout`` (given at :meth:`join`)
    is gone: its host vanished.

    Args:
        handoff: the session to join, or ``{"external": True}``.
        take: the model may take the buffer an update arrived in (TensorPipe allocates one per message).
        where: ``model_id`` and ``worker_idx``.
    """

    def __init__(self, handoff: dict[str, Any], *, take: bool, where: dict[str, Any]) -> None:
        if not handoff:
            raise ConfigurationError(
                "this receiver does not know its sender: hand it the scheme pickled after init_on_sender(), "
                "or its receiver_config(worker_idx)",
                model_id=where["model_id"],
            )
        self.handoff, self._take, self.where = handoff, take, where
        self.placement = "take" if take else "write"
        self.session: Session | None = None
        # (updates that arrive before connect() wait here)
        self.mailbox = open_mailbox(self, **where, sender=handoff.get("sender"))
        self._probed_at = 0.0
        self._answered_at: float | None = None

    def join(self, deadline: float, check: Callable[[FlatLayout], Any], update_timeout: float) -> None:
        if self.handoff.get("external"):
            return
        w = self.where["worker_idx"]
        self.session = join_worker_session(
            self.handoff, remaining(deadline), SILENT_TIMEOUTS * update_timeout, **self.where
        )
        forget_ended(self.session, self.where["model_id"], w)
        probe = self.session.probe
        try:
            # The agent's start asks the sender's store, as a stopped sender leaves it: past the deadline, it
            # hangs up (where this worker's join dialled it; another scheme's agent is started already).
            with hung_up_at(probe.hangup, deadline, "joining the RPC world", **self.where) if probe else nullcontext():
                start_agent(self.session, default_worker_name(w), w + 1, remaining(deadline), **self.where)
        except BaseException:
            leave_session(self.session)
            self.session = None
            raise

    def take(self, timeout: float, newest: bool) -> list[Delivery]:
        box = self.mailbox
        with box.cond:
            box.cond.wait_for(lambda: box.queue or box.closed or box.dropped, timeout)
            if not box.queue:
                if box.closed:
                    raise ConnectionClosedError("the sender shut down", **self.where)
                if box.dropped:  # (this receiver was closed, by another thread, as it waited)
                    raise ConnectionClosedError("this receiver shut down", **self.where)
                self._probe()
                return []
            if newest:
                arrived = list(box.queue)
                box.queue.clear()
            else:
                arrived = [box.queue.popleft()]
        return [Delivery(a.version, [], token=a) for a in arrived[:-1]] + [self._delivery(arrived)]

    def _probe(self) -> None:
        """No update came: is the sender still there? (At most every :data:`SENDER_PROBE_EVERY` seconds.)"""
        now = time.monotonic()
        if self.session is None or now - self._probed_at < SENDER_PROBE_EVERY:
            return
        self._probed_at = now
        reason = sender_gone(self.session)
        if reason is not None:
            raise ConnectionClosedError(f"the sender went away ({reason})", **self.where)
        said = sender_said(self.session, self.where["model_id"], self.where["worker_idx"])
        if said is not None:  # (a worker RPC cannot take back into its world: this one's part is over)
            raise ConnectionClosedError(said, **self.where)

    def _delivery(self, arrived: list[Arrival]) -> Delivery:
        update, refusal = arrived[-1], None
        try:
            for arrival in arrived:
                if arrival.layout is not None:
                    self.layout = FlatLayout.from_plain(arrival.layout)
        except ConfigurationError as exc:
            refusal = exc
        if self.layout is None:
            return Delivery(update.version, [], refusal=refusal, token=update)
        if update.delta is not None:
            return self._changes(update, refusal)
        self.placement = "take" if self._take and not self.layout.casts else "write"
        # A message's buffer is this process's alone, so a CPU model can take its memory instead of a copy; the
        # memory it held before is freed with the buffer.
        buffer, storage = update.buffer, update.buffer.untyped_storage()
        whole = buffer.storage_offset() == 0 and storage.nbytes() == buffer.numel() == self.layout.nbytes
        take = storage if self.placement == "take" else None
        return Delivery(
            update.version, [(0, buffer)], update.digest, storage=take, whole=whole, refusal=refusal, token=update
        )

    def _changes(self, update: Arrival, refusal: BaseException | None) -> Delivery:
        """The delivery of changes against the version held (``update.buffer`` their body)."""
        assert self.layout is not None and update.delta is not None
        delta = None
        try:
            delta = Delta.from_plain(update.delta, chunks_of(self.layout))
            delta.body = update.buffer.reshape(-1).view(torch.uint8)
        except (ConfigurationError, RuntimeError) as exc:  # not a description, or a body of another dtype
            refusal = refusal or ConfigurationError(f"changes refused: {exc}", **self.where)
        return Delivery(update.version, [], refusal=refusal, token=update, delta=delta)

    def ack(self, taken: list[Delivery], held: int | None, error: BaseException | None = None) -> None:
        answer: dict[str, Any] = {"held": held}
        if error is not None:
            answer["error"] = {"type": type(error).__name__, "message": str(error)[:MAX_ERROR_TEXT]}
        for delivery in taken:
            delivery.token.future.set_result(answer)
        # (for a sender whose call gave up waiting for the answer: it asks)
        self.mailbox.last = (taken[-1].version, taken[-1].token.delta is None, answer)
        self._answered_at = time.monotonic()

    def close(self) -> None:
        # The sender is shutting down the whole world (its goodbye said every worker is alive): leave with it.
        said_goodbye = self.mailbox.closed and self.mailbox.whole
        drop_mailbox(self.where["model_id"] or "", self.mailbox)
        if self.session is not None:
            # Leaving alone, give the last answer (a refusal at connect, answered just before this) time to go out.
            # Leaving with the sender, the world's barrier flushes it: the sender's agent waits for its answers.
            if self._answered_at is not None and not said_goodbye:
                time.sleep(max(0.0, ANSWER_FLUSH_S - (time.monotonic() - self._answered_at)))
            leave_session(self.session, clean=said_goodbye)
            self.session = None
