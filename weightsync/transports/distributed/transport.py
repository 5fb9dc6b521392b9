"""``DistributedTransport``: weight updates to ONE torch.distributed rank, over a process group of our own.

The engine never touches the default process group a training job may have
set up: it opens (or joins, under a prefix of its own) a TCP store and builds a
standalone gloo or NCCL group on it, rank 0 the sender and rank ``i + 1``
worker ``i``. Updates are flat byte buffers (one point-to-point send per worker
per version and bucket, whatever the number of tensors). A worker of the run's
group has a line to the sender (:mod:`.line`): its announcements and acks travel
there, and so do the bytes of a small version; a worker without one (rejoined,
or its line did not come up) is announced to in the store (with a ring of its
doorbell) and acks over the group. The store also carries error details and
larger versions' digests. A rank that dies fails the pending ack at once (its
line or its group connection closes) instead of being waited on.

Whoever reaches the store may write its keys, and may claim rank 0 of a group
before the sender does: every value a worker acts on is sealed with the run key
(:class:`~.auth.Sealer`), and the bytes it receives are checked against the
sender's sealed keyed digest before the model sees them (:class:`~.auth.PayloadMac`).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import struct
import time
from collections import deque
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...core.timing import deadline_after, remaining, wait_until
from ...errors import (
    AuthenticationError,
    ConnectionClosedError,
    LifecycleError,
    TransportError,
    WeightSyncError,
    WorkerDiedError,
    first_line,
)
from ..base import PeerTransport
from ..store import store_set, store_value
from ..storeclient import StoreCalls
from .auth import ACK_TAG_WORDS, Sealer
from .doorbell import Doorbell, ring
from .group import Link, Waiter
from .line import ACK, FRAME, Line
from .messages import announcement, sealed_object
from .worker_side import ACK_FAILED, ACK_OK, MAX_ERROR_TEXT, TAG_ACK, TAG_DATA, WorkerSide

if TYPE_CHECKING:
    from ...core.engine import Sink

__all__ = ["ACK_FAILED", "ACK_OK", "MAX_ERROR_TEXT", "DistributedTransport"]

log = logging.getLogger("weightsync.transports.distributed")

#: How often a sender waiting for a worker to say it took a message looks again (seconds).
TAKEN_POLL_S = 0.001
#: The longest a sender looks for a worker's word of why it failed, once its failed ack came (seconds).
ERROR_DETAIL_WAIT_S = 1.0


@dataclass
class _Pending:
    """An update on its way to one worker: its sequence number and version, and whether its ack comes on the
    worker's line (else over the group, into the oldest of :attr:`DistributedTransport.posted`)."""

    seq: int
    version: int
    on_line: bool


@dataclass
class _Posted:
    """A receive of an ack posted over the group: the tensor it lands in, gloo's work, and the future the waiter
    completes with that work (``None`` until the message's parts are all sent:
    :meth:`~DistributedTransport.expect_ack`)."""

    ack: torch.Tensor
    work: Any
    done: Future | None = None


def posts_ack_first(device: torch.device) -> bool:
    """Whether an ack's receive over the group is posted as soon as the worker has all it needs to ack (the
    message announced with its digest, or the digest set after the parts), before :meth:`expect_ack`.

    gloo holds a send until its receiver posts the receive: a receive posted later leaves a window where a Ctrl-C
    in the trainer leaves the worker's ack with no receive, and the worker's ack waits its timeout, then closes
    its group. (Not before the worker can ack: a receive no ack ever comes to would hold the waiter for good.)
    NCCL (acks on the GPU) runs a pair's operations in order on one stream: a receive posted before the parts
    would hold them behind the ack that only follows them, so there it is posted after them.
    """
    return device.type == "cpu"


