"""``MPTransport``: the channel to one local worker process that copies each update into its own model.

Sender side, it tells its worker which shared slot holds a new version (the
slot's descriptor goes along the first time, or for a slot in GPU memory its
CUDA IPC share and event, as plain data) and reads the worker's acks.
Receiver side, it maps the slots it is given and yields pending updates; the
receiver copies them into the worker's own model and acks.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...core.interrupts import held_interrupts
from ...core.timing import deadline_after, remaining
from ...errors import (
    ConnectionClosedError,
    IntegrityError,
    ReceiverError,
    TransportError,
    WeightSyncError,
    WorkerDiedError,
)
from ...tensors import cuda
from ..base import PeerTransport, TransportBackend
from ..descriptors import readable
from .channel import Channel
from .peers import PeerProcess
from .slots import DeviceSlot, SharedSlot, map_fd, map_fd_read_only, map_storage

if TYPE_CHECKING:
    from ...core.engine import Sink

__all__ = ["Ack", "MPTransport", "Update"]

#: Seconds a worker waits for a slot's descriptor once the message announcing it arrived (it follows at once).
FD_WAIT_S = 5.0
#: The longest reason a sender gives a worker it dropped (characters).
MAX_REASON = 2000
#: A worker waiting for an update looks this often whether the sender's process is still there: its death closes
#: the channel, unless a process it forked holds the channel's end too.
PEER_LOOK_S = 0.5

#: How often a wait for a worker's word that it took a version looks whether another thread read it (seconds).
TAKEN_TICK_S = 0.002


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Update:
    """A pending update on the receiver side: which version, in which slot."""

    version: int
    slot: int
    digest: str | None = None  # the sender's checksum of the slot, when it computes one
    report_taken: bool = False  # the sender waits to hear when it was taken (a driver pauses the worker for the load)


@dataclass
class Ack:
    """A worker's answer to an update: the version it acked, the one it now holds, its failure if any."""

    version: int
    held: int | None
    error: ReceiverError | None


