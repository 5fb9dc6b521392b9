"""Updates that reached an RPC worker, waiting for its ``receive()``: each is answered once applied.

The sender's RPC runs :func:`deliver` in the worker's agent, which queues the
update in the model's mailbox and returns a future; the worker's ``receive()``
applies the update and completes that future: the answer is the ack.

A process has one receiver of a model at a time, and its mailbox takes the
calls of one sender, named by the id its calls carry (the receiver knows it from
its handoff): in a world you run, a scheme built after another of the same model
shut down never takes what the old sender sent or said after that.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.rpc as rpc

from ...errors import ConfigurationError

__all__ = [
    "NO_RECEIVER",
    "Arrival",
    "Mailbox",
    "close_mailbox",
    "deliver",
    "drop_mailbox",
    "last_answer",
    "open_mailbox",
]


@dataclass
class Arrival:
    """An update that reached a worker: answered (acked) once applied or superseded."""

    version: int
    buffer: torch.Tensor
    layout: dict | None
    digest: str | None = None  # the sender's checksum of ``buffer``, when it computes one
    delta: dict | None = None  # ``buffer`` is the body of the changes this describes (against the version held)
    future: torch.futures.Future = field(default_factory=torch.futures.Future)


class Mailbox:
    """Updates for one model in this worker from one sender, waiting for its receiver's ``receive()``."""

    def __init__(self, sender: str | None = None) -> None:
        self.cond = threading.Condition()
        self.queue: deque[Arrival] = deque()
        self.closed = False
        #: The sender's goodbye said the whole world leaves with it (every worker alive): leave by its barrier.
        self.whole = False
        #: The newest call answered: its version, whether it carried the version whole (not its changes), and the
        #: answer. The sender asks for it (:func:`last_answer`) where a call gave up waiting for its answer.
        self.last: tuple[int, bool, dict] | None = None
        #: The sender whose calls it takes (``None``: any; a receiver whose handoff does not name its sender).
        self.sender = sender
        #: The receiver that takes from it (:func:`open_mailbox`), while it lives; ``None``: none yet.
        self.receiver: weakref.ref | None = None
        #: Its receiver shut down, or another sender's opened: a call that finds it now is answered so at once.
        self.dropped = False

    def takes_from(self, sender: str | None) -> bool:
        return self.sender is None or sender is None or self.sender == sender


#: The mailbox of each model whose receiver is open in this process.
_OPEN: dict[str, Mailbox] = {}
#: Calls that came for a model no receiver has open here, by sender: each waits for a receiver of its sender.
_WAITING: dict[str, dict[str | None, Mailbox]] = {}
#: Models whose receiver in this process shut down, none opened since: no receiver is here to answer an ask.
_CLOSED: set[str] = set()
_MAILBOX_LOCK = threading.Lock()
_SHUT_DOWN = {"held": None, "error": {"type": "ConnectionClosedError", "message": "the worker shut down"}}


def _open_box(model_id: str) -> Mailbox | None:
    """(Under the lock.) The mailbox of the model's receiver open here: ``None`` where none is, or it was dropped
    unclosed (its calls waiting are then answered that it shut down)."""
    box = _OPEN.get(model_id)
    if box is not None and box.receiver is not None and box.receiver() is None:
        del _OPEN[model_id]
        _CLOSED.add(model_id)
        _shut([box])
        return None
    return box


def _box_for(model_id: str, sender: str | None) -> Mailbox | None:
    """(Under the lock.) The mailbox a call or goodbye of ``sender`` goes to: the open receiver's that takes its
    calls (``None``: the receiver open takes another sender's), else the one where its calls wait for a receiver."""
    box = _open_box(model_id)
    if box is not None:
        return box if box.takes_from(sender) else None
    return _WAITING.setdefault(model_id, {}).setdefault(sender, Mailbox(sender))


def _shut(boxes: list[Mailbox]) -> None:
    """Answer every call waiting in ``boxes`` that the worker shut down; calls that find them later are answered so."""
    for box in boxes:
        with box.cond:
            box.dropped = True
            for arrival in box.queue:
                arrival.future.set_result(_SHUT_DOWN)
            box.queue.clear()
            box.cond.notify_all()