class DistributedTransport(WorkerSide, PeerTransport):
    """The data plane to ONE rank of :class:`~weightsync.schemes.distributed.DistributedWeightSyncScheme`.

    On the sender, one per worker: the engine announces each update, sends its buckets and posts the receive
    of its ack here; ``send_weights`` / ``send_weights_async`` / ``wait_ack`` go through the sender's pipeline.
    On a worker, its own: announcements, buckets and acks the other way.

    Args:
        worker_idx: the worker this transport reaches (its rank is ``worker_idx + 1``).
        link: the group and store to talk over.
        device: where acks live (the GPU with NCCL).
        timeout: on a worker, the longest its ack may take to leave.
        sync: ``send_weights`` waits for the ack (``send_weights_async`` never does; ``None``: as the scheme's
            ``sync`` says).
        model_id: the model, for errors.
        sink: on the sender, where the older API's calls go.
        bell: on a worker, the doorbell the sender rings with each announcement (:mod:`.doorbell`); without one,
            the worker looks at the store every :data:`LOOK_AGAIN_S` while it waits.
        line: the worker's line (:mod:`.line`), which then carries the announcements, the acks and the bytes of
            what the sender sends inline, instead of the store, the doorbell and the group.
        calls: on a worker, where its store calls are made (:class:`~..store.StoreCalls`: shared by the
            transports of one store client); a thread of its own where none is given.
    """

    def __init__(
        self,
        worker_idx: int = 0,
        *,
        link: Link | None = None,
        device: torch.device | None = None,
        timeout: float = 60.0,
        sync: bool | None = None,
        model_id: str | None = None,
        sink: Sink | None = None,
        bell: Doorbell | None = None,
        line: Line | None = None,
        calls: StoreCalls | None = None,
    ) -> None:
        super().__init__(worker_idx, sink)
        self.model_id = model_id
        self.rank = worker_idx + 1  # the worker's rank in the group this transport uses
        self.link = link if link is not None else Link()
        self.device = device or torch.device("cpu")
        self.timeout = timeout
        self.sync = sync
        self.seq = 0  # sequence number of the last message to this worker (the initial weights are 0)
        self.pending: deque[_Pending] = deque()
        self.posted: deque[_Posted] = deque()  # on the sender: the receives of acks over the group, oldest first
        self._ack_posted = -1  # on the sender: the message whose ack's receive was posted last
        self._waiter: Waiter | None = None
        self.bell = bell
        self.line = line
        self.line_lost = False  # on a worker: it hung up its line (it then learns only that it was dropped)
        self.group_closed = False  # on a worker: gloo closed its connection to the sender at a wait's timeout
        self.line_ended: float | None = None  # on a worker: when it read its sender's end of the line it hung up
        self._inline = False  # on a worker: the bytes of the message announced last come on the line
        self._spent: list[str] = []  # on a worker: keys read and not deleted yet (:meth:`sweep`)
        self._looked = (-1, 0.0)  # on a worker: the doorbell's count at its last look for a message, and when
        self.calls = calls if calls is not None else StoreCalls(None, f"weightsync-{model_id}-store{worker_idx}")

    def _group(self) -> tuple[Any, dist.Store]:
        if self.link.pg is None or self.link.store is None:
            raise LifecycleError("this transport's group has not formed yet", worker_idx=self.worker_idx)
        return self.link.pg, self.link.store

    def use_pair(self, pg: Any, store: dist.Store, sealer: Sealer) -> DistributedTransport:
        """Use a group and store of this transport's own: the two-rank group (sender rank 0, worker rank 1)
        formed when a restarted worker rejoins, its store prefix and its sealer. Returns ``self``."""
        self.link = Link(pg, store, sealer)
        self.rank = 1
        return self

    @property
    def sealer(self) -> Sealer:
        if self.link.sealer is None:
            raise LifecycleError("this transport's group has not formed yet", worker_idx=self.worker_idx)
        return self.link.sealer

    def _opened(self, key: str, version: int | None = None) -> bytes:
        """The sealed value at ``key``, opened (AuthenticationError: not sealed with the run key)."""
        raw = store_value(self.store, key)  # (first: a store gone is told as such)
        return self.sealer.open(raw, key, version, **self._where(version))

    @property
    def store(self) -> dist.Store:
        """The store carrying this worker's signalling (announcements, checksums, error details)."""
        return self._group()[1]

    def _where(self, version: int | None = None) -> dict[str, Any]:
        return {"model_id": self.model_id, "worker_idx": self.worker_idx, "version": version}

    @property
    def bell_key(self) -> str:
        """The key of this worker's doorbell in :attr:`store`."""
        return f"bell/{self.worker_idx}"

    # ----------------------------------------------------------------- sender
    def announce(
        self,
        version: int,
        nonce: str,
        mac: str,
        *,
        initial: bool = False,
        delta: dict[str, Any] | None = None,
        taken: bool = False,
        digest: str | None = None,
        body: torch.Tensor | None = None,
    ) -> Future | None:
        """Start message ``version``: announce it on the worker's line, else in the store (the parts follow over
        the group).

        The initial weights are sent without an announcement: the worker is in ``connect()`` waiting for
        exactly them (their version, ``nonce`` and ``mac`` are in the store's ``initial``). ``nonce`` and ``mac``:
        the message's one-time key and MAC (:class:`~.auth.PayloadMac`). ``delta``: the message is the changes
        this description says (:meth:`~weightsync.tensors.delta.Delta.to_plain`), its body the one part.
        ``digest``: the keyed digest of the message's bytes, known before they are sent (the changes, or a small
        version): sealed in the announcement, no :meth:`set_digest` follows.
        ``taken``: the worker says when it took the message (:meth:`say_taken`; a driver waits for that).
        ``body``: on a line, the message's bytes, which follow the announcement there (``digest`` says what they
        hash to); the future completes once the line no longer reads them. Without ``body``, ``None``.
        """
        _, store = self._group()
        seq = 0 if initial else self.seq + 1
        sent = None
        if not initial:
            key = f"msg/{self.worker_idx}/{seq}"
            said = announcement(version, nonce, mac, delta, taken, digest, inline=body is not None)
            sealed = self.sealer.seal(key, json.dumps(said))
            if self.line is not None:
                written = self.line.write(
                    [FRAME.pack(len(sealed)), sealed, *([body.numpy()] if body is not None else [])]
                )
                sent = written if body is not None else None
            else:
                ring(store, self.bell_key, said=sealed)  # a worker waiting for it takes it now (checked as the key's)
                store_set(store, key, sealed)  # where it looks if a stranger took the ring away
        self.seq = seq
        if self._waiter is None:
            self._waiter = Waiter(f"weightsync-{self.model_id}-rank{self.rank}")
        if digest is not None and posts_ack_first(self.device):
            self._post_ack()
        return sent

    def _post_ack(self) -> None:
        """Post the receive of the ack of the message announced last, once (over the group)."""
        if self.line is not None or self._ack_posted == self.seq:
            return
        pg, _ = self._group()
        ack = torch.zeros(3 + ACK_TAG_WORDS, dtype=torch.int64, device=self.device)
        self.posted.append(_Posted(ack, pg.recv([ack], self.rank, TAG_ACK)))
        self._ack_posted = self.seq

    def send_part(self, part: torch.Tensor) -> Future:
        """Send one bucket of the message announced last; its future completes once ``part`` is no longer read."""
        pg, _ = self._group()
        assert self._waiter is not None
        return self._waiter.watch(pg.send([part], self.rank, TAG_DATA))

    def set_digest(self, digest: str, version: int) -> None:
        """The keyed digest of the message announced last (version ``version``), sealed, for the worker to check
        the bytes against before applying them."""
        key = f"digest/{self.worker_idx}/{self.seq}"
        store_set(self.store, key, self.sealer.seal(key, digest, version))
        if posts_ack_first(self.device):
            self._post_ack()

    def wait_taken(self, deadline: float) -> bool:
        """Wait (until ``deadline``) until the worker took the message announced last off the wire and checked it
        (:meth:`say_taken`); ``False`` if it did not say so in time, or the store went away. A value not sealed
        with the run key is not its word, and is waited past."""
        key = f"taken/{self.worker_idx}"
        while True:
            try:  # (looked at, not waited on: a store wait that times out logs torch's warnings each time)
                if int(self._opened(key)) >= self.seq:  # (TransportError: not there yet)
                    return True
            except dist.DistNetworkError:  # the store is gone: no word can come (each look would fail, logged)
                return False
            except (dist.DistError, WeightSyncError, ValueError):
                pass  # not there yet, or not the worker's
            if remaining(deadline) <= 0:
                return False
            time.sleep(min(TAKEN_POLL_S, max(remaining(deadline), 0.0)))

    def expect_ack(self, version: int) -> None:
        """Expect the ack of the message announced last (every part of it sent): read off the worker's line by
        :meth:`take_ack`, or received over the group (the receive posted now, or as it was announced)."""
        if self.line is None:
            self._post_ack()
            assert self._waiter is not None
            for posted in self.posted:  # (watched after the parts: the waiter completes its works in order)
                if posted.done is None:
                    posted.done = self._waiter.watch(posted.work)
        self.pending.append(_Pending(self.seq, version, on_line=self.line is not None))

    def take_ack(self) -> tuple[_Pending, int, int] | None:
        """The oldest pending ack as (pending, held version, status), if it arrived already.

        Raises:
            WorkerDiedError: the worker's rank went away.
            ConnectionClosedError: an ack out of order.
            AuthenticationError: an ack without the run key's tag (a process that took the worker's rank).
        """
        if not self.pending:
            return None
        head = self.pending[0]
        try:
            if head.on_line:
                if self.line is None:
                    raise ConnectionClosedError("its line is gone")
                raw = self.line.take(ACK.size)
                if raw is None:
                    return None
                words = list(ACK.unpack(raw))
            else:  # (an ack lands in the oldest receive posted, whichever message it acks)
                posted = self.posted[0] if self.posted else None
                if posted is None or posted.done is None or not posted.done.done():
                    return None
                self.posted.popleft()
                posted.done.result()
                words = [int(x) for x in posted.ack.tolist()]
        except (RuntimeError, CancelledError, ConnectionClosedError) as exc:
            raise WorkerDiedError(
                f"its rank {self.rank} went away ({first_line(exc)})", **self._where(head.version)
            ) from None
        seq, held, status, *tag = words
        if not hmac.compare_digest(
            struct.pack(">4q", *tag), struct.pack(">4q", *self.sealer.ack_tag(self.worker_idx, seq, held, status))
        ):
            raise AuthenticationError(
                f"an ack from rank {self.rank} without the run key's tag: a process that does not hold the key "
                "took this worker's place in the group",
                **self._where(head.version),
            )
        if seq < head.seq:  # the ack of a message whose send was cut short (a Ctrl-C before its ack was expected):
            return self.take_ack()  # read past it, to the one expected
        if seq != head.seq:
            raise ConnectionClosedError(
                f"ack out of order: expected message {head.seq}, got {seq}", **self._where(head.version)
            )
        self.pending.popleft()
        return head, held, status

    def waiting_on(self) -> Future | Line | None:
        """The future of the oldest ack still awaited, if any; the line it comes on, where it does."""
        if not self.pending:
            return None
        if self.pending[0].on_line:
            return self.line
        return self.posted[0].done if self.posted else None

    def error_detail(self, seq: int) -> dict[str, str]:
        """What the worker wrote about its failure to apply message ``seq``, looked for at most
        :data:`ERROR_DETAIL_WAIT_S`: torch's store client sends a set without waiting for its answer, so the
        worker's word, written before its ack, may reach the store after the ack reached this process. (The
        worker does not wait for the store to answer: a sender that stopped, a debugger's, would hold it.) A value
        not sealed with the run key is not its word (the sender acts on the failure's type), and is waited past."""
        key, found = f"err/{self.worker_idx}/{seq}", []

        def sealed() -> bool:
            try:
                found.append(sealed_object(self.sealer, self.store, key, **self._where()))
            except AuthenticationError:
                return False
            return True

        try:
            if wait_until(lambda: self.store.check([key]) and sealed(), deadline_after(ERROR_DETAIL_WAIT_S), 0.002):
                detail = found[-1]
                return {
                    "type": str(detail.get("type", "Error"))[:200],
                    "message": str(detail.get("message", ""))[:MAX_ERROR_TEXT],
                }
        except (dist.DistError, TransportError, LifecycleError):
            pass
        return {"type": "UnknownError", "message": "the worker reported a failure without details"}

    def close(self, timeout: float) -> None:
        """Tell the worker the sender is gone (its next ``receive`` raises ConnectionClosedError)."""
        self._last_word({"closed": True})
        self.stop_waiting(timeout)

    def drop(self, reason: str) -> None:
        """Tell the worker it was dropped, and why: a worker still alive (its link was down, it stalled) asks to
        rejoin when it reads this, and is sent the newest version.

        Set before the staging buffers it was sent from may be reused: a send still posted to it (a link down)
        may deliver a later version's bytes once the link is back, and the worker that finds itself dropped after
        receiving a message discards it (:meth:`was_dropped`)."""
        with contextlib.suppress(LifecycleError, dist.DistError):
            key = f"dropped/{self.worker_idx}"
            store_set(self.store, key, self.sealer.seal(key, "1"))  # (torch's set waits for no answer)
        self._last_word({"dropped": reason[:MAX_ERROR_TEXT]})
        self.stop_waiting(0.0)

    def _last_word(self, msg: dict[str, Any]) -> None:
        key = f"msg/{self.worker_idx}/{self.seq + 1}"
        if self.line is not None:  # after what the line carries already (a worker dropped reads it in the store)
            with contextlib.suppress(WeightSyncError):
                sealed = self.sealer.seal(key, json.dumps(msg))
                self.line.write([FRAME.pack(len(sealed)), sealed])
            return
        # The store is the sender's own (or its job's): writing to it does not depend on the worker's link.
        with contextlib.suppress(LifecycleError, dist.DistError):
            store_set(self.store, key, self.sealer.seal(key, json.dumps(msg)))
            ring(self.store, self.bell_key, last=True)

    def stop_waiting(self, timeout: float) -> None:
        """End the waiter thread and close the line (once what it carries went out, ``timeout`` at most); a
        waiter still blocked on a stalled peer ends at gloo's operation timeout."""
        if self.line is not None:
            self.line.close(timeout)
        if self._waiter is not None and not self._waiter.close(timeout):
            log.warning(
                "worker %d (rank %d) has not answered an operation in progress; its waiter thread ends when the "
                "process group times it out",
                self.worker_idx,
                self.rank,
            )
        self._waiter = None
        self.pending.clear()
        self.posted.clear()

    def receive_weights(self, timeout: float | None = None, **kwargs: Any) -> Any:
        raise LifecycleError("a distributed worker receives with scheme.receive()")

    def check_connection(self) -> bool:
        return super().check_connection() and self.link.pg is not None
