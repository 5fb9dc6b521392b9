"""Updates that reached an RPC worker, waiting for its ``receive()``: each is answered once applied.

The sender's RPC runs :func:`deliver` in the worker's agent, which queues the
update in the model's mailbox and returns a future; the worker's ``receive()``
applies the update and completes that future: the answer is the ack.
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
    "mailbox",
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
    """Updates for one model in this worker, waiting for its ``receive()``."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: deque[Arrival] = deque()
        self.closed = False
        #: The sender's goodbye said the whole world leaves with it (every worker alive): leave by its barrier.
        self.whole = False
        #: The newest call answered: its version, whether it carried the version whole (not its changes), and the
        #: answer. The sender asks for it (:func:`last_answer`) where a call gave up waiting for its answer.
        self.last: tuple[int, bool, dict] | None = None
        #: The receiver that takes from it (:func:`open_mailbox`), while it lives; ``None``: none yet.
        self.receiver: weakref.ref | None = None


_MAILBOXES: dict[str, Mailbox] = {}
#: Models whose receiver in this process shut down, none opened since: a mailbox made for them again (by a call
#: still on its way, or the sender's goodbye) has no receiver to answer.
_CLOSED: set[str] = set()
_MAILBOX_LOCK = threading.Lock()


def mailbox(model_id: str) -> Mailbox:
    with _MAILBOX_LOCK:
        return _MAILBOXES.setdefault(model_id, Mailbox())


def open_mailbox(receiver: Any, model_id: str, worker_idx: int | None = None) -> Mailbox:
    """The mailbox of ``model_id`` for ``receiver`` (worker ``worker_idx``) to take from, with the updates that
    arrived before it.

    Raises:
        ConfigurationError: another receiver of ``model_id`` is open in this process. A sender's call names a
            process and a model, not a receiver: each update, and the sender's goodbye, would reach either one.
    """
    with _MAILBOX_LOCK:
        box = _MAILBOXES.setdefault(model_id, Mailbox())
        if box.receiver is not None and box.receiver() is not None:
            raise ConfigurationError(
                f"another receiver of model {model_id!r} is open in this process: updates sent to it would reach "
                "either receiver; shut the other scheme down first",
                model_id=model_id,
                worker_idx=worker_idx,
            )
        box.receiver = weakref.ref(receiver)
        _CLOSED.discard(model_id)
        return box


def drop_mailbox(model_id: str, box: Mailbox) -> None:
    """``box``'s receiver shut down: the updates waiting in it are answered that it did, and :func:`last_answer`
    says so from now on (a mailbox of the model made since, or later, by another receiver, is left as it is)."""
    with _MAILBOX_LOCK:
        if _MAILBOXES.get(model_id) is not box:
            return
        del _MAILBOXES[model_id]
        box.receiver = None
        _CLOSED.add(model_id)
    with box.cond:
        for arrival in box.queue:
            arrival.future.set_result(
                {"held": None, "error": {"type": "ConnectionClosedError", "message": "the worker shut down"}}
            )
        box.queue.clear()


@rpc.functions.async_execution
def deliver(
    model_id: str,
    version: int,
    buffer: torch.Tensor,
    layout: dict | None,
    digest: str | None = None,
    delta: dict | None = None,
) -> torch.futures.Future:
    """Runs in the worker's RPC agent: queue the update (``delta``: the description of the changes ``buffer``
    holds); the answer comes once the worker applied it."""
    arrival = Arrival(version, buffer, layout, digest, delta)
    box = mailbox(model_id)
    with box.cond:
        box.queue.append(arrival)
        box.cond.notify_all()
    return arrival.future


#: What :func:`last_answer` says where no receiver of the model is here: it shut down, and no other opened since.
NO_RECEIVER = "no receiver"


def last_answer(model_id: str) -> tuple[int, bool, dict] | str | None:
    """Runs in the worker: the newest call it answered for ``model_id`` (:attr:`Mailbox.last`; ``None``: none yet;
    :data:`NO_RECEIVER`: its receiver shut down). A sender whose call gave up waiting for its answer asks, to hear
    it."""
    with _MAILBOX_LOCK:
        box = _MAILBOXES.get(model_id)
        if box is None or model_id in _CLOSED:
            return NO_RECEIVER
        return box.last


def close_mailbox(model_id: str, whole: bool = True) -> bool:
    """Runs in the worker: the sender shut down; ``whole``: with every worker alive (the world leaves whole)."""
    box = mailbox(model_id)
    with box.cond:
        box.closed, box.whole = True, whole
        box.cond.notify_all()
    return True
