"""A worker's side of the torch.distributed engine: join the store and the group, receive into buffers of
its own, ack over the group.

A worker receives every bucket of a message into a buffer its model does not read, and the update is applied only
once all of it arrived. A CPU model (in its own dtype, not in shared memory) then takes that buffer as its memory
and the next message lands in the other buffer, which holds the memory the model left: the model's buffer and the
one in flight, two in all.

Nothing read from the store is acted on unless the sender sealed it with the run key (the layout, the verdicts, the
initial version, announcements, digests, the word that this worker was dropped): anyone who reaches the store can
write there. The bytes of each update are hashed with the run key as they arrive, and an update whose digest differs
from the one the sender sealed reaches the model as a refusal (acked as failed, nothing applied): a rank 0 that is
not the sender cannot make this worker apply anything.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ...core.engine import Delivery, ReceiverEngine
from ...core.timing import deadline_after, remaining
from ...errors import (
    AuthenticationError,
    ConfigurationError,
    ConnectionClosedError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
    first_line,
)
from ...tensors.delta import Chunk, Delta, body_size, chunks_of
from ...tensors.layout import FlatLayout
from ..keyfiles import ORPHAN_GRACE_S, read_key_file, remove_key_file_if_orphaned
from ..processes import process_identity
from ..store import SILENT_TIMEOUTS, await_key
from ..storeclient import StoreCalls, dial_store, hung_up_at
from .auth import NO_BYTES, PayloadMac, Sealer, Unverifiable, new_nonce, proof, worker_prefix
from .doorbell import Doorbell, dial_doorbell
from .group import GROUP_TIMEOUT_FACTOR, Link, gpu_identity, new_group_within
from .line import Dialing, Line, PeerClosed
from .messages import addressed, sealed_layout, sealed_object
from .rejoins import ask_to_rejoin
from .settings import DistributedSettings
from .transport import MAX_ERROR_TEXT, DistributedTransport
from .worker_side import ANSWER_S

__all__ = ["DistributedReceiver"]

#: What a worker without the run key file is told.
NO_KEY = (
    'copy the run key file from the trainer\'s host, with the receiver config (docs/multinode.md, "The run key"), '
    "or name where this host keeps it: init_on_receiver(authkey_file=...); or the trainer has shut down"
)

log = logging.getLogger("weightsync.transports.distributed")


class DistributedReceiver(ReceiverEngine):
    """The worker's store client, group, receive buffers and transport. Each update is checked against the sender's
    keyed digest, whatever the scheme's ``checksum``.

    Args:
        handoff: ``master_addr``, ``master_port``, ``prefix``, ``world_size``.
        settings: the transport's (``backend``, ``bucket_mb``: the sender's, which the buffers are received in).
        take: the model may be moved to memory of weightsync's (not in shared memory, and no ``keep_storage``):
            it takes the buffer an update arrived in where that buffer is on the model's device, else it is bound
            to one buffer on its device that each update is copied into, one copy per bucket; decided once the
            layout says whether weights travel in their own dtype.
        where: ``model_id`` and ``worker_idx``.
        model_device: the device every weight of the worker's model is on (``None``: several).
    """

    def __init__(
        self,
        handoff: dict[str, Any],
        settings: DistributedSettings,
        *,
        take: bool,
        where: dict[str, Any],
        model_device: torch.device | None = None,
    ) -> None:
        if not (handoff.get("authkey") or handoff.get("authkey_file")) or not handoff.get("master_addr"):
            raise ConfigurationError(
                "this receiver does not know its sender: hand it the scheme pickled after init_on_sender(), "
                "or its receiver_config(worker_idx) and the run key file it names",
                model_id=where["model_id"],
            )
        w, workers = where["worker_idx"], int(handoff.get("world_size", 0)) - 1
        if not 0 <= w < workers:  # (its hello would be one the sender never reads: it waited its whole bound)
            raise ConfigurationError(f"worker_idx {w} is not a worker of its sender (0..{workers - 1})", **where)
        self.handoff = handoff
        self._key = bytes.fromhex(handoff.get("authkey") or read_key_file(handoff["authkey_file"], NO_KEY, **where))
        self._key_file = None if handoff.get("authkey") else handoff["authkey_file"]  # swept once its sender died
        self.prefix = worker_prefix(self._key, handoff.get("run"), **where)
        self.sealer = Sealer(self._key, self.prefix)
        self._layout_tag = b""
        self.settings, self.device = settings, settings.device
        self._take, self.where, self.model_device = take, where, model_device
        #: The longest one update may take (the core's, given at :meth:`join`).
        self.update_timeout = 0.0
        self.transport: DistributedTransport | None = None
        self.num_workers: int | None = None
        self._buffers: list[torch.Tensor] = []
        self._views: list[dict[str, torch.Tensor]] = []
        self._at = 0  # the buffer the next message lands in
        self._buckets: list[tuple[int, int, int, int]] = []
        self._chunks: list[Chunk] = []  # how the layout is cut for changes sent against the version held
        self._body = torch.empty(0, dtype=torch.uint8)  # where changes land (grown to the largest)
        self._initial = True  # the initial weights come without an announcement
        self._closed: str | None = None  # why the sender is done with this worker: it shut down, or went away
        self._stores: tuple[dist.Store, dist.Store] | None = None
        self._dropped: str | None = None  # why the sender dropped this worker, until it rejoined
        self._say_taken = False  # the message taken last asked to hear when it is ready to apply
        self._hello: dict[str, Any] = {}  # what this worker told the sender, said again when it rejoins
        self._calls: StoreCalls | None = None  # where the store client's calls on a receive's path are made

    def _group_timeout(self, deadline: float) -> float:
        return max(remaining(deadline), GROUP_TIMEOUT_FACTOR * self.update_timeout)

    def join(self, deadline: float, check: Callable[[FlatLayout], Any], update_timeout: float) -> None:
        self.update_timeout = update_timeout
        where = self.where
        host, port = self.handoff["master_addr"], int(self.handoff["master_port"])
        # A sender's host that vanishes fails the worker's next store call instead of blocking it for good.
        silence = SILENT_TIMEOUTS * self.update_timeout
        base, hangup = dial_store(host, port, remaining(deadline), silence=silence, **where)
        # Its calls on a receive's path are made on a thread of their own, each waited for within the receive's
        # bounds: a sender's process that is stopped leaves them unanswered, with no bound.
        self._calls = StoreCalls(hangup, f"weightsync-{where['model_id']}-store{where['worker_idx']}")
        store = dist.PrefixStore(self.prefix, base)
        # The rest of the join asks the store too, as a stopped sender leaves it: past the deadline, it hangs up.
        met = None
        try:
            with hung_up_at(hangup, deadline, "joining the sender", **where):
                met = self._meet(store, deadline, check)
        except BaseException:
            if met is not None and met[1] is not None:  # (met, and too late: its line is closed)
                met[1].close(0.0)
            raise
        link, line, hello, refusal = met
        assert self.layout is not None  # (read in the meeting)
        self._hello = hello
        self._stores = (base, store)
        if refusal is not None:
            if line is not None:
                line.close(0.0)
            raise refusal
        self.transport = DistributedTransport(
            where["worker_idx"],
            link=link,
            device=self.device,
            timeout=self.update_timeout,
            model_id=where["model_id"],
            bell=self._doorbell(link, remaining(deadline)) if line is None else None,
            line=line,
            calls=self._calls,
        )
        self.placement = self._placement()
        # A model that takes the buffer an update arrived in leaves the other one for the next update.
        for _ in range(2 if self.placement == "take" else 1):
            self._buffers.append(torch.empty(self.layout.nbytes, dtype=torch.uint8, device=self.device))
            self._views.append(self.layout.views(self._buffers[-1]))
        self._buckets = self.layout.buckets(self.settings.bucket_bytes)
        self._chunks = chunks_of(self.layout)

    def _meet(
        self, store: dist.Store, deadline: float, check: Callable[[FlatLayout], Any]
    ) -> tuple[Link, Line | None, dict[str, Any], WeightSyncError | None]:
        """The join's rendez-vous in the sender's ``store``: the layout read and checked, this worker's hello, then
        its line and group (a first start), or a pair group (a restart). Returns the link, the line (if the sender
        took one), the hello, and why this worker refuses or is refused (``None``: neither)."""
        where = self.where
        host, port = self.handoff["master_addr"], int(self.handoff["master_port"])
        line: Line | None = None
        try:
            total = remaining(deadline)
            await_key(store, "layout", deadline, total, f"the sender's store at {host}:{port} to hold its run", **where)
            self.layout, self._layout_tag = sealed_layout(self.sealer, store, **where)
            refusal = check(self.layout)
            hello: dict[str, Any] = {"ok": True}
            if refusal is not None:
                hello = {"ok": False, "type": type(refusal).__name__, "message": str(refusal)[:MAX_ERROR_TEXT]}
            # (the verdict names it by its nonce; "receiver": its own, which another receiver of this process lacks)
            hello["process"], hello["nonce"] = {**process_identity(), "receiver": new_nonce()}, new_nonce()
            if self.settings.backend == "nccl":
                hello["gpu"] = gpu_identity()
            world = int(self.handoff["world_size"])
            self.num_workers = world - 1
            w = where["worker_idx"]
            gen = int(store.add(f"gen/{w}", 1))  # how many processes have connected as worker w, this one included
            if gen == 1:
                link = Link(store=store, sealer=self.sealer)
                store.set(f"hello/{w}", json.dumps({**hello, "proof": proof(self._key, w, gen, hello)}))
                dialing = self._dial(store, deadline)  # answered while the sender takes lines, before its verdict
                try:
                    await_key(store, "verdict", deadline, total, "the sender's rendez-vous with every worker", **where)
                    verdict = sealed_object(self.sealer, store, "verdict", **where)
                    reason = verdict.get(str(w))
                    if reason is not None and not isinstance(reason, str):
                        raise TransportError("store key 'verdict' holds no reason for this worker; refuses it", **where)
                    if reason is None:
                        addressed(verdict, "verdict", hello["nonce"], **where)
                except BaseException:
                    if dialing is not None:
                        dialing.cancel()
                    raise
                taken = isinstance(verdict.get("lines"), list) and w in verdict["lines"]
                line = dialing.line(taken) if dialing is not None else None
                # Every worker joins the group, even one that refused: the group forms only with all of them.
                group = (self.settings.backend, store, w + 1, world, self._group_timeout(deadline), host)
                link.pg = new_group_within(deadline, "the sender's process group", *group, **where)
            else:  # a restart: a two-rank group of its own with the sender, if the sender lets it in
                link, reason = self._pair(store, gen, hello, deadline)
                if reason is not None and refusal is None:
                    reason = f"the sender refused this worker: {reason}"
            if reason is not None and refusal is None:
                refusal = ConfigurationError(str(reason), **where)
        except BaseException as exc:
            if line is not None:  # (the sender took it, and the group did not form)
                line.close(0.0)
            if isinstance(exc, dist.DistError):
                raise SyncTimeoutError(f"could not join the sender's group: {first_line(exc)}", **where) from None
            raise
        return link, line, hello, refusal

    def _dial(self, store: dist.Store, deadline: float) -> Dialing | None:
        """This worker's line to the sender (:mod:`.line`), at the address it sealed; ``None``: none (doorbell)."""
        try:
            at = sealed_object(self.sealer, store, "line", **self.where)
            address = (str(at["host"]), int(at["port"]))
        except (KeyError, TypeError, ValueError, dist.DistError, WeightSyncError) as exc:
            log.debug("worker %d: the sender named no line (%s)", self.where["worker_idx"], first_line(exc))
            return None
        name, timeout, w = f"weightsync-{self.where['model_id']}-line", self.update_timeout, self.where["worker_idx"]
        silence = SILENT_TIMEOUTS * timeout  # a sender's host that vanished fails the wait for its next word
        return Dialing(address, self._key, self.prefix, w, deadline, lambda sock: Line(sock, name, timeout, silence))

    def _doorbell(self, link: Link, timeout: float) -> Doorbell:
        """This worker's doorbell in ``link``'s store (:func:`~.doorbell.dial_doorbell`), within ``timeout``."""
        address = (self.handoff["master_addr"], int(self.handoff["master_port"]))
        silence = SILENT_TIMEOUTS * self.update_timeout  # a sender's host that vanished ends the thread's wait
        return dial_doorbell(address, self.prefix, link, timeout, silence, self._calls, **self.where)

    def _pair(self, store: dist.Store, gen: int, hello: dict[str, Any], deadline: float) -> tuple[Link, str | None]:
        """Ask the sender to take this process back as generation ``gen`` of its worker (and as the next ones while
        it says to ask again: :func:`~.rejoins.ask_to_rejoin`); the two-rank group formed with it, or why not."""
        w = self.where["worker_idx"]
        gen, reason = ask_to_rejoin(store, self._key, self.sealer, gen, hello, deadline, self.where)
        if reason is not None:
            return Link(store=store), reason
        pair = dist.PrefixStore(f"pair/{w}/{gen}", store)
        group = (self.settings.backend, pair, 1, 2, self._group_timeout(deadline), self.handoff["master_addr"])
        pg = new_group_within(deadline, "the two-rank group with the sender", *group, **self.where)
        return Link(pg, pair, self.sealer.scoped(f"pair/{w}/{gen}/")), None

    def _rejoin(self, timeout: float) -> list[Delivery]:
        """Out of the sender's group (dropped, or its line closed): join as a new generation, as a restart does."""
        assert self._stores is not None and self._dropped is not None and self._calls is not None
        store, w, why = self._stores[1], self.where["worker_idx"], self._dropped
        deadline = deadline_after(self.update_timeout * GROUP_TIMEOUT_FACTOR)
        log.warning("model %r worker %d: out of its group (%s); connecting again", self.where["model_id"], w, why)

        def rejoin() -> tuple[Link, str | None, Doorbell | None]:
            late = SyncTimeoutError("a rejoin not made in time (the sender's store was silent)", **self.where)
            if remaining(deadline) <= 0:  # (a rejoin its receive gave up on asks nothing more)
                raise late
            gen = int(store.add(f"gen/{w}", 1))
            if remaining(deadline) <= 0:
                raise late
            link, reason = self._pair(store, gen, self._hello, deadline)
            return link, reason, None if reason is not None else self._doorbell(link, remaining(deadline))

        def discard(made: tuple[Link, str | None, Doorbell | None]) -> None:  # (a rejoin nobody took: closing)
            if made[2] is not None:
                made[2].close()

        try:  # (on the store calls' thread: a rejoin its receive gave up on is taken by the next, not made twice)
            ask = (rejoin, deadline + ANSWER_S, "a rejoin")
            link, reason, bell = self._calls.ask(*ask, key="rejoin", discard=discard, **self.where)
        except dist.DistError as exc:
            raise ConnectionClosedError(
                f"this worker is out of its sender's group ({why}) and could not reach it again: {first_line(exc)}",
                **self.where,
            ) from None
        if reason is not None:
            raise ConnectionClosedError(
                f"this worker is out of its sender's group ({why}) and was refused back: {reason}", **self.where
            )
        if self.transport is not None:
            self.transport.hang_up()
        self.transport = DistributedTransport(
            w,
            link=link,
            device=self.device,
            timeout=self.update_timeout,
            model_id=self.where["model_id"],
            bell=bell,
            calls=self._calls,
        )
        self._dropped = None
        return self._take_initial(timeout)  # the newest version comes as the initial weights did

    def _placement(self) -> str:
        """``take`` where the model is on the device updates arrive on (the CPU with gloo, the GPU with NCCL);
        ``load`` where it is on another one device (a GPU model over gloo: one host-to-device copy per bucket);
        ``write``, tensor by tensor, where it must keep its storage or the layout casts."""
        if not self._take or self.layout is None or self.layout.casts or self.model_device is None:
            return "write"
        return "take" if self.model_device == self.device else "load"

    def _parts(self) -> list[torch.Tensor]:
        buffer = self._buffers[self._at]
        return [buffer[start:end] for _, _, start, end in self._buckets]

    def take(self, timeout: float, newest: bool) -> list[Delivery]:
        transport = self.transport
        assert transport is not None
        if self._closed is not None:
            raise ConnectionClosedError(self._closed, **self.where)
        if self._initial:
            return self._take_initial(timeout)
        if self._dropped is not None:
            return self._rejoin(max(timeout, self.update_timeout))
        deadline = deadline_after(timeout)
        seqs: list[int] = []
        version, refusal, delta = None, None, None
        while True:
            try:
                msg = transport.next_message(0.0 if seqs else remaining(deadline))
            except (ConnectionClosedError, SyncTimeoutError) as exc:  # its store or line went away, or stopped
                if isinstance(exc, ConnectionClosedError):  # (its process, or its host)
                    self._closed = exc.detail
                if seqs:  # what arrived whole before is applied first
                    break
                raise
            if msg is None:
                break
            if msg.get("closed"):
                self._closed = "the sender shut down"
                break
            if "dropped" in msg:
                self._dropped = str(msg["dropped"])
                if seqs:  # what arrived before it is applied first
                    break
                return self._rejoin(max(remaining(deadline), self.update_timeout))
            version = int(msg["version"])
            delta = self._delta(msg)
            mac = self._mac(msg, None if delta is None else delta.body)
            parts = self._parts() if delta is None else [delta.body] if delta.nbytes else []
            try:  # (changes with no bytes: nothing to hash, no one-time key to derive)
                transport.receive_into(parts, self.update_timeout, version, mac if parts else None)
            except SyncTimeoutError:
                if transport.group_closed:  # (where the sender dropped no one, under "raise": this worker asks)
                    self._dropped = "its connection to the sender closed when an update came late"
                raise
            except ConnectionClosedError as exc:  # (its line or group, closed by a sender that dropped it, or gone)
                if transport.line is None and self._dropped_meanwhile(failed=exc):
                    return self._rejoin(max(remaining(deadline), self.update_timeout))
                if not isinstance(exc, PeerClosed):
                    raise
                seqs.clear()  # (newest: those read whole before were read into the buffer this one overwrote)
                self._say_taken = False
                # Its sender's word may land late (WORD_LATE_S): looked for on, in the time this receive has left.
                if remaining(deadline) <= 0:
                    break
                continue
            # Bytes that check against a digest sealed in their announcement are that version's, whatever happened
            # since; only bytes that do not (or whose digest is still to come) may be a reused buffer's, sent to a
            # worker the sender dropped meanwhile. Asking the store costs a round trip: asked only then.
            said = msg.get("digest")
            refusal = None if said is None else self._verify(mac, transport.seq, version, self.update_timeout, said)
            if (said is None or refusal is not None) and self._dropped_meanwhile():
                return self._rejoin(max(remaining(deadline), self.update_timeout))
            seqs.append(transport.seq)
            if said is None:
                refusal = self._verify(mac, transport.seq, version, self.update_timeout)
            self._say_taken = bool(msg.get("taken"))  # (said once ready: a driver waits for it to pause for the load)
            if not newest or refusal is not None:
                break
        if seqs:
            assert version is not None
            if delta is not None:  # (its body is where the next changes land: applied before the next take)
                delta.body = delta.body.cpu()
                return [Delivery(version, [], refusal=refusal, token=seqs, delta=delta)]
            return [self._delivery(version, seqs, refusal)]
        if self._closed is not None:
            raise ConnectionClosedError(self._closed, **self.where)
        return []

    def _take_initial(self, timeout: float) -> list[Delivery]:
        """The initial weights (at connect, or once this worker rejoined): they come without an announcement."""
        assert self.transport is not None
        deadline = deadline_after(timeout)
        said = self.transport.initial_message(timeout)  # sealed before the bytes were sent: nothing unsealed is read
        version, mac = said["version"], self._mac(said)
        self.transport.receive_into(self._parts(), max(remaining(deadline), 0.001), version, mac)
        self._initial = False  # (read: whatever the store says next, the next message is an announced one)
        if self._dropped_meanwhile():  # dropped again while the newest version was on its way
            return self._rejoin(max(timeout, self.update_timeout))
        refusal = self._verify(mac, 0, version, max(remaining(deadline), self.update_timeout))
        return [self._delivery(version, [0], refusal)]

    def _dropped_meanwhile(self, failed: WeightSyncError | None = None) -> bool:
        """Whether the sender dropped this worker while the message just received was on its way (its bytes may then
        be a later version's: the sender reused the buffer), never applied then (``failed``: as ``was_dropped``)."""
        assert self.transport is not None
        if self.transport.was_dropped(failed):
            self._dropped = "it did not ack in time"
        return self._dropped is not None

    def _delta(self, said: dict[str, Any]) -> Delta | None:
        """The changes message ``said`` announces, their body's buffer ready to receive into (``None``: the
        whole version comes).

        Raises:
            TransportError: a description that does not fit the layout (the sender sealed it: not a peer's).
        """
        if "delta" not in said:
            return None
        try:
            delta = Delta.from_plain(said["delta"], self._chunks)
        except ConfigurationError as exc:
            raise TransportError(
                f"the sender announced changes that do not fit the layout: {exc}", **self.where
            ) from None
        size = body_size(delta, self._chunks)
        if self._body.numel() < size:
            self._body = torch.empty(size, dtype=torch.uint8, device=self.device)
        delta.body = self._body[:size]
        return delta

    def _mac(self, said: dict[str, Any], body: torch.Tensor | None = None) -> PayloadMac | Unverifiable:
        """The keyed digest of the message ``said`` announces, fed as its bytes land in the staging buffer (or in
        ``body``, its changes'); where this process cannot compute the MAC the sender picked, what refuses the
        message once its bytes were read (the next one is then read in step)."""
        buffer = self._buffers[self._at] if body is None else body
        try:
            return self.sealer.payload_mac(self._layout_tag, buffer, said["version"], said["nonce"], said["mac"])
        except (ConfigurationError, TransportError) as exc:
            return Unverifiable(exc, buffer.numel())

    def _verify(
        self, mac: PayloadMac | Unverifiable, seq: int, version: int, timeout: float, said: str | None = None
    ) -> WeightSyncError | None:
        """Why the bytes of message ``seq`` (version ``version``) may not be applied: ``None`` when they hash, with
        the run key, to the digest the sender sealed for them (``said`` in the message's sealed announcement, the
        changes' digest; else from the store, where the sender sets it once the buckets went out)."""
        assert self.transport is not None
        expected = said if said is not None else self.transport.expected_digest(seq, version, timeout)
        if expected == NO_BYTES and mac.nbytes == 0:  # changes with no bytes (their description is sealed)
            return None
        if isinstance(mac, Unverifiable):
            return mac.error
        if hmac.compare_digest(mac.hexdigest(), expected):
            return None
        return AuthenticationError(
            "the update's bytes do not match the keyed digest the sender sealed for them (corrupted in transit, or "
            "sent by a process that is not the sender); not applied, the model keeps its previous weights",
            **{**self.where, "version": version},
        )

    def _delivery(self, version: int, seqs: list[int], refusal: BaseException | None) -> Delivery:
        buffer, views = self._buffers[self._at], self._views[self._at]
        storage = buffer.untyped_storage() if self.placement == "take" else None
        return Delivery(version, [(0, buffer)], None, views, storage, views, refusal=refusal, token=seqs)

    def ready(self, taken: list[Delivery]) -> None:
        if self._say_taken and self.transport is not None:  # here, checked, and its changes made whole
            self._say_taken = False
            self.transport.say_taken()

    def ack(self, taken: list[Delivery], held: int | None, error: BaseException | None = None) -> None:
        assert self.transport is not None
        try:
            self.transport.send_ack(taken[-1].version, error=error, held=held, seqs=tuple(taken[-1].token))
        finally:
            self.transport.sweep()

    def taken(self, delivery: Delivery, left: Any, swapped: bool) -> None:
        if not swapped:  # the model is bound to this buffer now: the next message lands in the other one
            self._at = 1 - self._at

    def close(self) -> None:
        if self._key_file is not None and self._closed is not None:
            # A sender that shut down removed its key file; one that was killed could not (on its own host).
            remove_key_file_if_orphaned(self._key_file, grace=ORPHAN_GRACE_S)
        if self._calls is not None:  # first: a call still out is ended (the bell's ring would wait behind it)
            self._calls.close(self.update_timeout)
        if self.transport is not None:
            self.transport.hang_up()
        self.transport = None
        self._buffers, self._views = [], []  # a model that took one keeps it: it is the model's memory now
        self._stores = None