def open_mailbox(receiver: Any, model_id: str, worker_idx: int | None = None, sender: str | None = None) -> Mailbox:
    """The mailbox of ``model_id`` for ``receiver`` (worker ``worker_idx``) to take from, with the updates and
    goodbye that ``sender`` sent before it opened; those of other senders are answered that it shut down. (A
    receiver that does not know its sender, ``None``, takes those of the sender heard from last.)

    Raises:
        ConfigurationError: another receiver of ``model_id`` is open in this process. A sender's call names a
            process and a model, not a receiver.
    """
    with _MAILBOX_LOCK:
        if _open_box(model_id) is not None:
            raise ConfigurationError(
                f"another receiver of model {model_id!r} is open in this process: a sender's calls name a process "
                "and a model, not a receiver; shut the other scheme down first",
                model_id=model_id,
                worker_idx=worker_idx,
            )
        waiting = _WAITING.pop(model_id, {})
        if sender is None and waiting:
            sender = list(waiting)[-1]
        box = waiting.pop(sender, None) or Mailbox(sender)
        box.receiver = weakref.ref(receiver)
        _OPEN[model_id] = box
        _CLOSED.discard(model_id)
    _shut(list(waiting.values()))
    return box


def drop_mailbox(model_id: str, box: Mailbox) -> None:
    """``box``'s receiver shut down: the updates waiting in it are answered that it did, and :func:`last_answer`
    says so from now on (a mailbox of the model opened since by another receiver is left as it is)."""
    with _MAILBOX_LOCK:
        if _OPEN.get(model_id) is not box:
            return
        del _OPEN[model_id]
        box.receiver = None
        _CLOSED.add(model_id)
    _shut([box])


@rpc.functions.async_execution
def deliver(
    model_id: str,
    version: int,
    buffer: torch.Tensor,
    layout: dict | None,
    digest: str | None = None,
    delta: dict | None = None,
    sender: str | None = None,
) -> torch.futures.Future:
    """Runs in the worker's RPC agent: queue the update (``delta``: the description of the changes ``buffer``
    holds) from ``sender``; the answer comes once the worker applied it, or at once where the worker's receiver of
    the model shut down or takes another sender's calls."""
    arrival = Arrival(version, buffer, layout, digest, delta)
    with _MAILBOX_LOCK:
        box = _box_for(model_id, sender)
    if box is None:
        arrival.future.set_result(_SHUT_DOWN)
        return arrival.future
    with box.cond:
        if box.dropped:  # (its receiver shut down as this call came)
            arrival.future.set_result(_SHUT_DOWN)
        else:
            box.queue.append(arrival)
            box.cond.notify_all()
    return arrival.future


#: What :func:`last_answer` says where no receiver of the model is here for the sender who asks: it shut down, and
#: none opened since, or the one open takes another sender's calls.
NO_RECEIVER = "no receiver"


def last_answer(model_id: str, sender: str | None = None) -> tuple[int, bool, dict] | str | None:
    """Runs in the worker: the newest call from ``sender`` it answered for ``model_id`` (:attr:`Mailbox.last`;
    ``None``: none yet; :data:`NO_RECEIVER`: no receiver of it here). A sender whose call gave up waiting for its
    answer asks, to hear it."""
    with _MAILBOX_LOCK:
        box = _open_box(model_id)
        if box is None:  # (none opened yet, or it shut down)
            return NO_RECEIVER if model_id in _CLOSED else None
        return box.last if box.takes_from(sender) else NO_RECEIVER


def close_mailbox(model_id: str, whole: bool = True, sender: str | None = None) -> bool:
    """Runs in the worker: ``sender`` shut down; ``whole``: with every worker alive (the world leaves whole). The
    goodbye of another sender than the one whose calls the model's mailbox takes says nothing to its receiver."""
    with _MAILBOX_LOCK:
        box = _box_for(model_id, sender)  # (one waiting: for the receiver still to open, its sender left before it)
    if box is None:
        return True
    with box.cond:
        box.closed, box.whole = True, whole
        box.cond.notify_all()
    return True
