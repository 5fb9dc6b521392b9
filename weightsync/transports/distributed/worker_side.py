"""A worker's side of :class:`~.transport.DistributedTransport`: where its messages come from (its line, else
its doorbell and the store), where their bytes come from (the line, or the group), and its acks."""

from __future__ import annotations

import json
import logging
import math
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...core.timing import as_timedelta, deadline_after, remaining
from ...errors import ConnectionClosedError, SyncTimeoutError, TransportError, WeightSyncError, first_line
from ..store import store_read, store_set, store_value
from ..storeclient import StoreCalls, Unanswered
from .auth import PayloadMac, Unverifiable
from .doorbell import MAX_SAID_BYTES
from .group import is_timeout
from .line import ACK, PeerClosed
from .messages import checked_announcement, sealed_word

if TYPE_CHECKING:
    from .auth import Sealer
    from .doorbell import Doorbell
    from .group import Link
    from .line import Line

__all__ = ["ACK_FAILED", "ACK_OK", "ANSWER_S", "LOOK_AGAIN_S", "MAX_ERROR_TEXT", "WorkerSide"]

log = logging.getLogger("weightsync.transports.distributed")

TAG_DATA, TAG_ACK = 1, 2
ACK_OK, ACK_FAILED = 0, 1
#: The longest error message a worker leaves in the store for the sender.
MAX_ERROR_TEXT = 4000
#: A worker waiting for the next announcement looks at the store when its doorbell rings (:mod:`.doorbell`), and
#: at least this often: a ring lost, or taken away by a stranger, delays it this long at most.
LOOK_AGAIN_S = 0.1
#: The longest a look at the store holds a receive past its own timeout: a store that has not answered by then
#: (its process stopped: a debugger, ``SIGSTOP``) is taken to say nothing yet. The worker's store calls are made
#: on a thread of their own (:class:`~..store.StoreCalls`), each waited for within the receive's bounds.
ANSWER_S = 0.25
#: How long after its line's end a worker still looks in the store for its sender's word that it dropped it or
#: shut down, before it takes the sender for gone. A sender alive writes its word before it ends a line, but
#: torch's set waits for no answer, and a store on another host may take it after the worker's look (a lost
#: packet is sent again 0.2 s or more later). The wait is spread over the receives made meanwhile, each within its
#: own bound (each returns nothing until then); the sender waits for no answer of the store instead, since it
#: makes no call that waits on the store while it sends (a job's store that stopped would hold it).
WORD_LATE_S = 1.5


