"""``DistributedTransport``: weight updates to ONE torch.distributed rank, over a process group of our own.

The engine never touches the default process group a training job may have
set up: it opens (or joins, under a prefix of its own) a TCP store and builds a
standalone gloo or NCCL group on it, rank 0 the sender and rank ``i + 1``
worker ``i``. Updates are flat byte buffers (one point-to-point send per worker
per version and bucket, whatever the number of tensors); the store carries the
signalling (which version comes next, checksums, error details) and the group
carries the bytes and the acks, so a rank that dies fails the pending ack at
once instead of being waited on.

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

from ...core.timing import deadline_after, remaining
from ...errors import (
    AuthenticationError,
    ConnectionClosedError,
    LifecycleError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
    WorkerDiedError,
    first_line,
)
from ..base import PeerTransport
from ..store import as_timedelta, store_json, store_set
from .auth import ACK_TAG_WORDS, PayloadMac, Sealer
from .doorbell import Doorbell, ring
from .group import Waiter, is_timeout
from .messages import announcement, checked_announcement

if TYPE_CHECKING:
    from ...core.engine import Sink

__all__ = ["ACK_FAILED", "ACK_OK", "DistributedTransport", "Link"]

log = logging.getLogger("weightsync.transports.distributed")

TAG_DATA, TAG_ACK = 1, 2
ACK_OK, ACK_FAILED = 0, 1
#: The longest error message a worker leaves in the store for the sender.
MAX_ERROR_TEXT = 4000
#: How often a sender waiting for a worker to say it took a message looks again (seconds).
TAKEN_POLL_S = 0.001
#: A worker waiting for the next announcement looks at the store when its doorbell rings (:mod:`.doorbell`), and
#: at least this often: a ring lost, or taken away by a stranger, delays it this long at most.
LOOK_AGAIN_S = 0.1


@dataclass
class Link:
    """The group and store a transport talks over: the engine's, filled in once the group formed, or a pair
    of a transport's own (a worker that rejoined); and what seals and opens the store's values there."""

    pg: Any = None
    store: dist.Store | None = None
    sealer: Sealer | None = None


@dataclass
class _Pending:
    """An update on its way to one worker: its sequence number, version and the ack being received."""

    seq: int
    version: int
    ack: torch.Tensor
    done: Future


class DistributedTransport(PeerTransport):
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
        self._waiter: Waiter | None = None
        self.bell = bell
        self._spent: list[str] = []  # on a worker: keys read and not deleted yet (:meth:`sweep`)
        self._looked = (-1, 0.0)  # on a worker: the doorbell's count at its last look for a message, and when

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
        return self.sealer.open(self.store.get(key), key, version, **self._where(version))

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
    ) -> None:
        """Start message ``version``: announce it in the store (the parts follow over the group).

        The initial weights are sent without an announcement: the worker is in ``connect()`` waiting for
        exactly them (their version, ``nonce`` and ``mac`` are in the store's ``initial``). ``nonce`` and ``mac``:
        the message's one-time key and MAC (:class:`~.auth.PayloadMac`). ``delta``: the message is the changes
        this description says (:meth:`~weightsync.tensors.delta.Delta.to_plain`), its body the one part.
        ``digest``: the keyed digest of the message's bytes, known before they are sent (the changes, or a small
        version): sealed in the announcement, no :meth:`set_digest` follows.
        ``taken``: the worker says when it took the message (:meth:`say_taken`; a driver waits for that).
        """
        _, store = self._group()
        seq = 0 if initial else self.seq + 1
        if not initial:
            key = f"msg/{self.worker_idx}/{seq}"
            sealed = self.sealer.seal(key, json.dumps(announcement(version, nonce, mac, delta, taken, digest)))
            ring(store, self.bell_key, said=sealed)  # a worker waiting for it takes it now (checked as the key's)
            store_set(store, key, sealed)  # where it looks if a stranger took the ring away
        self.seq = seq
        if self._waiter is None:
            self._waiter = Waiter(f"weightsync-{self.model_id}-rank{self.rank}")

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

    def wait_taken(self, deadline: float) -> bool:
        """Wait (until ``deadline``) until the worker took the message announced last off the wire and checked it
        (:meth:`say_taken`); ``False`` if it did not say so in time. A value not sealed with the run key is not
        its word, and is waited past."""
        key = f"taken/{self.worker_idx}"
        while True:
            try:  # (looked at, not waited on: a store wait that times out logs torch's warnings each time)
                if self.store.check([key]) and int(self._opened(key)) >= self.seq:
                    return True
            except (dist.DistError, WeightSyncError, ValueError):
                pass  # not there yet, or not the worker's
            if remaining(deadline) <= 0:
                return False
            time.sleep(min(TAKEN_POLL_S, max(remaining(deadline), 0.0)))

    def expect_ack(self, version: int) -> None:
        """Post the receive of the ack of the message announced last (every part of it sent)."""
        pg, _ = self._group()
        assert self._waiter is not None
        ack = torch.zeros(3 + ACK_TAG_WORDS, dtype=torch.int64, device=self.device)
        self.pending.append(_Pending(self.seq, version, ack, self._waiter.watch(pg.recv([ack], self.rank, TAG_ACK))))

    def take_ack(self) -> tuple[_Pending, int, int] | None:
        """The oldest pending ack as (pending, held version, status), if it arrived already.

        Raises:
            WorkerDiedError: the worker's rank went away.
            ConnectionClosedError: an ack out of order.
            AuthenticationError: an ack without the run key's tag (a process that took the worker's rank).
        """
        if not self.pending or not self.pending[0].done.done():
            return None
        head = self.pending.popleft()
        try:
            head.done.result()
        except (RuntimeError, CancelledError) as exc:
            raise WorkerDiedError(
                f"its rank {self.rank} went away ({first_line(exc)})", **self._where(head.version)
            ) from None
        seq, held, status, *tag = (int(x) for x in head.ack.tolist())
        if not hmac.compare_digest(
            struct.pack(">4q", *tag), struct.pack(">4q", *self.sealer.ack_tag(self.worker_idx, seq, held, status))
        ):
            raise AuthenticationError(
                f"an ack from rank {self.rank} without the run key's tag: a process that does not hold the key "
                "took this worker's place in the group",
                **self._where(head.version),
            )
        if seq != head.seq:
            raise ConnectionClosedError(
                f"ack out of order: expected message {head.seq}, got {seq}", **self._where(head.version)
            )
        return head, held, status

    def waiting_on(self) -> Future | None:
        """The future of the oldest ack still awaited, if any."""
        return self.pending[0].done if self.pending else None

    def error_detail(self, seq: int) -> dict[str, str]:
        """What the worker wrote about its failure to apply message ``seq``."""
        try:
            store = self.store
            if store.check([f"err/{self.worker_idx}/{seq}"]):
                detail = store_json(store, f"err/{self.worker_idx}/{seq}")
                return {"type": str(detail.get("type", "Error"))[:200], "message": str(detail.get("message", ""))}
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
            store_set(self.store, key, self.sealer.seal(key, "1"))
        self._last_word({"dropped": reason[:MAX_ERROR_TEXT]})
        self.stop_waiting(0.0)

    def _last_word(self, msg: dict[str, Any]) -> None:
        # The store is the sender's own (or its job's): writing to it does not depend on the worker's link.
        with contextlib.suppress(LifecycleError, dist.DistError):
            key = f"msg/{self.worker_idx}/{self.seq + 1}"
            store_set(self.store, key, self.sealer.seal(key, json.dumps(msg)))
            ring(self.store, self.bell_key, last=True)

    def stop_waiting(self, timeout: float) -> None:
        """End the waiter thread; one still blocked on a stalled peer ends at gloo's operation timeout."""
        if self._waiter is not None and not self._waiter.close(timeout):
            log.warning(
                "worker %d (rank %d) has not answered an operation in progress; its waiter thread ends when the "
                "process group times it out",
                self.worker_idx,
                self.rank,
            )
        self._waiter = None
        self.pending.clear()

    # --------------------------------------------------------------- receiver
    def next_message(self, timeout: float) -> dict[str, Any] | None:
        """The next announcement for this worker, waiting up to ``timeout``; ``None`` if none came. It takes it from
        the ring of its doorbell that carried it (sealed), else looks at the store when the doorbell rings, and
        every :data:`LOOK_AGAIN_S` at least.

        Returns one of ``{"version": int, "nonce": str, "mac": str}`` (with ``"delta"``, the description of the
        changes its one part holds; with ``"taken": True``, the sender waits for :meth:`say_taken`),
        ``{"closed": True}``, ``{"dropped": str}``.

        Raises:
            AuthenticationError: the announcement is not sealed with the run key.
            TransportError: it is not one of these.
        """
        _, store = self._group()
        key = f"msg/{self.worker_idx}/{self.seq + 1}"
        deadline = deadline_after(timeout)
        try:
            while True:
                rang = self.bell.rings if self.bell is not None else 0  # counted before the look: none is missed
                # The copy the sender's ring carried, if one did and it opens under this key.
                raw = self.bell.take(lambda said: self.sealer.open(said, key)) if self.bell is not None else None
                if raw is None and timeout <= 0 and self._no_ring_since_looked(rang):
                    return None
                self._looked = (rang, time.monotonic())  # every ring counted so far was looked past
                if raw is not None:
                    break
                if store.check([key]):
                    raw = store.get(key)
                    break
                if remaining(deadline) <= 0:
                    return None
                pause = min(LOOK_AGAIN_S, remaining(deadline))
                if self.bell is not None and self.bell.ended is None:
                    self.bell.wait(rang, pause)
                else:  # no bell, or it stopped listening: periodic looks
                    time.sleep(pause)
        except dist.DistError as exc:
            raise ConnectionClosedError(f"the sender's store went away ({first_line(exc)})", **self._where()) from None
        self._spent.append(key)
        msg = checked_announcement(self.sealer.open(raw, key, **self._where()), key, **self._where())
        self.seq += 1
        return msg

    def _no_ring_since_looked(self, rang: int) -> bool:
        """Whether a look in the store for the next message can be skipped: the bell listens and has not rung since
        the last look, under :data:`LOOK_AGAIN_S` ago (a ring a stranger took away delays its message that long)."""
        if self.bell is None or self.bell.ended is not None:
            return False
        count, when = self._looked
        return rang == count and time.monotonic() - when < LOOK_AGAIN_S

    def hang_up(self) -> None:
        """Stop listening for the doorbell (the worker closes, or rejoined through a new transport)."""
        if self.bell is not None:
            self.bell.close(self.link.store)
            self.bell = None

    def receive_into(
        self, parts: list[torch.Tensor], timeout: float, version: int | None, mac: PayloadMac | None = None
    ) -> None:
        """Receive the parts of the message just announced (or the initial weights), in order, within ``timeout``;
        ``mac`` hashes each part as it arrives (while the next ones are on the wire). The parts tile its buffer."""
        pg, _ = self._group()
        deadline = deadline_after(timeout)
        arrived = 0
        try:
            works = [pg.recv([part], 0, TAG_DATA) for part in parts]  # posted at once: parts arrive in order
            if mac is not None:
                mac.begin()  # while the first part is on its way
            for part, work in zip(parts, works):
                work.wait(as_timedelta(max(remaining(deadline), 0.001)))
                arrived += part.numel()
                if mac is not None:
                    mac.ready(arrived)
        except RuntimeError as exc:
            if is_timeout(exc):
                raise SyncTimeoutError("the announced update did not arrive in time", **self._where(version)) from None
            raise ConnectionClosedError(f"the sender went away ({first_line(exc)})", **self._where(version)) from None

    def say_taken(self) -> None:
        """Tell the sender the message received last is here, checked (one key per worker, overwritten: nothing
        piles up in the store); a store that went away is left to the next read of it to report."""
        key = f"taken/{self.worker_idx}"
        try:
            store_set(self.store, key, self.sealer.seal(key, str(self.seq)))
        except dist.DistError as exc:
            log.debug("could not say message %d was taken: %s", self.seq, first_line(exc))

    def was_dropped(self) -> bool:
        """Whether the sender dropped this worker: asked once a message arrived whole (unless its bytes check against
        the digest sealed in its announcement), so that bytes sent from a buffer the sender reused after dropping it
        are never applied."""
        key = f"dropped/{self.worker_idx}"
        try:
            if not self.store.check([key]):
                return False
            self._opened(key)  # a word from anyone else is refused, not obeyed
        except dist.DistError as exc:
            raise ConnectionClosedError(f"the sender's store went away ({first_line(exc)})", **self._where()) from None
        return True

    def expected_digest(self, seq: int, version: int, timeout: float) -> str:
        """The sender's keyed digest of message ``seq`` (version ``version``): set once every bucket was written,
        it may follow the data.

        Raises:
            ConnectionClosedError: none came within ``timeout`` (a sender gone, or a rank 0 that is not it).
            AuthenticationError: it is not sealed with the run key for this message and version.
        """
        key, store = f"digest/{self.worker_idx}/{seq}", self.store
        try:
            store.wait([key], as_timedelta(timeout))
            raw = store.get(key)
        except dist.DistError as exc:
            raise ConnectionClosedError(
                f"no digest from the sender ({first_line(exc)}); nothing was applied", **self._where(version)
            ) from None
        self._spent.append(key)
        return self.sealer.open(raw, key, version, **self._where(version)).decode("ascii", "replace")

    def sweep(self) -> None:
        """Delete the store keys of the messages read since the last sweep (announcements, digests): after the ack,
        so that a store round trip each costs the update nothing; a store that went away is left to the next
        read of it to report."""
        spent, self._spent = self._spent, []
        try:
            for key in spent:
                self.store.delete_key(key)
        except dist.DistError as exc:
            log.debug("could not delete %d spent store keys: %s", len(spent), first_line(exc))

    def initial_message(self, timeout: float) -> dict[str, Any]:
        """What the initial weights are: ``{"version", "nonce", "mac"}``, sealed by the sender before it sent them.

        Raises:
            AuthenticationError: not sealed with the run key. TransportError: not what a sender writes there.
            ConnectionClosedError: not there within ``timeout``.
        """
        try:
            self.store.wait(["initial"], as_timedelta(timeout))
            content = self._opened("initial")
        except dist.DistError as exc:
            raise ConnectionClosedError(
                f"the sender named no initial version ({first_line(exc)})", **self._where()
            ) from None
        msg = checked_announcement(content, "initial", **self._where())
        if "version" not in msg:
            raise TransportError("store key 'initial' names no version; refusing it", **self._where())
        return msg

    def receive_weights(self, timeout: float | None = None, **kwargs: Any) -> Any:
        raise LifecycleError("a distributed worker receives with scheme.receive()")

    def send_ack(
        self, version: int, error: BaseException | None = None, held: int | None = None, *, seqs: tuple[int, ...] = ()
    ) -> None:
        """Ack messages ``seqs`` (the last one received when empty): ``held`` is the version now held."""
        pg, store = self._group()
        for seq in seqs or (self.seq,):
            status = ACK_OK if error is None else ACK_FAILED
            if error is not None:
                detail = {"type": type(error).__name__, "message": str(error)[:MAX_ERROR_TEXT]}
                try:
                    store.set(f"err/{self.worker_idx}/{seq}", json.dumps(detail))
                except dist.DistError as exc:  # the ack below still says it failed; only the details are lost
                    log.warning("could not write why message %d failed: %s", seq, first_line(exc))
            words = [seq, -1 if held is None else held, status]
            tagged = words + self.sealer.ack_tag(self.worker_idx, *words)
            ack = torch.tensor(tagged, dtype=torch.int64, device=self.device)
            try:
                pg.send([ack], 0, TAG_ACK).wait(as_timedelta(self.timeout))
            except RuntimeError as exc:
                raise ConnectionClosedError(
                    f"the sender went away ({first_line(exc)})", **self._where(version)
                ) from None

    def check_connection(self) -> bool:
        return super().check_connection() and self.link.pg is not None
