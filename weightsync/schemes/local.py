"""What the multiprocess and shared-memory schemes share: slots, channels, versions, acks.

Sender: ``init_on_sender`` computes the weights' layout and opens an
authenticated listener; ``connect`` accepts every worker and publishes
version 0. A send writes the weights once into a free shared slot and tells
each targeted worker which slot holds which version; workers apply and ack.

Receiver: ``connect`` joins the listener, checks the layout against its own
model, applies version 0 and acks. ``receive`` applies the newest pending
version (or each in order with ``latest_wins=False``) and acks; or a
background thread does it, and ``receive`` reports what the thread applied.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections import deque
from typing import Any

import torch

from .. import options
from ..errors import (
    ConfigurationError,
    ConnectionClosedError,
    IntegrityError,
    LifecycleError,
    SyncTimeoutError,
    WeightMismatchError,
    WeightSyncError,
    WorkerDiedError,
    raise_failures,
)
from ..integrity import check_digest, digest
from ..layout import FlatLayout
from ..strategy import WeightStrategy, check_spec, copy_tensors, flatten_weights, weights_spec, write_into
from ..transports.channel import ChannelListener, connect_channel, deadline_after, readable, remaining
from ..transports.keyfiles import (
    check_key_file_path,
    read_key_file,
    remove_key_file,
    remove_key_file_if_orphaned,
    write_key_file,
)
from ..transports.mp import MPTransport, Update
from ..transports.slots import SharedSlot, SlotPool
from .base import WeightSyncScheme

__all__ = ["LocalScheme"]

log = logging.getLogger("weightsync.schemes.local")

#: A listener's address as receiver configs name it: an abstract Unix socket (no file on disk).
ABSTRACT_ADDRESS = options.text(r"@[A-Za-z0-9_.\-]{1,100}", what="an abstract socket address (@ and a name)")


class LocalScheme(WeightSyncScheme):
    """Base of the schemes that reach worker processes on this machine.

    Args:
        strategy: ``"tensordict"`` or ``"state_dict"``.
        sync: ``send()`` waits for every targeted worker's ack.
        timeout: bound, in seconds, of every wait after connect.
        connect_timeout: bound, in seconds, of the rendez-vous.
        background_thread: receivers apply updates in a thread of their own as
            soon as they arrive; ``receive()`` then only reports what the thread
            applied. Off by default: the worker applies in its loop.
        latest_wins: a receiver that finds several pending versions applies only
            the newest (and acks it, which acks the skipped ones); ``False``
            applies each in order.
        max_slots: how many shared weight slots the sender may allocate
            (lazily); default ``num_workers + 2``, which no send pattern exceeds.
            Fewer make a send wait for lagging workers.
        checksum: the sender hashes each version's bytes (XXH3-64) and every
            receiver checks them before applying; a corrupted or truncated
            payload is refused with :class:`~weightsync.errors.IntegrityError`
            and the model keeps its weights. Off by default: see the benchmarks
            for its cost.
        flatten_sender: at ``init_on_sender``, the trainer's weights (the
            registered model; every tensor on the CPU) move into one buffer
            laid out like the slots: each tensor becomes a view of it, with its
            values, and the Parameter objects stay. A send is then one copy
            whatever the number of tensors, where copying them one by one
            costs dispatch and memory bandwidth per tensor (2000 tensors of
            50 kB took 7 to 10 ms against 5.4 ms for one copy of 100 MB).
            Off by default, because it changes the trainer's memory: code that
            captured a tensor's storage before (raw pointers, a tensor taken
            from ``.data``) no longer sees the model. A model changed since
            (a tensor replaced, moved or re-pointed) is bound anew at its next
            send.
        on_failure, max_staleness: see :class:`~weightsync.schemes.base.WeightSyncScheme`.
    """

    transport_class: type[MPTransport] = MPTransport
    #: Receivers copy every update into their model's tensors one by one, never re-pointing them.
    keep_storage = False

    def __init__(
        self,
        strategy: str | WeightStrategy = "tensordict",
        sync: bool = True,
        timeout: float = 60.0,
        connect_timeout: float = 120.0,
        background_thread: bool = False,
        latest_wins: bool = True,
        max_slots: int | None = None,
        on_failure: str = "raise",
        max_staleness: int | None = None,
        check_finite: bool = False,
        checksum: bool = False,
        flatten_sender: bool = False,
    ) -> None:
        super().__init__(
            strategy=strategy,
            sync=sync,
            timeout=timeout,
            connect_timeout=connect_timeout,
            on_failure=on_failure,
            max_staleness=max_staleness,
            check_finite=check_finite,
        )
        self.flatten_sender = bool(flatten_sender)
        if max_slots is not None and (isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots < 1):
            raise ConfigurationError(f"max_slots must be a positive int or None, got {max_slots!r}")
        self.checksum = bool(checksum)
        self.background_thread = bool(background_thread)
        self.latest_wins = bool(latest_wins)
        self.max_slots = max_slots

    def _config_fields(self) -> set[str]:
        return super()._config_fields() | {
            "background_thread",
            "latest_wins",
            "max_slots",
            "checksum",
            "flatten_sender",
        }

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        # Sender side.
        self._authkey: bytes | None = None
        self._listener: ChannelListener | None = None
        self._layout: FlatLayout | None = None
        self._pools: dict[int | None, SlotPool] = {}
        self._next_version = 0
        self._authkey_file: str | None = None
        # Receiver side.
        self._key_file: str | None = None  # the sender's auth key file this receiver read, if any
        self._transport: MPTransport | None = None
        self._layout_error: WeightMismatchError | None = None
        self._pending: deque[Update] = deque()
        self._slot_views: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}  # slot -> (buffer, views)
        # The model's tensors the last update was written to and, when they now read a slot, its views.
        self._written: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None] = ({}, None)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._applied = threading.Condition()
        self._thread_error: BaseException | None = None
        #: Held while a receiver writes or switches its model's weights; a worker
        #: whose forward pass runs beside the background thread holds it too.

    # ------------------------------------------------------------- properties
    @property
    def layout(self) -> FlatLayout | None:
        return self._layout

    @property
    def receiver_transport(self) -> MPTransport | None:
        return self._transport

    @property
    def shared_transport(self) -> SlotPool | None:
        """The sender's pool of shared weight slots (``None`` elsewhere)."""
        return self._pools.get(None)

    def _pool_key(self, worker: int) -> int | None:
        return None

    def create_transport(self, **kwargs: Any) -> MPTransport:
        """This scheme's transport over ``channel=`` for ``worker_idx=`` (sender side if this is a sender)."""
        return self.transport_class(kwargs["channel"], kwargs["worker_idx"], self if self.is_sender else None)

    # ----------------------------------------------------------------- sender
    def _init_sender_impl(self, **kwargs: Any) -> None:
        if self._num_workers is None:
            raise ConfigurationError(
                f"{type(self).__name__}.init_on_sender needs num_workers=", model_id=self._model_id
            )
        address = kwargs.pop("address", None)
        super()._init_sender_impl(**kwargs)
        self._layout = self._sender_layout()
        self._adopt_sender_model(self._layout)
        self._authkey = secrets.token_bytes(32)
        self._listener = ChannelListener(self._authkey, address)
        log.debug("model %r: listening on %s for %d workers", self._model_id, self._listener.address, self._num_workers)

    def _receiver_handoff(self) -> dict[str, Any]:
        if self._listener is None or self._authkey is None:
            return {}
        return {"address": self._listener.address, "authkey": self._authkey.hex()}

    def _receiver_connection(self) -> dict[str, Any]:
        assert self._listener is not None and self._authkey is not None
        if self._authkey_file is None:
            self._authkey_file = write_key_file(self._listener.address, self._authkey)
        return {"address": self._listener.address, "authkey_file": self._authkey_file}

    @classmethod
    def check_receiver_connection(cls, connection: Any, model_id: str) -> dict[str, Any]:
        """An abstract socket address, and the path of the key file the sender listening there writes."""
        checked = options.fields(
            connection,
            {"address": ABSTRACT_ADDRESS, "authkey_file": None},
            "connection",
            required=("address", "authkey_file"),
        )
        checked["authkey_file"] = check_key_file_path(
            checked["authkey_file"], checked["address"], "connection.authkey_file"
        )
        return checked

    def _connect_sender_impl(self, weights: Any) -> None:
        assert self._listener is not None and self._num_workers is not None
        deadline = deadline_after(self.connect_timeout)
        n = self._num_workers
        while len(self._transports) < n:
            left = remaining(deadline)
            missing = sorted(set(range(n)) - set(self._transports))
            if left <= 0:
                self._close_transports()
                raise SyncTimeoutError(
                    f"workers {missing} did not connect within {self.connect_timeout:.1f}s", model_id=self._model_id
                )
            try:
                accepted = self._listener.accept(left)
            except WeightSyncError as exc:  # a stranger or a broken peer: keep waiting for the real workers
                log.warning("model %r: %s", self._model_id, exc)
                continue
            if accepted is None:
                continue
            channel, hello = accepted
            problem = self._check_hello(hello)
            if problem:
                self._refuse(channel, problem)
                continue
            w = int(hello["worker_idx"])
            channel.send({"op": "welcome", "layout": self._layout.to_plain(), "num_workers": n})
            self._transports[w] = self.transport_class(channel, w, self)
        # Once every worker joined, the listener stays open for workers that come back after a crash.
        self._start_admitter(self._poll_listener, lambda accepted: self._admit(*accepted), lambda a: a[0].close())
        try:
            self.send_to(weights, list(range(n)), wait=True)
        except WeightSyncError as exc:
            self._mark_named_dead(exc)  # a worker whose model does not match is out for good
            raise

    def _refuse(self, channel: Any, problem: str) -> None:
        """Tell a connecting process why it is turned away, and close its channel."""
        log.warning("model %r: refused %s: %s", self._model_id, channel.peer, problem)
        try:
            channel.send({"op": "refused", "reason": problem})
        except WeightSyncError:
            pass
        channel.close()

    def _rendezvous_complete(self) -> bool:
        return self._num_workers is not None and len(self._transports) == self._num_workers

    def _check_hello(self, hello: dict[str, Any]) -> str | None:
        w = hello.get("worker_idx")
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < (self._num_workers or 0):
            return f"worker_idx {w!r} is not in 0..{(self._num_workers or 0) - 1}"
        if w in self._transports and w not in self._failed:
            return f"worker {w} is already connected"
        if hello.get("model_id") != self._model_id:
            return f"model_id {hello.get('model_id')!r} does not match {self._model_id!r}"
        return None

    # ----------------------------------------------------------------- rejoin
    def _poll_listener(self) -> tuple[Any, dict[str, Any]] | None:
        """The admitter's wait: a worker connecting after the rendez-vous (or ``None`` after 0.1 s)."""
        listener = self._listener
        if listener is None:
            raise EOFError
        try:
            return listener.accept(0.1)
        except WeightSyncError as exc:  # a stranger, a wrong key: refused, and logged without the key
            log.warning("model %r: refused a connection: %s", self._model_id, exc)
        except OSError:  # the listener was closed under us: shutting down
            raise EOFError from None
        return None

    def _admit(self, channel: Any, hello: dict[str, Any]) -> None:
        """A worker connecting after the rendez-vous: one that died (or was dropped) comes back under its
        index and gets the newest version published; anyone else is refused with the reason."""
        w = hello.get("worker_idx")
        if isinstance(w, int) and w in self._transports and w not in self._failed:
            self.drain([w])  # a worker killed since the last send is noticed now
        problem = self._check_hello(hello)
        if problem is None and self._version is None:
            problem = "the sender has not published any version yet"
        if problem:
            self._refuse(channel, problem)
            return
        w = int(hello["worker_idx"])
        assert self._layout is not None and self._num_workers is not None
        old = self._transports.get(w)
        if old is not None:
            old.close()
        transport = self._transports[w] = self.transport_class(channel, w, self)
        self._failed.pop(w, None)  # from here on, a failure is this new process's
        try:
            channel.send({"op": "welcome", "layout": self._layout.to_plain(), "num_workers": self._num_workers})
            slot = self._newest_slot_for(w)
            transport.notify(slot, slot.version)
        except WeightSyncError as exc:
            log.warning("model %r: worker %d could not rejoin: %s", self._model_id, w, exc)
            self._mark_dead(w, WorkerDiedError(f"failed to rejoin ({exc})", model_id=self._model_id, worker_idx=w))
            return
        self._rejoined(w, slot.version)

    def _newest_slot_for(self, w: int) -> SharedSlot:
        """A slot of ``w``'s pool holding the newest version published to anyone, now read by ``w``."""
        newest = max(
            (slot for pool in self._pools.values() for slot in pool.slots if slot.version is not None),
            key=lambda slot: slot.version,
        )
        pool = self._pool(self._pool_key(w))
        if newest not in pool.slots:  # per-worker pools: copy the newest version into this worker's pool
            slot = pool.acquire()
            if slot is None:
                raise SyncTimeoutError(f"no free weight slot to rejoin worker {w}", model_id=self._model_id)
            slot.version = None
            slot.buffer.copy_(newest.buffer)
            slot.digest = newest.digest
            pool.publish(slot, newest.version, [w])
            return slot
        newest.readers.add(w)
        return newest

    def _send_impl(self, weights: Any, targets: list[int], wait: bool) -> None:
        self.send_to(weights, targets, wait=wait)

    def send_to(self, weights: Any, targets: list[int], *, wait: bool) -> None:
        """Publish one new version to ``targets``; wait for their acks when ``wait``."""
        assert self._layout is not None
        flat, whole = self._sender_weights(weights, self._layout)
        failures = {w: self._failed[w] for w in targets if w in self._failed}
        live = [w for w in targets if w not in self._failed]
        deadline = deadline_after(self.timeout)
        version = self._next_version
        self.drain(version=version)
        failures.update({w: self._failed[w] for w in live if w in self._failed})  # found dead just now
        live = [w for w in live if w not in self._failed]
        by_pool: dict[int | None, list[int]] = {}
        for w in live:
            by_pool.setdefault(self._pool_key(w), []).append(w)
        # Every slot is secured before anything is written, so a send that times out here publishes nothing.
        slots = {key: self._acquire(self._pool(key), deadline, version) for key in by_pool}
        published: dict[int, SharedSlot] = {}
        payload_digest = None  # every pool gets the same bytes: hashed once
        for key, workers in by_pool.items():
            slots[key].version = None  # until the write completes, the slot holds no version (rejoins read it)
            if whole is not None:
                copy_tensors([slots[key].buffer], [whole])
            else:
                write_into(slots[key].views, flat)
            if self.checksum and payload_digest is None:
                payload_digest = digest([slots[key].buffer])
            slots[key].digest = payload_digest
            self._pools[key].publish(slots[key], version, workers)
            published.update(dict.fromkeys(workers, slots[key]))
        self._next_version += 1
        self._version = version
        for w, slot in published.items():
            try:
                self._transports[w].notify(slot, version)
            except WorkerDiedError as exc:
                failures[w] = self._mark_dead(w, exc)
        if wait:
            failures.update(self._await_acks({w: version for w in published if w not in failures}, deadline))
        else:
            failures.update(self._take_errors(published))
        raise_failures(failures, model_id=self._model_id, version=version)

    def _pool(self, key: int | None) -> SlotPool:
        pool = self._pools.get(key)
        if pool is None:
            assert self._layout is not None
            limit = self.max_slots or (self._num_workers or 1) + 2
            pool = self._pools[key] = SlotPool(
                self._layout, limit, pinning=self.transport_class.pinning, tag=f"{os.getpid()}-{key}"
            )
        return pool

    def _acquire(self, pool: SlotPool, deadline: float, version: int) -> SharedSlot:
        slot = pool.acquire()
        while slot is None:
            busy = sorted(pool.busy_workers())
            if remaining(deadline) <= 0:
                raise SyncTimeoutError(
                    f"no free weight slot within {self.timeout:.1f}s: workers {busy} still hold or read older "
                    f"versions (max_slots={pool.max_slots})",
                    model_id=self._model_id,
                    version=version,
                )
            self._wait_readable(busy, deadline)
            self.drain(busy)
            slot = pool.acquire()
        return slot

    def _wait_readable(self, workers: list[int], deadline: float) -> None:
        channels = [self._transports[w].channel for w in workers if w in self._transports and w not in self._failed]
        fds = [c.fileno() for c in channels if not c.connection.closed]
        if fds:
            readable(fds, remaining(deadline))

    def drain(self, workers: list[int] | None = None, version: int | None = None) -> None:
        """Process every ack already received, without waiting; a worker found gone is named with ``version``
        (the send that found it), else with the last version it was sent."""
        for w in workers if workers is not None else list(self._transports):
            transport = self._transports.get(w)
            if transport is None or w in self._failed:
                continue
            try:
                while transport.channel.poll(0):
                    msg = transport.channel.recv(0)
                    if msg is None:
                        break
                    self._on_ack(w, msg)
            except ConnectionClosedError as exc:
                # A worker that reported a failure and then left is remembered for that failure.
                self._mark_dead(
                    w,
                    transport.last_error
                    or WorkerDiedError(
                        f"its channel closed ({exc.detail})",
                        model_id=self._model_id,
                        worker_idx=w,
                        version=transport.sent if version is None else version,
                    ),
                )

    def _on_ack(self, w: int, msg: dict[str, Any]) -> None:
        transport = self._transports[w]
        error = transport.handle_ack(msg, self._model_id)
        held = msg.get("held")
        for pool in self._pools.values():
            pool.on_ack(w, int(msg["version"]), None if held is None else int(held))
        if error is not None:
            self._errors[w] = error

    def _on_worker_lost(self, w: int) -> None:
        for pool in self._pools.values():
            pool.drop_worker(w)
        # A worker given up on (dead, or dropped after a timeout) finds its channel closed if it
        # comes back to life, and may rejoin.
        self._transports[w].channel.close()

    def _take_errors(self, workers: Any) -> dict[int, WeightSyncError]:
        return {w: self._errors.pop(w) for w in list(self._errors) if w in workers}

    def _await_acks(self, expected: dict[int, int], deadline: float) -> dict[int, WeightSyncError]:
        """Wait until each worker acked at least its expected version; return the failures."""
        failures: dict[int, WeightSyncError] = {}
        while True:
            self.drain()
            failures.update(self._gone_before_acking(expected, failures))
            failures.update(self._take_errors(expected))
            pending = self._missing_acks(expected, failures)
            if not pending:
                return failures
            if remaining(deadline) <= 0:
                failures.update(self._ack_timeouts(pending, expected, within=f"{self.timeout:.1f}s"))
                return failures
            self._wait_readable(list(self._transports), deadline)

    def wait_for(self, workers: list[int], timeout: float | None) -> None:
        deadline = deadline_after(self.timeout if timeout is None else timeout)
        expected = {w: self._transports[w].sent for w in workers if self._transports[w].sent is not None}
        failures = {w: self._failed[w] for w in workers if w in self._failed}
        failures.update(self._await_acks(expected, deadline))
        raise_failures(failures, model_id=self._model_id, version=self._version)

    def _wait_impl(self, timeout: float) -> None:
        self.wait_for(sorted(self._transports), timeout)

    def _close_transports(self) -> None:
        for transport in self._transports.values():
            transport.close()
        self._transports.clear()

    # --------------------------------------------------------------- receiver
    def _init_receiver_impl(self, **kwargs: Any) -> None:
        address = kwargs.pop("address", None)
        authkey = kwargs.pop("authkey", None)
        authkey_file = kwargs.pop("authkey_file", None)
        super()._init_receiver_impl(**kwargs)
        if self._model is None:
            raise ConfigurationError(
                "init_on_receiver needs model= (or a context holding the model)", model_id=self._model_id
            )
        handoff = dict(self._handoff or {})
        if address is not None:
            handoff["address"] = address
        if authkey is not None:
            handoff["authkey"] = authkey.hex() if isinstance(authkey, bytes) else authkey
        authkey_file = authkey_file or handoff.pop("authkey_file", None)
        if authkey_file is not None and authkey is None:
            handoff["authkey"] = read_key_file(authkey_file, model_id=self._model_id)
            self._key_file = authkey_file
        if not handoff.get("address") or not handoff.get("authkey"):
            raise LifecycleError(
                "this receiver does not know where its sender is: hand it the scheme pickled after "
                "init_on_sender(), or pass address= and authkey=",
                model_id=self._model_id,
            )
        self._handoff = handoff

    def _connect_receiver_impl(self) -> None:
        assert self._handoff is not None and self._worker_idx is not None
        deadline = deadline_after(self.connect_timeout)
        hello = {"worker_idx": self._worker_idx, "pid": os.getpid(), "model_id": self._model_id}
        channel = connect_channel(
            self._handoff["address"], bytes.fromhex(self._handoff["authkey"]), hello, self.connect_timeout
        )
        try:
            welcome = channel.recv_until(deadline, "the sender's welcome")
            if welcome["op"] == "refused":
                raise ConfigurationError(
                    f"the sender refused this worker: {welcome.get('reason')}",
                    model_id=self._model_id,
                    worker_idx=self._worker_idx,
                )
            self._layout = FlatLayout.from_plain(welcome["layout"])
            self._num_workers = int(welcome["num_workers"])
            self._transport = self.transport_class(channel, self._worker_idx)
            try:
                check_spec(
                    self._layout.spec,
                    weights_spec(flatten_weights(self._model, self._strategy.extract_as)),
                    model_id=self._model_id,
                    worker_idx=self._worker_idx,
                )
            except WeightMismatchError as exc:
                self._layout_error = exc
            while self._version is None:
                if remaining(deadline) <= 0:
                    raise SyncTimeoutError(
                        "no initial weights from the sender in time",
                        model_id=self._model_id,
                        worker_idx=self._worker_idx,
                    )
                self._poll_and_apply(remaining(deadline))
        except BaseException:
            channel.close()
            self._transport = None
            raise
        self._reported_version = self._version  # connect() itself delivered version 0
        if self.background_thread:
            self._thread = threading.Thread(
                target=self._thread_loop, name=f"weightsync-{self._model_id}-receiver", daemon=True
            )
            self._thread.start()

    def _poll_and_apply(self, timeout: float) -> int | None:
        """Apply what the sender queued; return the version now held if it changed."""
        assert self._transport is not None
        try:
            self._pending.extend(self._transport.receive_weights(0.0 if self._pending else timeout))
        except ConnectionClosedError:
            if not self._pending:
                raise
        if not self._pending:
            return None
        if self.latest_wins:
            update = self._pending[-1]
            self._pending.clear()
        else:
            update = self._pending.popleft()  # one version per call: the worker's loop sees each
        self._apply(update)
        return self._version

    def _apply(self, update: Update) -> None:
        assert self._transport is not None and self._layout is not None
        where = {"model_id": self._model_id, "worker_idx": self._worker_idx, "version": update.version}
        try:
            if self._layout_error is not None:
                raise self._layout_error
            buffer = self._transport.slot_buffers.get(update.slot)
            if update.slot in self._transport.bad_slots:
                raise IntegrityError(self._transport.bad_slots[update.slot], **where)
            if buffer is None:
                raise LifecycleError(f"update names slot {update.slot}, which was never shared", **where)
            check_digest([buffer], update.digest, **where)
            dst = flatten_weights(self._model, self._strategy.extract_as)
            held = self._transport.bound.holds(dst)  # the model exactly as bound: its keys, shapes, dtypes hold
            if not held:
                check_spec(self._layout.spec, weights_spec(dst), **where)
            with self.weights_lock:  # weights and version change together for readers holding the lock
                views = (
                    None if self.keep_storage else self._transport.update_model(dst, update.slot, self._layout, held)
                )
                if views is None:  # tensor by tensor: keep_storage, or a model off the CPU or in shared memory
                    cached = self._slot_views.get(update.slot)
                    if cached is None or cached[0] is not buffer:  # a slot's typed views are made once
                        cached = self._slot_views[update.slot] = (buffer, self._layout.views(buffer))
                    shared = write_into(dst, cached[1], share=self._transport.pinning)
                    views = cached[1] if shared else None
                self._written = (dst, views)
                self._version = update.version
        except Exception as exc:
            self._transport.send_ack(update.version, error=exc, held=self._version)
            raise
        self._transport.send_ack(update.version, held=update.version)

    def _thread_loop(self) -> None:
        while not self._stop.is_set():
            try:
                changed = self._poll_and_apply(0.05)
            except ConnectionClosedError as exc:
                with self._applied:
                    self._thread_error = exc
                    self._applied.notify_all()
                return
            except Exception as exc:  # noqa: BLE001 - reported to the worker at its next receive()
                log.error("model %r worker %s: update failed: %s", self._model_id, self._worker_idx, exc)
                with self._applied:
                    self._thread_error = exc
                    self._applied.notify_all()
                continue
            if changed is not None:
                with self._applied:
                    self._applied.notify_all()

    def _receive_impl(self, timeout: float) -> Any:
        if self._thread is None:
            changed = self._poll_and_apply(timeout)
        else:
            with self._applied:
                self._applied.wait_for(
                    lambda: self._thread_error is not None or self._version != self._reported_version, timeout
                )
                changed = self._version if self._version != self._reported_version else None
                if changed is None and self._thread_error is not None:
                    error = self._thread_error
                    if not isinstance(error, ConnectionClosedError):
                        self._thread_error = None  # an apply failure is reported once; a closed channel stays
                    raise error
        if changed is None:
            return None
        self._reported_version = changed
        with self.weights_lock:  # the tensors the update was written to: no second walk of the model
            dst, views = self._written
            if views is not None:  # the model reads the slot: its views are plain tensors, no detach (0.5 us each)
                return self._strategy.format({k: views[k] for k in dst})
            return self._strategy.format({k: v.detach() for k, v in dst.items()})

    # --------------------------------------------------------------- shutdown
    def _shutdown_impl(self) -> None:
        self._end_thread(self._thread, self._stop, "receiver")
        self._thread = None
        sender_closed = self._transport is not None and self._transport.closed_by_sender
        if self._transport is not None:
            if self._transport.pinning and self._model is not None:
                # The model still reads a shared slot: give it private memory so the slot can be freed.
                with self.weights_lock:
                    self._transport.release_model()
                    for tensor in flatten_weights(self._model, self._strategy.extract_as).values():
                        if tensor.is_cpu and tensor.is_shared():  # (a model the user shared is moved too)
                            tensor.data = tensor.data.clone()
            self._slot_views.clear()  # they hold the slots' mappings
            self._written = ({}, None)
            self._transport.close()
            self._transport = None
        if self._key_file is not None:
            # A sender that shut down removed its key file before closing; one that was killed could not.
            remove_key_file_if_orphaned(self._key_file, grace=1.0 if sender_closed else 0.0)
            self._key_file = None
        self._stop_admitter()
        if self._authkey_file is not None:  # first: a worker that sees the channel close may look for it
            remove_key_file(self._authkey_file)
            self._authkey_file = None
        for transport in self._transports.values():
            if transport.dead is None:
                try:
                    transport.channel.send({"op": "bye"})
                except WeightSyncError:
                    pass
        self._close_transports()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
