"""The trainer's side of the local engine (``multiprocess``, ``shared_mem``): a listener, slots, channels.

``init_on_sender`` opens an authenticated listener on an abstract Unix
socket; the rendez-vous accepts every worker and sends each the layout. A
version is staged by writing the weights once into a free shared slot (one
per pool: shared by all workers, or one pool per worker), and submitted by
telling each targeted worker which slot holds it. A slot is written only
when no worker still reads it: that rule is what makes torn reads impossible.
The listener stays open after the rendez-vous, for workers that come back.

Where the slots live depends on the devices. The trainer's weights on a GPU and a worker's model on a GPU: the
worker's pool is in the trainer's GPU memory (one device-to-device copy per send, then an event; no host memory on
the way). Otherwise, host memory (pinned when the trainer's weights are on a GPU), so a CUDA trainer with CPU
workers and a CPU trainer with CUDA workers both copy through page-locked memory. A ``checksum`` keeps every pool
in host memory, where it is computed.

"The trainer's GPU" is decided by UUID (the worker's hello names the GPU of its model by UUID; indexes differ
between processes under ``CUDA_VISIBLE_DEVICES``): a worker on another GPU reads pinned host slots (one
device-to-host copy per send, shared by all such workers, then one host-to-device copy each) rather than peer
copies out of the trainer's GPU, which would cost that worker a CUDA context on the trainer's GPU and work on it
at every update. A pool of device slots is bounded (:func:`~weightsync.transports.local.slots.device_pool_size`);
where even the smallest does not fit in the GPU's free memory, its workers read pinned host slots.

Memory a worker maps is given back (a CUDA share released, a slot rewritten)
only once the worker's process is known to have exited: see
:mod:`~weightsync.transports.local.peers`.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import time
from typing import Any

import torch

from ... import errors
from ...core.engine import Outgoing, SenderEngine, Sink
from ...core.timing import WAIT_TICK_S, remaining, shown_seconds
from ...errors import ConfigurationError, ConnectionClosedError, SyncTimeoutError, WeightSyncError, WorkerDiedError
from ...tensors import cuda
from ...tensors.layout import FlatLayout
from ..descriptors import readable
from ..keyfiles import KEY_BYTES, remove_key_file, write_key_file
from .channel import Channel, ChannelListener
from .hello import hello_problem, refuse
from .mp import MPTransport
from .peers import Departed, PeerProcess
from .settings import MPSettings
from .slots import DeviceSlot, SharedSlot, SlotPool, close_slot, device_pool_size, slot_kind

_Slot = SharedSlot | DeviceSlot
#: A pool's key: the kind of memory (``"host"``, ``"cuda"``) and the worker it serves (``None``: every worker).
_PoolKey = tuple[str, int | None]

__all__ = ["LocalSender"]

log = logging.getLogger("weightsync.transports.local")

#: Seconds the rejoin thread waits for a connection before it looks again whether it must stop.
REJOIN_POLL_S = 0.1
#: Seconds between two looks whether a process given up on, which keeps a slot out of use, has exited.
HOLDER_POLL_S = 0.01


class LocalSender(SenderEngine):
    """The sender's listener, slot pools and one :class:`MPTransport` (or subclass) per worker.

    Args:
        settings: the transport's: ``mp`` or ``shared_mem`` (its transport's ``pinning`` says whether workers
            keep reading the slot of the version they hold), and ``max_slots``, the most slots a pool may hold
            (``None``: ``num_workers + 2``).
        per_worker: every worker has a pool of its own.
        address: the listener's abstract address (``None``: a random one).
        gpu: as :class:`SenderEngine` takes it; workers whose model is on that very GPU read slots in its memory.
    """

    rejoins = True

    def __init__(
        self,
        sink: Sink,
        layout: FlatLayout,
        num_workers: int,
        settings: MPSettings,
        *,
        per_worker: bool = False,
        checksum: bool = False,
        address: str | None = None,
        gpu: torch.device | None = None,
    ) -> None:
        super().__init__(sink, layout, num_workers, checksum=checksum, gpu=gpu)
        self.settings = settings
        self.transport_class: type[MPTransport] = settings.transport_class()
        self.max_slots = settings.max_slots or num_workers + 2
        self.per_worker = per_worker
        self.pools: dict[_PoolKey, SlotPool] = {}
        self.kinds: dict[int, str] = {}  # where each worker's slots live, from the GPU its hello names
        #: The trainer's GPU, by UUID (``None``: no GPU, or no CUDA here).
        self.gpu_uuid = cuda.device_uuid(gpu) if gpu is not None and torch.cuda.is_available() else None
        # Transports of worker processes given up on or replaced: their CUDA shares go once each process exited.
        self.departed = Departed()
        self._staging: int | None = None  # the version staged last, and submitted last
        self._submitting: int | None = None
        self._authkey = secrets.token_bytes(KEY_BYTES)
        self._key_file: str | None = None
        self.listener: ChannelListener | None = ChannelListener(self._authkey, address)
        self._unwelcome: dict[int, str] = {}  # worker -> why the last channel from it was not taken
        log.debug("model %r: listening on %s for %d workers", sink.model_id, self.listener.address, num_workers)

    @property
    def shared(self) -> SlotPool | None:
        """The pool of slots every worker reads (``None`` with a pool per worker, or before a worker joined): the
        GPU's, if workers read one."""
        return self.pools.get(("cuda", None)) or self.pools.get(("host", None))

    def handoff(self) -> dict[str, Any]:
        assert self.listener is not None
        return {"address": self.listener.address, "authkey": self._authkey.hex()}

    def connection(self) -> dict[str, Any]:
        assert self.listener is not None
        if self._key_file is None:
            self._key_file = write_key_file(self.listener.address, self._authkey)
        return {"address": self.listener.address, "authkey_file": self._key_file}

    # ------------------------------------------------------------ rendez-vous
    def rendezvous(self, deadline: float, timeout: float) -> dict[int, WeightSyncError]:
        assert self.listener is not None
        n = self.num_workers
        while len(self.transports) < n:
            left = remaining(deadline)
            if left <= 0:
                missing = sorted(set(range(n)) - set(self.transports))
                for transport in self.transports.values():
                    transport.close()
                self.transports.clear()
                why = "".join(f"; worker {w}: {self._unwelcome[w]}" for w in missing if w in self._unwelcome)
                said = f"workers {missing} did not connect within {shown_seconds(timeout)}{why}"
                raise SyncTimeoutError(said, model_id=self.sink.model_id)
            self.sink.waiting(lambda: list(self.transports))
            try:
                accepted = self.listener.accept(min(left, WAIT_TICK_S))
            except WeightSyncError as exc:  # a stranger or a broken peer: keep waiting for the real workers
                log.warning("model %r: %s", self.sink.model_id, exc)
                continue
            if accepted is not None:
                self._welcome(*accepted)
        return {}

    def rendezvous_complete(self) -> bool:
        return len(self.transports) == self.num_workers

    def _hello_problem(self, hello: dict[str, Any]) -> str | None:
        """Why a hello (bounded JSON from a key holder) cannot be taken (:func:`~.hello.hello_problem`), or its
        worker is connected already."""
        problem = hello_problem(hello, self.num_workers, self.sink.model_id)
        w = int(hello["worker_idx"]) if problem is None else -1
        # One whose process is gone (a restart), or that hung up (a connect() retried after its timeout), is replaced:
        # in the rendez-vous too.
        old = self.transports.get(w)
        replaceable = old is None or (old.process is not None and old.process.gone()) or old.channel.hung_up()
        if not replaceable and not self.sink.is_dead(w):
            return f"worker {w} is already connected"
        return problem

    def _welcome(self, channel: Channel, hello: dict[str, Any]) -> None:
        """Take ``channel`` as its worker's, or turn it away with the reason."""
        problem = self._hello_problem(hello)
        if problem is not None:
            self.discard((channel, hello), problem)
            w = hello.get("worker_idx")  # (named by a process with the key, checked or not: the timeout says why)
            if type(w) is int and 0 <= w < self.num_workers and w not in self.transports:
                self._unwelcome[w] = f"it was refused: {problem}"
        else:
            try:
                self._take_over(channel, hello)
            except WeightSyncError as exc:  # it stopped reading, or went away, after its hello: wait for it again
                self._unwelcome[int(hello["worker_idx"])] = why = f"it said hello and was not welcomed: {exc}"
                log.warning("model %r: worker %s: %s", self.sink.model_id, hello["worker_idx"], why)

    def _take_over(self, channel: Channel, hello: dict[str, Any]) -> MPTransport:
        """Make ``channel`` its worker's (sending it the layout), closing any channel the worker had; where the
        welcome cannot be sent, ``channel`` is closed (nothing else changed) and that raised."""
        w = int(hello["worker_idx"])
        try:
            channel.send({"op": "welcome", "layout": self.layout.to_plain(), "num_workers": self.num_workers})
        except WeightSyncError:
            channel.close()
            raise
        old = self.transports.get(w)
        if old is not None:
            old.close()
            self._retire(old)
        self.kinds[w] = self._kind(hello)
        transport = self.transports[w] = self.transport_class(channel, w, self.sink)
        transport.process = PeerProcess.of_socket(channel.fileno())
        return transport

    def _kind(self, hello: dict[str, Any]) -> str:
        """Where the slots of the worker that said ``hello`` live: ``"cuda"`` (the trainer's GPU) or ``"host"``."""
        kind = slot_kind(self.gpu_uuid, hello.get("gpu"), checksum=self.checksum)
        if kind == "cuda" and ("cuda", None) not in self.pools and self._device_pool_size() == 0:
            log.warning(
                "model %r: %d-byte device slots do not fit in the free memory of %s: its workers read pinned host "
                "slots",
                self.sink.model_id,
                self.layout.nbytes,
                self.gpu,
            )
            return "host"
        return kind

    def _device_pool_size(self) -> int:
        """The slots a new pool in the trainer's GPU memory may hold (0: none fits)."""
        assert self.gpu is not None
        free = torch.cuda.mem_get_info(self.gpu)[0]
        # Pools made but not full yet will take their slots from that free memory too.
        free -= sum((p.max_slots - len(p.slots)) * self.layout.nbytes for p in self.pools.values() if p.device)
        pinning = self.transport_class.pinning
        return device_pool_size(self.max_slots, self.layout.nbytes, free, pinning=pinning, per_worker=self.per_worker)

    def _retire(self, transport: MPTransport) -> None:
        """``transport``'s worker process was given up on or replaced: release its CUDA shares once it exited."""
        self.departed.add(transport)
        self._release_departed()

    def _release_departed(self) -> None:
        """Release the CUDA shares of departed worker processes known to have exited (given up on ones included)."""
        self.departed.release(t for w, t in self.transports.items() if self.sink.is_dead(w))

    def discard(self, candidate: Any, problem: str = "the sender is shutting down") -> None:
        """Tell a connecting process why it is turned away, and close its channel."""
        refuse(candidate[0], problem, self.sink.model_id)

    # ------------------------------------------------------------------ acks
    def poll(self, workers: list[int]) -> None:
        for w in workers:
            transport = self.transports.get(w)
            if transport is None or self.sink.is_dead(w):
                continue
            closed = transport.acks(self.sink.model_id, functools.partial(self._on_ack, w))
            if closed is None and transport.process is not None and transport.process.gone():
                # (after its acks were read: a process that acked, then exited, did its part) Its channel may
                # outlive it: a child it forked holds its end.
                closed = ConnectionClosedError(f"its process {transport.process.pid} exited")
            if closed is not None:
                # A worker that reported a failure and then left is remembered for that failure.
                self.sink.died(w, transport.last_error or f"its channel closed ({closed.detail})")

    def _on_ack(self, w: int, ack: Any) -> None:
        for pool in self.pools.values():
            for slot in pool.on_ack(w, ack.version, ack.held):  # (slots that left the pool while it was late)
                self._forget(w, slot)
        if ack.error is not None:
            self.sink.failed(w, ack.error)
        if ack.held is not None:
            self.sink.acked(w, ack.held)

    def wait(self, workers: list[int], deadline: float) -> None:
        transports = [self.transports[w] for w in workers if w in self.transports and not self.sink.is_dead(w)]
        if any(t.has_unread() for t in transports):  # read off the channel by a driver's wait_taken: poll at once
            return
        fds = [t.channel.fileno() for t in transports if not t.channel.connection.closed]
        # ... and each worker's process: its exit wakes this wait even where its channel stays open
        fds += [t.process.fileno() for t in transports if t.process is not None and t.process.fileno() >= 0]
        if fds:
            readable(fds, remaining(deadline))

    def set_aside(self, worker: int) -> bool:
        pool = self.pools.get(self._pool_key(worker))
        if pool is not None and pool.device is not None:  # (the GPU's free memory sized it: nothing more fits)
            return False
        if pool is not None:
            pool.set_aside(worker)
        return True

    def lost(self, worker: int, reason: str) -> None:
        transport = self.transports.get(worker)
        process = transport.process if transport is not None else None
        for pool in self.pools.values():
            # Its slots are rewritten only once its process exited: dropped after a timeout, it may still read one.
            pool.drop_worker(worker, process)
        if transport is not None:
            transport.dropped(reason)

    # ---------------------------------------------------------------- sending
    def _pool_key(self, worker: int) -> _PoolKey:
        return self.kinds.get(worker, "host"), worker if self.per_worker else None

    def _pool(self, key: _PoolKey) -> SlotPool:
        pool = self.pools.get(key)
        if pool is None:
            kind, worker = key
            size = self.max_slots if kind == "host" else max(1, self._device_pool_size())
            pool = self.pools[key] = SlotPool(
                self.layout,
                size,
                pinning=self.transport_class.pinning,
                tag=f"{os.getpid()}-{worker}",
                device=self.gpu if kind == "cuda" else None,
                pin=self.pin,
            )
        return pool

    def _written(self, slot: _Slot) -> None:
        """``slot`` was just written on the trainer's stream: mark the end of the write for the workers' streams
        (a device slot), or wait for it (a host slot a GPU wrote into: its readers read it from the host)."""
        if isinstance(slot, DeviceSlot):
            assert slot.event is not None
            slot.event.record()
        elif self.gpu is not None:
            torch.cuda.current_stream(self.gpu).synchronize()

    def _acquire(self, pool: SlotPool, deadline: float, version: int) -> _Slot:
        """A slot of ``pool`` no worker reads, waiting (until ``deadline``) for workers to ack newer versions."""
        try:
            slot = pool.acquire()
            while slot is None:
                busy = sorted(pool.busy_workers())
                late = [w for w, t in self.transports.items() if w in busy and (t.acked < t.notified or t.has_unread())]
                if busy and not late and pool.pinning:  # (every slot a model's memory: shared_mem)
                    raise ConfigurationError(pool.stuck(busy), model_id=self.sink.model_id, version=version)
                if remaining(deadline) <= 0:
                    said = (
                        f"no free weight slot in time: no ack from workers {late}, of the versions that would free one "
                        f"(workers {busy} hold or read the slots, max_slots={pool.max_slots})"
                    )
                    errors.held_up(said, late, model_id=self.sink.model_id, version=version)
                if busy:
                    self.wait(busy, deadline)
                    self.poll(busy)
                else:  # (no reader left: the next acquire frees or retires a slot)
                    time.sleep(min(HOLDER_POLL_S, remaining(deadline)))
                slot = pool.acquire()
        finally:  # (a new slot that could not be made leaves those that left the pool closed all the same)
            self._close_retired(pool)
        return slot

    def _close_retired(self, pool: SlotPool) -> None:
        """Close the slots ``pool`` retired (read only by processes given up on or late workers, which keep their
        memory alive while they map it), telling the live workers that mapped them to let them go (a late reader,
        once it acked past its slot: :meth:`_on_ack`)."""
        for slot in pool.retired:
            for w, transport in self.transports.items():
                if slot.id in transport.slots_sent and w not in slot.readers:  # (a late reader: once it acked past)
                    self._forget(w, slot)
            processes = [t.process for t in self.transports.values() if t.process is not None]
            close_slot(slot, [*processes, *slot.holders])
        pool.retired.clear()
        self._release_departed()

    def _forget(self, w: int, slot: _Slot) -> None:
        if not self.sink.is_dead(w):
            self.transports[w].forget(slot)

    def stage(self, out: Outgoing, deadline: float) -> dict[int, _Slot]:
        by_pool: dict[_PoolKey, list[int]] = {}
        for w in out.workers:
            by_pool.setdefault(self._pool_key(w), []).append(w)
        if not by_pool:  # (sent to no worker, none alive: published all the same, for workers that rejoin)
            by_pool[self._pool_key(0)] = []
        # Every slot is secured before anything is written, so a send that times out here publishes nothing.
        slots = {key: self._acquire(self._pool(key), deadline, out.version) for key in by_pool}
        self._staging = out.version
        staged: dict[int, _Slot] = {}
        payload_digest = None  # every pool gets the same bytes: hashed once
        for key, members in by_pool.items():
            slot = slots[key]
            slot.version = None  # until the write completes, the slot holds no version (rejoins read it)
            # Copies out of a GPU are queued without a wait per tensor (pinned host slots): `_written` waits once.
            out.write(slot.buffer, slot.views, non_blocking=self.gpu is not None)
            self._written(slot)
            if payload_digest is None:
                payload_digest = self.digest([slot.buffer])
            slot.digest = payload_digest
            self.pools[key].publish(slot, out.version, members)
            staged.update(dict.fromkeys(members, slot))
        return staged

    def unpublished(self) -> None:
        if self._staging != self._submitting:  # (submitted, its number is spent: its slot holds it)
            notified = {w: transport.notified for w, transport in self.transports.items()}
            for pool in self.pools.values():
                pool.unpublish(self._staging, notified)

    def submit(self, out: Outgoing, staged: dict[int, _Slot]) -> None:
        self._submitting = out.version
        for w in out.workers:
            try:
                self.transports[w].notify(staged[w], out.version, self.reports_taken)
            except WorkerDiedError as exc:
                self.sink.died(w, exc.detail)

    def wait_sent(self, worker: int, deadline: float) -> None:
        # The bytes are in shared memory already; the worker's program takes each version and says so (a driver waits).
        transport = self.transports.get(worker)
        if self.reports_taken and transport is not None and transport.notified >= 0:
            transport.wait_taken(transport.notified, deadline)

    # ----------------------------------------------------------------- rejoin
    def poll_rejoin(self) -> tuple[Channel, dict[str, Any]] | None:
        """A worker connecting after the rendez-vous (or ``None`` after :data:`REJOIN_POLL_S`)."""
        listener = self.listener
        if listener is None:
            raise EOFError
        try:
            return listener.accept(REJOIN_POLL_S)
        except WeightSyncError as exc:  # a stranger, a wrong key: refused, and logged without the key
            listener.refusals.warning("model %r: refused a connection: %s", self.sink.model_id, exc)
        except OSError:  # the listener was closed under us: shutting down
            raise EOFError from None
        return None

    def admit(self, candidate: tuple[Channel, dict[str, Any]]) -> tuple[int, int] | None:
        """A worker connecting after the rendez-vous: one that died (or was dropped) comes back under its
        index and gets the newest version published; anyone else is refused with the reason."""
        channel, hello = candidate
        w = hello.get("worker_idx")
        if type(w) is int and w in self.transports and not self.sink.is_dead(w):
            self.poll([w])  # a worker killed since the last send is noticed now
        newest = self._newest_slot()
        if newest is None:
            self.discard(
                candidate,
                "the sender holds no version to hand over yet (none was sent, or the last send "
                "was cut short before any worker was told): join again after its next send",
            )
            return None
        problem = self._hello_problem(hello)
        if problem is not None:
            self.discard(candidate, problem)
            return None
        w = int(hello["worker_idx"])
        self.sink.rejoining(w, newest.version)  # from here on, a failure is this new process's
        try:
            transport = self._take_over(channel, hello)
            slot = self._slot_for(w, newest)
            transport.notify(slot, slot.version)  # type: ignore[arg-type]
        except WeightSyncError as exc:
            log.warning("model %r: worker %d could not rejoin: %s", self.sink.model_id, w, exc)
            self.sink.died(w, f"failed to rejoin ({exc})")
            return None
        return w, slot.version  # type: ignore[return-value]

    def _newest_slot(self) -> _Slot | None:
        """The slot holding the newest version published to anyone (``None`` before any)."""
        slots = [slot for pool in self.pools.values() for slot in pool.slots if slot.version is not None]
        return max(slots, key=lambda slot: slot.version) if slots else None  # type: ignore[arg-type,return-value]

    def _slot_for(self, w: int, newest: _Slot) -> _Slot:
        """A slot of ``w``'s pool holding ``newest``'s version, now read by ``w``."""
        pool = self._pool(self._pool_key(w))
        if newest in pool.slots:
            newest.readers.add(w)
            return newest
        slot = pool.acquire()  # another pool (per worker, or other memory): copy the newest version into it
        self._close_retired(pool)
        if slot is None:
            raise SyncTimeoutError(f"no free weight slot to rejoin worker {w}", model_id=self.sink.model_id)
        slot.version = None
        slot.buffer.copy_(newest.buffer)  # on the stream the newest version was written on: after that write
        self._written(slot)
        slot.digest = newest.digest
        pool.publish(slot, newest.version, [w])  # type: ignore[arg-type]
        return slot

    # --------------------------------------------------------------- shutdown
    def close(self, timeout: float) -> None:
        if self._key_file is not None:  # first: a worker that sees the channel close may look for it
            remove_key_file(self._key_file)
            self._key_file = None
        processes = [t.process for t in [*self.transports.values(), *self.departed.transports] if t.process is not None]
        for w, transport in self.transports.items():
            if not self.sink.is_dead(w):
                try:
                    transport.channel.send({"op": "bye"})
                except WeightSyncError:
                    pass
            else:
                self.departed.add(transport)
            transport.close()
        self.transports.clear()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        # Processes that exited never let their mappings of device slots go: let go for them, so freeing the slots
        # frees the memory. A live worker's mapping (a worker given up on, still running, included) keeps its
        # slot's memory until it lets go, and torch frees it then.
        self._release_departed()
        self.departed.transports.clear()
        for pool in self.pools.values():
            pool.close(processes)
        if any(pool.device is not None for pool in self.pools.values()):
            torch.cuda.ipc_collect()
        self.pools.clear()
