"""Updates that reached an RPC worker, waiting for its ``receive()``: each is answered once applied.

The sender's RPC runs :func:`deliver` in the worker's agent, which queues the
update in the model's mailbox and returns a future; the worker's ``receive()``
applies the update and completes that future: the answer is the ack.

A process has one receiver of a model at a time, and its mailbox takes the
calls of one sender, named by the id its calls carry (the receiver knows it from
its handoff). Calls of a sender whose receiver is not open here wait for it; once
its receiver here shut down, they are answered at once that it did, and the
sender names the worker gone. So in a world you run, a scheme built anew beside
or after another of the same model takes only its own sender's calls and words.
"""

from __future__ import annotations

import threading
import time
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
        #: Its receiver shut down (or, waiting for it, its sender said goodbye): a call that finds it now is
        #: answered at once that the worker shut down.
        self.dropped = False
        #: When its sender's last call or word came (``time.monotonic()``).
        self.heard_at = time.monotonic()

    def takes_from(self, sender: str | None) -> bool:
        return self.sender is None or sender is None or self.sender == sender


#: The mailbox of each model whose receiver is open in this process.
_OPEN: dict[str, Mailbox] = {}
#: Calls and words of senders whose receiver of the model is not open here, by sender: each waits for it.
_WAITING: dict[str, dict[str | None, Mailbox]] = {}
#: Senders whose receiver of the model here shut down (by model): their calls are answered so at once.
_ENDED: dict[str, set[str]] = {}
_MAILBOX_LOCK = threading.Lock()
#: The answer to a call its receiver cannot take: it shut down. ``gone`` tells the sender to name the worker gone;
#: ``error`` says why to a sender before that field.
_SHUT_DOWN = {
    "held": None,
    "gone": "its receiver shut down",
    "error": {"type": "ConnectionClosedError", "message": "the worker shut down"},
}


def _open_box(model_id: str) -> Mailbox | None:
    """(Under the lock.) The mailbox of the model's receiver open here: ``None`` where none is, or it was dropped
    unclosed (then closed here)."""
    box = _OPEN.get(model_id)
    if box is not None and box.receiver is not None and box.receiver() is None:
        _close(model_id, box)
        return None
    return box


def _close(model_id: str, box: Mailbox) -> None:
    """(Under the lock.) ``box``, open, lost its receiver: its calls, and its sender's from now on, are answered
    that the worker shut down."""
    del _OPEN[model_id]
    box.receiver = None
    if box.sender is not None:
        _ENDED.setdefault(model_id, set()).add(box.sender)
    _shut(box)


def _box_for(model_id: str, sender: str | None) -> Mailbox | None:
    """(Under the lock.) Where a call or word of ``sender`` goes: the open receiver's mailbox if it takes its calls
    (one that did not know its sender takes the first it hears from as its own), else the one where they wait for
    its receiver; ``None``: its receiver here shut down."""
    box = _open_box(model_id)  # (first: a receiver found dropped unclosed here ends its sender)
    if sender is not None and sender in _ENDED.get(model_id, ()):
        return None
    if box is not None and box.sender is None:
        box.sender = sender
    if box is None or not box.takes_from(sender):
        box = _WAITING.setdefault(model_id, {}).setdefault(sender, Mailbox(sender))
    box.heard_at = time.monotonic()
    return box


def _shut(box: Mailbox) -> None:
    """Answer every call waiting in ``box`` that the worker shut down; calls that find it later are answered so."""
    with box.cond:
        box.dropped = True
        for arrival in box.queue:
            arrival.future.set_result(_SHUT_DOWN)
        box.queue.clear()
        box.cond.notify_all()


def open_mailbox(receiver: Any, model_id: str, worker_idx: int | None = None, sender: str | None = None) -> Mailbox:
    """The mailbox of ``model_id`` for ``receiver`` (worker ``worker_idx``) to take from, with the updates and
    goodbye that ``sender`` sent before it opened (a receiver that does not know its sender, ``None``, takes those
    of the sender heard from last, one that did not say goodbye first). Other senders' calls wait on.

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
        waiting = _WAITING.get(model_id, {})
        if sender is None and waiting:
            sender = max(waiting.values(), key=lambda b: (not b.closed, b.heard_at)).sender
        box = waiting.pop(sender, None) or Mailbox(sender)
        if not waiting:
            _WAITING.pop(model_id, None)
        box.receiver = weakref.ref(receiver)
        _OPEN[model_id] = box
        if sender is not None:
            _ENDED.get(model_id, set()).discard(sender)
    return box


def drop_mailbox(model_id: str, box: Mailbox) -> None:
    """``box``'s receiver shut down: the calls waiting in it, and its sender's from now on, are answered that it
    did (a mailbox of the model opened since by another receiver is left as it is)."""
    with _MAILBOX_LOCK:
        if _OPEN.get(model_id) is box:
            _close(model_id, box)


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
    ``sender`` shut down."""
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


#: What :func:`last_answer` says where the receiver of the sender who asks shut down here.
NO_RECEIVER = "no receiver"


def last_answer(model_id: str, sender: str | None = None) -> tuple[int, bool, dict] | str | None:
    """Runs in the worker: the newest call from ``sender`` it answered for ``model_id`` (:attr:`Mailbox.last`;
    ``None``: none yet, its receiver not open yet; :data:`NO_RECEIVER`: its receiver shut down). A sender whose
    call gave up waiting for its answer asks, to hear it."""
    with _MAILBOX_LOCK:
        box = _open_box(model_id)  # (first: a receiver found dropped unclosed here ends its sender)
        if sender is not None and sender in _ENDED.get(model_id, ()):
            return NO_RECEIVER
        if box is not None and box.takes_from(sender):
            return box.last
        return None  # (its receiver is not open here yet; every RPC sender of weightsync's asks with its id)


def close_mailbox(model_id: str, whole: bool = True, sender: str | None = None) -> bool:
    """Runs in the worker: ``sender`` shut down; ``whole``: with every worker alive (the world leaves whole). Its
    calls still waiting for its receiver to open are answered (it is gone), and that receiver hears the goodbye
    once it opens. The goodbye of another sender than the one whose calls the receiver open takes says nothing to
    it."""
    with _MAILBOX_LOCK:
        box = _box_for(model_id, sender)
        waiting = box is not None and _WAITING.get(model_id, {}).get(sender) is box
    if box is None:
        return True
    with box.cond:
        box.closed, box.whole = True, whole
        if waiting:  # (nobody is left to take their answers, nor a call that races this: no memory is kept)
            box.dropped = True
            for arrival in box.queue:
                arrival.future.set_result(_SHUT_DOWN)
            box.queue.clear()
        box.cond.notify_all()
    return True