class WorkerSide:
    """The worker's calls of its transport (the transport holds the state they use)."""

    if TYPE_CHECKING:
        worker_idx: int
        seq: int
        timeout: float
        device: torch.device
        link: Link
        bell: Doorbell | None
        line: Line | None
        line_lost: bool
        line_ended: float | None
        group_closed: bool
        _inline: bool
        _looked: tuple[int, float]
        _spent: list[str]
        calls: StoreCalls

        def _group(self) -> tuple[Any, dist.Store]: ...
        def _where(self, version: int | None = None) -> dict[str, Any]: ...
        def _opened(self, key: str, version: int | None = None) -> bytes: ...
        @property
        def sealer(self) -> Sealer: ...
        @property
        def store(self) -> dist.Store: ...

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
        if self.line is not None:
            return self._next_on_line(key, timeout)
        if self.line_lost:
            return self._last_word_after_line(timeout)
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
                try:
                    raw = self.calls.ask(
                        lambda: store_read(store, key),
                        max(deadline, deadline_after(ANSWER_S)),
                        "a look for the next announcement",
                        key=key,
                        **self._where(),
                    )
                except Unanswered:
                    return None
                if raw is not None:
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

    def _next_on_line(self, key: str, timeout: float) -> dict[str, Any] | None:
        """:meth:`next_message`, on the worker's line: a line that ends without the sender's last word on it was
        closed by a sender that dropped this worker (the store says so: it then asks to rejoin), or that died."""
        assert self.line is not None
        deadline = deadline_after(timeout)
        try:
            if not self.line.readable(timeout):
                return None
            raw = self.line.frame(deadline_after(self.timeout), MAX_SAID_BYTES)
        except ConnectionClosedError as exc:
            self.hang_up(ended=isinstance(exc, PeerClosed))
            # (its end read: asked within this receive's bound, one look, ANSWER_S at least; a silence is retried)
            within = max(deadline, deadline_after(ANSWER_S)) if isinstance(exc, PeerClosed) else None
            if self.was_dropped(failed=exc, deadline=within):
                return {"dropped": "the sender closed this worker's line"}
            if isinstance(exc, PeerClosed):  # (its word may land in the store late: asked on, in this receive's time)
                return self._last_word_after_line(remaining(deadline)) if remaining(deadline) > 0 else None
            raise ConnectionClosedError(f"the sender went away ({first_line(exc)})", **self._where()) from None
        except SyncTimeoutError:
            self.hang_up()
            raise SyncTimeoutError("the sender's announcement did not arrive whole in time", **self._where()) from None
        msg = checked_announcement(self.sealer.open(raw, key, **self._where()), key, **self._where())
        self.seq += 1
        self._inline = bool(msg.get("inline"))
        return msg

    def _last_word_after_line(self, timeout: float) -> dict[str, Any] | None:
        """:meth:`next_message` once this worker hung up its line (what came on it stopped midway: a link down; or
        its end was read while the store did not answer, or held no word yet): nothing more is announced to it, on
        the line or in the store. What it waits for, in the store, is the sender's word that it dropped this worker
        (``dropped/<w>``: no ack came), or that it shut down. Where the line's end was read, a store that still
        answers without either word :data:`WORD_LATE_S` after is a sender gone: a sender alive writes its word
        before it ends a line (raised: ConnectionClosedError)."""
        deadline = deadline_after(timeout)

        def last_word() -> tuple[dict[str, Any] | None, float]:  # (and when it was asked: an answer may come late)
            asked = time.monotonic()
            if self._said_dropped():
                return {"dropped": "what came on its line stopped midway, and it did not ack in time"}, asked
            if sealed_word(self.sealer, self.store, "shutdown", **self._where()):
                return {"closed": True}, asked
            return None, asked

        try:
            while True:
                try:
                    word, asked = self.calls.ask(
                        last_word,
                        max(deadline, deadline_after(ANSWER_S)),
                        "a look for its word",
                        key="last word",
                        **self._where(),
                    )
                except Unanswered:
                    return None
                if word is not None:
                    return word
                # Only a look made after the grace decides (the answer to one made before may come however late).
                if self.line_ended is not None and asked >= self.line_ended + WORD_LATE_S:
                    raise ConnectionClosedError(
                        "the sender went away (it ended this worker's line, and its store holds no word of why)",
                        **self._where(),
                    )
                if remaining(deadline) <= 0:
                    return None
                grace = math.inf if self.line_ended is None else remaining(self.line_ended + WORD_LATE_S)
                time.sleep(min(LOOK_AGAIN_S, remaining(deadline), max(grace, 0.0)))
        except dist.DistError as exc:
            raise ConnectionClosedError(f"the sender's store went away ({first_line(exc)})", **self._where()) from None

    def _no_ring_since_looked(self, rang: int) -> bool:
        """Whether a look in the store for the next message can be skipped: the bell listens and has not rung since
        the last look, under :data:`LOOK_AGAIN_S` ago (a ring a stranger took away delays its message that long)."""
        if self.bell is None or self.bell.ended is not None:
            return False
        count, when = self._looked
        return rang == count and time.monotonic() - when < LOOK_AGAIN_S

    def hang_up(self, ended: bool = False) -> None:
        """Stop listening for the doorbell, and close the line (the worker closes, or rejoined through a new
        transport). ``ended``: the sender's end of the line was read (a sender alive says why in the store first:
        :attr:`line_ended` is when)."""
        if self.bell is not None:
            self.bell.close()
            self.bell = None
        if self.line is not None:
            self.line.close(0.0)
            self.line = None
            self.line_lost = True
            self.line_ended = time.monotonic() if ended else None

    def receive_into(
        self,
        parts: list[torch.Tensor],
        timeout: float,
        version: int | None,
        mac: PayloadMac | Unverifiable | None = None,
    ) -> None:
        """Receive the parts of the message just announced (or the initial weights), in order, within ``timeout``;
        ``mac`` hashes each part as it arrives (while the next ones are on the wire). The parts tile its buffer."""
        pg, _ = self._group()
        deadline = deadline_after(timeout)
        if self._inline:
            self._inline = False
            self._read_inline(parts, deadline, version, mac)
            return
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
            if is_timeout(exc):  # (gloo closed the connection at that wait's timeout: nothing comes over it again)
                self.group_closed = True
                raise SyncTimeoutError("the announced update did not arrive in time", **self._where(version)) from None
            raise ConnectionClosedError(f"the sender went away ({first_line(exc)})", **self._where(version)) from None

    def _read_inline(
        self, parts: list[torch.Tensor], deadline: float, version: int | None, mac: PayloadMac | Unverifiable | None
    ) -> None:
        """The bytes of the message just announced, off the line (they follow its announcement there)."""
        if self.line is None:
            raise ConnectionClosedError("the sender went away (its line closed)", **self._where(version))
        if mac is not None:
            mac.begin()
        try:
            self.line.read_into([p.numpy().data.cast("B") for p in parts], deadline, mac.ready if mac else None)
        except SyncTimeoutError:
            self.hang_up()
            raise SyncTimeoutError("the announced update did not arrive in time", **self._where(version)) from None
        except ConnectionClosedError as exc:  # (one its peer ended stays a PeerClosed: WorkerSide.was_dropped)
            self.hang_up(ended=isinstance(exc, PeerClosed))
            closed = PeerClosed if isinstance(exc, PeerClosed) else ConnectionClosedError
            raise closed(f"the sender went away ({first_line(exc)})", **self._where(version)) from None

    def say_taken(self) -> None:
        """Tell the sender the message received last is here, checked (one key per worker, overwritten: nothing
        piles up in the store); a store that went away is left to the next read of it to report."""
        key, store, seq = f"taken/{self.worker_idx}", self.store, self.seq
        sealed = self.sealer.seal(key, str(seq))

        def write() -> None:  # (torch's set waits for no answer; made after the calls before it, never waited for)
            try:
                store_set(store, key, sealed)
            except dist.DistError as exc:
                log.debug("could not say message %d was taken: %s", seq, first_line(exc))

        self.calls.post(write)

    def was_dropped(self, failed: WeightSyncError | None = None, deadline: float | None = None) -> bool:
        """Whether the sender dropped this worker: asked once a message arrived whole (unless its bytes check against
        the digest sealed in its announcement), so that bytes sent from a buffer the sender reused after dropping it
        are never applied; and once what came from the sender (or went to it) ``failed``: its line, its group. A
        store that does not answer then either is a sender gone (``False``), unless ``failed`` is the line's end,
        read or met by a write (:class:`PeerClosed`): a host was there to end it, so the sender is stopped (its
        process, serving the store, would refuse at once had it died), and :class:`Unanswered` is raised.
        ``deadline``: the look's (default: the scheme's ``timeout`` from now).

        Raises:
            Unanswered: the store did not answer by ``deadline`` (its process stopped).
            ConnectionClosedError: it went away. (A word not sealed with the run key is not obeyed: `sealed_word`.)
        """
        try:
            within = deadline_after(self.timeout) if deadline is None else deadline
            return self.calls.ask(self._said_dropped, within, "whether it dropped this worker", **self._where())
        except Unanswered:
            if failed is not None and not isinstance(failed, PeerClosed):
                return False
            raise
        except dist.DistError as exc:
            raise ConnectionClosedError(f"the sender's store went away ({first_line(exc)})", **self._where()) from None

    def _said_dropped(self) -> bool:
        """:meth:`was_dropped`, asked of the store by the caller."""
        return sealed_word(self.sealer, self.store, f"dropped/{self.worker_idx}", **self._where())

    def expected_digest(self, seq: int, version: int, timeout: float) -> str:
        """The sender's keyed digest of message ``seq`` (version ``version``): set once every bucket was written,
        it may follow the data.

        Raises:
            ConnectionClosedError: none came within ``timeout`` (a sender gone, or a rank 0 that is not it).
            AuthenticationError: it is not sealed with the run key for this message and version.
        """
        key, store = f"digest/{self.worker_idx}/{seq}", self.store

        def digest() -> bytes:
            store.wait([key], as_timedelta(timeout))
            return store_value(store, key)

        try:  # (torch's wait may outlast its timeout by a store round trip, with no bound if the store is stopped)
            raw = self.calls.ask(digest, deadline_after(timeout + ANSWER_S), "its digest", **self._where(version))
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
        spent, self._spent, store = self._spent, [], self.store

        def delete() -> None:
            try:
                for key in spent:
                    store.delete_key(key)
            except dist.DistError as exc:
                log.debug("could not delete %d spent store keys: %s", len(spent), first_line(exc))

        if spent:
            self.calls.post(delete)

    def initial_message(self, timeout: float) -> dict[str, Any]:
        """What the initial weights are: ``{"version", "nonce", "mac"}``, sealed by the sender before it sent them.

        Raises:
            AuthenticationError: not sealed with the run key. TransportError: not what a sender writes there.
            ConnectionClosedError: not there within ``timeout``.
        """

        def initial() -> bytes:
            self.store.wait(["initial"], as_timedelta(timeout))
            return self._opened("initial")

        try:
            content = self.calls.ask(
                initial, deadline_after(timeout + ANSWER_S), "the initial version", **self._where()
            )
        except dist.DistError as exc:
            raise ConnectionClosedError(
                f"the sender named no initial version ({first_line(exc)})", **self._where()
            ) from None
        msg = checked_announcement(content, "initial", **self._where())
        if "version" not in msg:
            raise TransportError("store key 'initial' names no version; refusing it", **self._where())
        return msg

    def _write_why(self, store: dist.Store, key: str, sealed: bytes) -> None:
        """Leave why a message failed in the store at ``key`` (made on the calls' thread); a store that went away
        loses the details only: the ack still says it failed."""
        try:
            store_set(store, key, sealed)
        except dist.DistError as exc:
            log.warning("could not write why a message failed (%s): %s", key, first_line(exc))

    def send_ack(
        self, version: int, error: BaseException | None = None, held: int | None = None, *, seqs: tuple[int, ...] = ()
    ) -> None:
        """Ack messages ``seqs`` (the last one received when empty): ``held`` is the version now held."""
        pg, store = self._group()
        for seq in seqs or (self.seq,):
            status = ACK_OK if error is None else ACK_FAILED
            if error is not None:
                detail = {"type": type(error).__name__, "message": str(error)[:MAX_ERROR_TEXT]}
                # (sealed: the sender acts on its type; looked for once the ack came, as torch's set waits for
                # no answer)
                key = f"err/{self.worker_idx}/{seq}"
                self.calls.post(partial(self._write_why, store, key, self.sealer.seal(key, json.dumps(detail))))
            words = [seq, -1 if held is None else held, status]
            tagged = words + self.sealer.ack_tag(self.worker_idx, *words)
            if self.line_lost:  # (its sender reads acks on the line only: they are lost)
                log.info("worker %d: its ack of version %d not sent: its line is closed", self.worker_idx, version)
                return
            if self.line is not None:
                try:
                    self.line.send(ACK.pack(*tagged), self.timeout)
                except (ConnectionClosedError, SyncTimeoutError) as exc:
                    self._ack_not_sent(exc, version)
                    return
                continue
            try:
                ack = torch.tensor(tagged, dtype=torch.int64, device=self.device)
                pg.send([ack], 0, TAG_ACK).wait(as_timedelta(self.timeout))
            except (RuntimeError, WeightSyncError) as exc:
                raise ConnectionClosedError(
                    f"the sender went away ({first_line(exc)})", **self._where(version)
                ) from None

    def _ack_not_sent(self, exc: WeightSyncError, version: int) -> None:
        """An ack the line could not carry: what was applied stays applied, unacked. A line its sender ended is
        still read: the messages it sent before its end, then the end itself, which the next receives meet as any
        read of a line's end (:meth:`_next_on_line`: the sender dropped this worker, is stopped, or went away).
        A line whose sender reads nothing is hung up: that sender is stopped.

        Raises:
            ConnectionClosedError: the line failed otherwise, and the sender went away (its store does not say
                it dropped this worker).
        """
        log.info("worker %d: its ack of version %d not sent: %s", self.worker_idx, version, first_line(exc))
        if isinstance(exc, PeerClosed):
            return
        self.hang_up()
        if isinstance(exc, SyncTimeoutError) or self.was_dropped(failed=exc):  # (dropped: the next receive rejoins)
            return
        raise ConnectionClosedError(f"the sender went away ({first_line(exc)})", **self._where(version)) from None