class MPTransport(PeerTransport, TransportBackend):
    """Data plane to ONE worker of a local scheme (sender side), or from the sender (receiver side).

    Args:
        channel: the authenticated channel to the peer.
        worker_idx: the worker this transport serves.
        sink: on the sender side, where the older API's calls go (the sender's pipeline).
    """

    #: Receivers of this transport read their model from the slot of the version they hold (no private copy).
    pinning = False

    def __init__(self, channel: Channel, worker_idx: int, sink: Sink | None = None) -> None:
        super().__init__(worker_idx, sink)
        self.channel = channel
        # Sender side.
        self.slots_sent: set[int] = set()
        # The CUDA IPC shares handed to this worker, by slot: what its process holds a reference of until it lets go.
        self.shares: dict[int, list[dict[str, Any]]] = {}
        #: The process at the other end, as the kernel named it: on the sender, the worker's (what maps the slots);
        #: on a worker, the sender's (a channel can outlive it: a child it forked holds its end).
        self.process: PeerProcess | None = None
        self.last_error: ReceiverError | None = None  # the worker's last failure, until a later success
        #: The newest version the worker said it took (and its program prepared), where the sender asked, and the
        #: newest it acked (applied or refused).
        self.taken, self.acked = -1, -1
        self.notified = -1  # the newest version the worker was told of (an ack of it may be on its way)
        # A driver's thread reads the channel too while it waits for that (:meth:`wait_taken`): one reader at a time,
        # and what it finds besides waits here for :meth:`acks`.
        self._reading = threading.Lock()
        self._unread: list[dict[str, Any]] = []
        # Receiver side.
        self.slot_buffers: dict[int, torch.Tensor] = {}
        self.bad_slots: dict[int, tuple[type[WeightSyncError], str]] = {}  # slots refused on arrival, and why
        self.events: dict[int, cuda.SlotEvent] = {}  # device slots: the event the sender records after a write
        self.pin_host = False  # the model is on a GPU: pin the host slots it copies from
        self._pins: dict[int, cuda.Pinned] = {}  # by slot
        self._unmapped: dict[int, tuple[int, int]] = {}  # host slots whose mapping failed: descriptor, bytes
        self._arrived: list[Update] = []  # updates read and not returned yet
        self.closed_by_sender = False
        self.ended = "the sender has shut down"  # what a receive says once the sender closed its end

    # ------------------------------------------------------------ sender side
    def dropped(self, reason: str) -> None:
        """The sender gave up on this worker (dead, or dropped after a timeout): say why, where the worker's buffer
        takes it at once (a stalled worker's may be full), and close the channel. A worker that comes back to life
        reads why, then the end, and may rejoin (a new receiver from its config or pickled scheme)."""
        with contextlib.suppress(WeightSyncError):
            self.channel.send({"op": "dropped", "reason": reason[:MAX_REASON]}, timeout=0.0)
        self.channel.close()

    def notify(self, slot: SharedSlot | DeviceSlot, version: int, report_taken: bool = False) -> None:
        """Tell the worker that ``slot`` holds ``version``; ship the slot's descriptor (or CUDA share) on first use.
        ``report_taken``: the worker is to say when it took it (:meth:`wait_taken`).

        Raises:
            WorkerDiedError: the channel is closed.
        """
        try:
            if slot.id not in self.slots_sent:
                announce = {"op": "slot", "slot": slot.id, "nbytes": slot.nbytes}
                with held_interrupts():  # (sent and counted in one step, as every write below)
                    if isinstance(slot, DeviceSlot):
                        self.channel.send({**announce, "cuda": self._device_share(slot)})
                    else:
                        self.channel.send_with_fds(announce, [slot.reader_fd])
                    self.slots_sent.add(slot.id)
            update = {"op": "update", "version": version, "slot": slot.id, "digest": slot.digest}
            with held_interrupts():
                self.channel.send({**update, "taken": True} if report_taken else update)
                self.notified = max(self.notified, version)
        except ConnectionClosedError as exc:
            raise WorkerDiedError(
                f"channel closed while sending ({exc.detail})", worker_idx=self.worker_idx, version=version
            ) from exc

    def _device_share(self, slot: DeviceSlot) -> dict[str, Any]:
        """Shares of ``slot``'s memory for this worker (two where the model takes a slot's memory as its own: one
        to read it, one to take) and its event's handle."""
        storage = slot.buffer.untyped_storage()
        shares = [cuda.share(storage, slot.uuid) for _ in range(2 if self.pinning else 1)]
        self.shares.setdefault(slot.id, []).extend(shares)
        assert slot.event is not None
        return {"shares": shares, "event": slot.event.handle()}

    def acks(self, model_id: str | None, on_ack: Callable[[Ack], None]) -> ConnectionClosedError | None:
        """Hand each ack received to ``on_ack``, without waiting; how the channel closed if it did (after them).
        Each is taken (off the channel, or out of what :meth:`wait_taken` read) and handed on in one step that a
        Ctrl-C does not cut in two: an ack read and not handed on left the sender waiting for it in vain, and
        bytes read and not yet taken left the channel out of step, its worker named dead."""
        try:
            with self._reading:
                while self._unread or self.channel.poll(0):
                    with held_interrupts():
                        msg = self._unread.pop(0) if self._unread else self._next_message()
                        if msg is not None:
                            on_ack(self._ack(msg, model_id))
        except ConnectionClosedError as exc:
            return exc
        return None

    def _next_message(self) -> dict[str, Any] | None:
        """The worker's next message, already received (the caller holds ``_reading``); ``None`` where none is
        whole yet, or it was its word that it took a version, which is recorded (as the newest version acked is)."""
        msg = self.channel.recv(0)
        if msg is None:
            return None
        op, version = msg.get("op"), msg.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and op in ("taken", "ack"):
            if op == "taken":
                self.taken = max(self.taken, version)
                return None
            self.acked = max(self.acked, version)
        return msg

    def has_unread(self) -> bool:
        """Messages :meth:`wait_taken` read that :meth:`acks` has not handed on yet."""
        return bool(self._unread)

    def wait_taken(self, version: int, deadline: float) -> None:
        """Wait (until ``deadline``) until the worker said it took ``version`` or a later one, or took one it has not
        applied yet (it takes the next once that one is applied: in the pause), or its channel closed. The core's
        thread may be reading the channel for acks meanwhile (it records the word too), or not (an asynchronous
        send): this reads it where nobody else does, keeping what else comes for :meth:`acks`."""

        def waiting() -> bool:
            return self.taken < version and self.taken <= self.acked

        while waiting() and remaining(deadline) > 0 and not self.channel.closed:
            if self._reading.acquire(blocking=False):
                try:
                    while self.channel.poll(0):
                        with held_interrupts():  # (kept as it is read)
                            msg = self._next_message()
                            if msg is not None:
                                self._unread.append(msg)
                except ConnectionClosedError:
                    return
                finally:
                    self._reading.release()
            if waiting():  # (the other reader records it: looked at again within a tick)
                readable([self.channel.fileno()], min(remaining(deadline), TAKEN_TICK_S))

    def _ack(self, msg: dict[str, Any], model_id: str | None) -> Ack:
        version, held, err = msg.get("version"), msg.get("held"), msg.get("error")
        if (
            msg.get("op") != "ack"
            or not _is_int(version)
            or not (held is None or _is_int(held))
            or not (err is None or isinstance(err, dict))
        ):  # a key holder's garbage: nothing it says can be trusted, so it is treated as gone
            self.channel.close()
            raise ConnectionClosedError(f"worker {self.worker_idx} sent a malformed message: {str(msg)[:80]}")
        # The last failure stays known until a later success: if the worker then leaves, that is why.
        self.last_error = None
        if err:
            self.last_error = ReceiverError(
                str(err.get("type")), str(err.get("message")), model_id=model_id, worker_idx=self.worker_idx,
                version=version,
            )  # fmt: skip
        assert version is not None  # checked an int above
        return Ack(version, held, self.last_error)

    def check_connection(self) -> bool:
        """``False`` once the worker is known gone or its channel closed."""
        return super().check_connection() and not self.channel.closed

    # ---------------------------------------------------------- receiver side
    def poll(self, timeout: float = 0.0) -> bool:
        """``True`` when a message from the sender is waiting."""
        return self.channel.poll(timeout)

    def receive_weights(self, timeout: float | None = 0.0, **kwargs: Any) -> list[Update]:
        """Read every message the sender has queued, waiting up to ``timeout`` for the first update.

        Maps newly announced slots and returns the pending updates, oldest
        first; an empty list when nothing arrived.

        Raises:
            ConnectionClosedError: the sender has said goodbye or died, and nothing is left to apply.
        """
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        if self.closed_by_sender and not self._arrived:
            raise ConnectionClosedError(self.ended, worker_idx=self.worker_idx)
        deadline = deadline_after(timeout or 0.0)
        # A slot's share comes in a message of its own, ahead of the update that names it: the wait goes on until
        # an update (or the deadline), never ends on a share alone.
        while not self._arrived and not self.closed_by_sender:
            try:
                # (in slices: the sender's process is looked at between them)
                if self.channel.poll(min(remaining(deadline), PEER_LOOK_S)):
                    # Read and acted on in one step that a Ctrl-C does not cut in two: a frame read in part, or a
                    # slot's share read without the descriptors behind it, left the channel out of step for good.
                    with held_interrupts():
                        self._read(self.channel.recv(0.0))
                    continue
            except ConnectionClosedError:
                self.closed_by_sender = True
                raise ConnectionClosedError(
                    "the sender closed the channel (shut down or died)", worker_idx=self.worker_idx
                ) from None
            if self.process is not None and self.process.gone() and not self.channel.poll(0):
                self.closed_by_sender = True
                raise ConnectionClosedError(
                    f"the sender's process {self.process.pid} exited (its channel is held open by another "
                    "process, a child it forked)",
                    worker_idx=self.worker_idx,
                )
            if remaining(deadline) <= 0:
                break
        if not self._arrived and self.closed_by_sender:
            raise ConnectionClosedError(self.ended, worker_idx=self.worker_idx)
        updates, self._arrived = self._arrived, []
        return updates

    def _read(self, msg: dict[str, Any] | None) -> None:
        """Act on ``msg`` and every message queued behind it, keeping the updates in ``_arrived``.

        The updates are kept on the transport, not handed back: a Ctrl-C raised as the read's held step ends
        loses none, and the next ``receive_weights`` returns them.
        """
        while msg is not None:
            op = msg["op"]
            if op == "slot":
                self._map_slot(msg)
            elif op == "update":
                update = Update(int(msg["version"]), int(msg["slot"]), msg.get("digest"), bool(msg.get("taken")))
                if update.slot in self._unmapped:  # it failed to map when shared (out of memory, say): try again
                    fd, nbytes = self._unmapped[update.slot]
                    if self._map_host(update.slot, fd, nbytes):
                        os.close(self._unmapped.pop(update.slot)[0])
                self._arrived.append(update)
            elif op == "forget":
                self._unmap(int(msg["slot"]))
            elif op == "bye":
                self.closed_by_sender = True
                return
            elif op == "dropped":
                self.closed_by_sender = True
                self.ended = f"the sender dropped this worker ({str(msg.get('reason'))[:MAX_REASON]})"
                return
            else:
                raise TransportError(f"unexpected message {op!r} from the sender", worker_idx=self.worker_idx)
            try:
                msg = self.channel.recv(0.0)
            except ConnectionClosedError:
                self.closed_by_sender = True
                return

    def _map_slot(self, msg: dict[str, Any]) -> None:
        slot, nbytes = int(msg["slot"]), int(msg["nbytes"])
        if "cuda" in msg:
            self._map_device_slot(slot, nbytes, msg["cuda"])
            return
        (fd,) = self.channel.recv_fds(1, timeout=FD_WAIT_S)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:  # mapping past the end of a segment would kill this process (SIGBUS)
                self.bad_slots[slot] = (
                    IntegrityError,
                    f"slot {slot} holds {size} bytes, not the {nbytes} announced: truncated",
                )
            elif not self._map_host(slot, fd, nbytes):  # kept, to map again when an update names the slot
                self._unmapped[slot] = (fd, nbytes)
                return
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)

    def _map_host(self, slot: int, fd: int, nbytes: int) -> bool:
        """Map the host slot ``slot`` from its descriptor ``fd``; ``False``, with the slot in :attr:`bad_slots`
        (an update naming it is refused with the reason), where this process could not map it."""
        # A worker that copies out of its slots maps them read-only (its descriptor is read-only, and the segment
        # refuses new writable mappings); one whose model is the slot's memory maps it writable.
        read_only, pin = not self.pinning, None
        try:
            buffer = map_fd_read_only(fd, nbytes) if read_only else map_fd(fd, nbytes)
            self._slot_mapped(slot, lambda: map_storage(fd, nbytes))
            if self.pin_host:
                pin = cuda.Pinned(buffer, read_only=read_only)
        except (OSError, RuntimeError) as exc:  # out of memory or of mappings (ENOMEM), a failed pin
            self._slot_unmapped(slot)
            self.bad_slots[slot] = (TransportError, f"slot {slot} ({nbytes} bytes) could not be mapped here: {exc}")
            return False
        self.slot_buffers[slot] = buffer
        if pin is not None:
            self._pins[slot] = pin
        self.bad_slots.pop(slot, None)
        return True

    def _map_device_slot(self, slot: int, nbytes: int, info: Any) -> None:
        """Map a slot in the sender's GPU memory (its CUDA IPC shares and event); a slot that cannot be mapped
        is refused when an update names it, with the reason."""
        try:
            if not isinstance(info, dict) or set(info) != {"shares", "event"} or not isinstance(info["shares"], list):
                raise TransportError("a device slot is announced with its shares and its event")
            if not isinstance(info["event"], str):
                raise TransportError("a device slot is announced with an event handle")
            if len(info["shares"]) != (2 if self.pinning else 1):  # one to read, and one to take where it takes
                raise TransportError(f"a device slot is announced with {len(info['shares'])} shares")
            shares = [cuda.check_share(share, f"slot {slot}'s share") for share in info["shares"]]
            uuids = cuda.visible_uuids()  # the GPU is named by UUID: its index may differ in this process
            storage = cuda.open_share(shares[0], uuids)
            if storage.nbytes() < nbytes:
                raise TransportError(f"slot {slot} holds {storage.nbytes()} bytes, not the {nbytes} announced")
            self.events[slot] = cuda.SlotEvent.open(shares[0]["uuid"], info["event"], uuids)
        except TransportError as exc:
            self.bad_slots[slot] = (TransportError, str(exc))
            return
        self.slot_buffers[slot] = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
            storage, 0, (nbytes,), (1,)
        )
        spare = shares[-1]
        self._slot_mapped(slot, lambda: cuda.open_share(spare, uuids))

    def forget(self, slot: SharedSlot | DeviceSlot) -> None:
        """Tell the worker to let ``slot`` go (the sender retired it: it is never written again). A closed channel
        is let be: the worker is gone (the sender's next look at its channel says so)."""
        with contextlib.suppress(WeightSyncError):
            self.channel.send({"op": "forget", "slot": slot.id})
        # The worker drops its references of the slot itself as it lets go: releasing them again once its process
        # is gone would take references another live process holds. (Should it die before it read this, the slot's
        # memory stays until the trainer exits: kept, never freed under a reader.)
        self.shares.pop(slot.id, None)

    def _unmap(self, slot: int) -> None:
        """Let go of a slot the sender retired (never named by an update again)."""
        pin = self._pins.pop(slot, None)
        if pin is not None:  # before the mapping goes
            pin.release()
        self.slot_buffers.pop(slot, None)
        self.bad_slots.pop(slot, None)
        self.events.pop(slot, None)
        if slot in self._unmapped:
            os.close(self._unmapped.pop(slot)[0])
        self._slot_unmapped(slot)

    def _slot_unmapped(self, slot: int) -> None:
        """``slot``'s mappings were let go (a receiver that keeps more of them drops those too)."""

    def _slot_mapped(self, slot: int, second: Callable[[], torch.UntypedStorage]) -> None:
        """A slot was just mapped into :attr:`slot_buffers`; ``second()`` maps it once more (while this runs)."""

    def spare(self, slot: int) -> torch.UntypedStorage | None:
        """Memory of ``slot`` the model may take as its own (none: this transport's receivers copy)."""
        return None

    def took(self, slot: int, left: torch.UntypedStorage | None) -> None:
        """The model now reads ``slot``'s spare; ``left`` holds the mapping of the slot it read before."""

    def send_taken(self, version: int) -> None:
        """Tell the sender ``version`` was taken (and is ready to apply)."""
        self.channel.send({"op": "taken", "version": version})

    def send_ack(self, version: int, error: BaseException | None = None, held: int | None = None) -> None:
        """Tell the sender ``version`` was applied (or failed with ``error``); ``held`` is the version now in use."""
        msg: dict[str, Any] = {"op": "ack", "version": version, "held": held}
        if error is not None:
            msg["error"] = {"type": type(error).__name__, "message": str(error)}
        self.channel.send(msg)

    def close(self) -> None:
        self.channel.close()
        for pin in self._pins.values():  # before the mappings go
            pin.release()
        self._pins.clear()
        self.slot_buffers.clear()
        self.bad_slots.clear()
        self.events.clear()
        for fd, _ in self._unmapped.values():
            os.close(fd)
        self._unmapped.clear()
