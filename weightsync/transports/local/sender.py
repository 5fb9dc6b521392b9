"""The trainer's side of the local engine (``multiprocess``, ``shared_mem``): a listener, slots, channels.

``init_on_sender`` opens an authenticated listener on an abstract Unix
socket; the rendez-vous accepts every worker and sends each the layout. A
version is staged by writing the weights once into a free shared slot (one
per pool: shared by all workers, or one pool per worker), and submitted by
telling each targeted worker which slot holds it. A slot is written only
when no worker still reads it: that rule is what makes torn reads impossible.
The listener stays open after the rendez-vous, for workers that come back.

Where the slots live depends on the devices. The trainer's weights on a GPU
and a worker's model on a GPU: the worker's pool is in the trainer's GPU
memory (one device-to-device copy per send, then an event; no host memory on
the way). Otherwise, host memory (pinned when the trainer's weights are on a
GPU), so a CUDA trainer with CPU workers and a CPU trainer with CUDA workers
both copy through page-locked memory. A ``checksum`` keeps every pool in host
memory, where it is computed.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any

import torch

from ...core.engine import Outgoing, SenderEngine, Sink
from ...core.timing import WAIT_TICK_S, remaining
from ...errors import SyncTimeoutError, WeightSyncError, WorkerDiedError
from ...integrity import digest
from ...tensors import cuda
from ...tensors.copies import copy_tensors, write_into
from ...tensors.layout import FlatLayout
from ..keyfiles import KEY_BYTES, remove_key_file, write_key_file
from .channel import Channel, ChannelListener, readable
from .mp import MPTransport
from .slots import DeviceSlot, SharedSlot, SlotPool

Slot = SharedSlot | DeviceSlot
#: A pool's key: the kind of memory (``"host"``, ``"cuda"``) and the worker it serves (``None``: every worker).
PoolKey = tuple[str, int | None]

__all__ = ["LocalSender"]

log = logging.getLogger("weightsync.transports.local")

#: Seconds the rejoin thread waits for a connection before it looks again whether it must stop.
REJOIN_POLL_S = 0.1


class LocalSender(SenderEngine):
    """The sender's listener, slot pools and one :class:`MPTransport` (or subclass) per worker.

    Args:
        transport_class: the transport of each worker (its ``pinning`` says whether workers keep reading the slot
            of the version they hold).
        max_slots: the most slots a pool may hold (``None``: ``num_workers + 2``).
        per_worker: every worker has a pool of its own.
        checksum: hash each version's bytes for the workers to check.
        address: the listener's abstract address (``None``: a random one).
        gpu: the GPU every weight of the trainer is on, if one: workers on a GPU read slots in its memory.
    """

    rejoins = True

    def __init__(
        self,
        sink: Sink,
        layout: FlatLayout,
        num_workers: int,
        *,
        transport_class: type[MPTransport],
        max_slots: int | None,
        per_worker: bool,
        checksum: bool,
        address: str | None = None,
        gpu: torch.device | None = None,
    ) -> None:
        super().__init__(sink, layout, num_workers)
        self.transport_class = transport_class
        self.max_slots = max_slots or num_workers + 2
        self.per_worker = per_worker
        self.checksum = checksum
        self.gpu = gpu
        self.pools: dict[PoolKey, SlotPool] = {}
        self.kinds: dict[int, str] = {}  # where each worker's slots live, from the device its hello names
        self._orphaned: list[dict[str, Any]] = []  # CUDA shares of worker processes that are gone
        self._authkey = secrets.token_bytes(KEY_BYTES)
        self._key_file: str | None = None
        self.listener: ChannelListener | None = ChannelListener(self._authkey, address)
        log.debug("model %r: listening on %s for %d workers", sink.model_id, self.listener.address, num_workers)

    @property
    def shared(self) -> SlotPool | None:
        """The pool of slots every worker reads (``None`` with a pool per worker): the GPU's, if workers read one."""
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
                raise SyncTimeoutError(
                    f"workers {missing} did not connect within {timeout:.1f}s", model_id=self.sink.model_id
                )
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
        """Why a hello (bounded JSON from a key holder) cannot be taken: every field it names is type-checked."""
        w = hello.get("worker_idx")
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < self.num_workers:
            return f"worker_idx {str(w)[:40]!r} is not in 0..{self.num_workers - 1}"
        pid, texts = hello.get("pid"), {k: hello.get(k) for k in ("model_id", "device")}
        if isinstance(pid, bool) or not isinstance(pid, int):
            return f"its hello's pid is a {type(pid).__name__}, not an integer"
        for key, value in texts.items():
            if value is not None and not isinstance(value, str):
                return f"its hello's {key} is a {type(value).__name__}, not a string"
        if w in self.transports and not self.sink.is_dead(w):
            return f"worker {w} is already connected"
        if hello.get("model_id") != self.sink.model_id:
            return f"model_id {str(hello.get('model_id'))[:80]!r} does not match {self.sink.model_id!r}"
        return None

    def _welcome(self, channel: Channel, hello: dict[str, Any]) -> None:
        """Take ``channel`` as its worker's, or turn it away with the reason."""
        problem = self._hello_problem(hello)
        if problem is not None:
            self.discard((channel, hello), problem)
        else:
            self._take_over(channel, hello)

    def _take_over(self, channel: Channel, hello: dict[str, Any]) -> MPTransport:
        """Make ``channel`` its worker's (sending it the layout), closing any channel the worker had."""
        w = int(hello["worker_idx"])
        channel.send({"op": "welcome", "layout": self.layout.to_plain(), "num_workers": self.num_workers})
        old = self.transports.get(w)
        if old is not None:
            old.close()
            self._orphaned += old.shares  # that process is gone: it will never let its mappings go
        device = hello.get("device")
        on_gpu = isinstance(device, str) and device.startswith("cuda")
        self.kinds[w] = "cuda" if self.gpu is not None and on_gpu and not self.checksum else "host"
        transport = self.transports[w] = self.transport_class(channel, w, self.sink)
        return transport

    def discard(self, candidate: Any, problem: str = "the sender is shutting down") -> None:
        """Tell a connecting process why it is turned away, and close its channel."""
        channel = candidate[0]
        log.warning("model %r: refused %s: %s", self.sink.model_id, channel.peer, problem)
        try:
            channel.send({"op": "refused", "reason": problem})
        except WeightSyncError:
            pass
        channel.close()

    # ------------------------------------------------------------------ acks
    def poll(self, workers: list[int]) -> None:
        for w in workers:
            transport = self.transports.get(w)
            if transport is None or self.sink.is_dead(w):
                continue
            acks, closed = transport.acks(self.sink.model_id)
            for ack in acks:
                self._on_ack(w, ack)
            if closed is not None:
                # A worker that reported a failure and then left is remembered for that failure.
                self.sink.died(w, transport.last_error or f"its channel closed ({closed.detail})")

    def _on_ack(self, w: int, ack: Any) -> None:
        for pool in self.pools.values():
            pool.on_ack(w, ack.version, ack.held)
        if ack.error is not None:
            self.sink.failed(w, ack.error)
        if ack.held is not None:
            self.sink.acked(w, ack.held)

    def wait(self, workers: list[int], deadline: float) -> None:
        channels = [self.transports[w].channel for w in workers if w in self.transports and not self.sink.is_dead(w)]
        fds = [c.fileno() for c in channels if not c.connection.closed]
        if fds:
            readable(fds, remaining(deadline))

    def lost(self, worker: int, reason: str) -> None:
        for pool in self.pools.values():
            pool.drop_worker(worker)
        # A worker given up on (dead, or dropped after a timeout) finds its channel closed if it comes back
        # to life, and may rejoin.
        transport = self.transports.get(worker)
        if transport is not None:
            transport.channel.close()

    # ---------------------------------------------------------------- sending
    def _pool_key(self, worker: int) -> PoolKey:
        return self.kinds.get(worker, "host"), worker if self.per_worker else None

    def _pool(self, key: PoolKey) -> SlotPool:
        pool = self.pools.get(key)
        if pool is None:
            kind, worker = key
            pool = self.pools[key] = SlotPool(
                self.layout,
                self.max_slots,
                pinning=self.transport_class.pinning,
                tag=f"{os.getpid()}-{worker}",
                device=self.gpu if kind == "cuda" else None,
                pin=self.gpu is not None,
            )
        return pool

    def _written(self, slot: Slot) -> None:
        """``slot`` was just written on the trainer's stream: mark the end of the write for the workers' streams
        (a device slot), or wait for it (a host slot a GPU wrote into: its readers read it from the host)."""
        if isinstance(slot, DeviceSlot):
            assert slot.event is not None
            slot.event.record()
        elif self.gpu is not None:
            torch.cuda.current_stream(self.gpu).synchronize()

    def _acquire(self, pool: SlotPool, deadline: float, version: int) -> Slot:
        """A slot of ``pool`` no worker reads, waiting (until ``deadline``) for workers to ack newer versions."""
        slot = pool.acquire()
        while slot is None:
            busy = sorted(pool.busy_workers())
            if remaining(deadline) <= 0:
                raise SyncTimeoutError(
                    f"no free weight slot in time: workers {busy} still hold or read older versions "
                    f"(max_slots={pool.max_slots})",
                    model_id=self.sink.model_id,
                    version=version,
                )
            self.wait(busy, deadline)
            self.poll(busy)
            slot = pool.acquire()
        return slot

    def stage(self, out: Outgoing, deadline: float) -> dict[int, Slot]:
        by_pool: dict[PoolKey, list[int]] = {}
        for w in out.workers:
            by_pool.setdefault(self._pool_key(w), []).append(w)
        # Every slot is secured before anything is written, so a send that times out here publishes nothing.
        slots = {key: self._acquire(self._pool(key), deadline, out.version) for key in by_pool}
        staged: dict[int, Slot] = {}
        payload_digest = None  # every pool gets the same bytes: hashed once
        for key, members in by_pool.items():
            slot = slots[key]
            slot.version = None  # until the write completes, the slot holds no version (rejoins read it)
            if out.whole is not None:
                copy_tensors([slot.buffer], [out.whole])
            else:
                write_into(slot.views, out.flat)
            self._written(slot)
            if self.checksum and payload_digest is None:
                payload_digest = digest([slot.buffer])
            slot.digest = payload_digest
            self.pools[key].publish(slot, out.version, members)
            staged.update(dict.fromkeys(members, slot))
        return staged

    def submit(self, out: Outgoing, staged: dict[int, Slot]) -> None:
        for w in out.workers:
            try:
                self.transports[w].notify(staged[w], out.version)
            except WorkerDiedError as exc:
                self.sink.died(w, exc.detail)

    # ----------------------------------------------------------------- rejoin
    def poll_rejoin(self) -> tuple[Channel, dict[str, Any]] | None:
        """A worker connecting after the rendez-vous (or ``None`` after :data:`REJOIN_POLL_S`)."""
        listener = self.listener
        if listener is None:
            raise EOFError
        try:
            return listener.accept(REJOIN_POLL_S)
        except WeightSyncError as exc:  # a stranger, a wrong key: refused, and logged without the key
            log.warning("model %r: refused a connection: %s", self.sink.model_id, exc)
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
            self.discard(candidate, "the sender has not published any version yet")
            return None
        problem = self._hello_problem(hello)
        if problem is not None:
            self.discard(candidate, problem)
            return None
        w = int(hello["worker_idx"])
        self.sink.rejoining(w)  # from here on, a failure is this new process's
        try:
            transport = self._take_over(channel, hello)
            slot = self._slot_for(w, newest)
            transport.notify(slot, slot.version)  # type: ignore[arg-type]
        except WeightSyncError as exc:
            log.warning("model %r: worker %d could not rejoin: %s", self.sink.model_id, w, exc)
            self.sink.died(w, f"failed to rejoin ({exc})")
            return None
        return w, slot.version  # type: ignore[return-value]

    def _newest_slot(self) -> Slot | None:
        """The slot holding the newest version published to anyone (``None`` before any)."""
        slots = [slot for pool in self.pools.values() for slot in pool.slots if slot.version is not None]
        return max(slots, key=lambda slot: slot.version) if slots else None  # type: ignore[arg-type,return-value]

    def _slot_for(self, w: int, newest: Slot) -> Slot:
        """A slot of ``w``'s pool holding ``newest``'s version, now read by ``w``."""
        pool = self._pool(self._pool_key(w))
        if newest in pool.slots:
            newest.readers.add(w)
            return newest
        slot = pool.acquire()  # another pool (per worker, or other memory): copy the newest version into it
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
        for w, transport in self.transports.items():
            if not self.sink.is_dead(w):
                try:
                    transport.channel.send({"op": "bye"})
                except WeightSyncError:
                    pass
            else:
                self._orphaned += transport.shares
            transport.close()
        self.transports.clear()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        # The dead never let their mappings of device slots go: let go for them, so freeing the slots frees the
        # memory. A live worker's mapping keeps its slot's memory until it lets go (torch frees it then).
        for share in self._orphaned:
            cuda.release_share(share)
        self._orphaned.clear()
        for pool in self.pools.values():
            pool.close()
        if any(pool.device is not None for pool in self.pools.values()):
            torch.cuda.ipc_collect()
        self.pools.clear()
