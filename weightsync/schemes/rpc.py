"""``RPCWeightSyncScheme``: weights to named workers over ``torch.distributed.rpc`` (TensorPipe)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from .. import options
from ..errors import (
    ConfigurationError,
    ConnectionClosedError,
    ReceiverError,
    SyncTimeoutError,
    WeightSyncError,
    WorkerDiedError,
    raise_failures,
)
from ..integrity import check_digest, digest
from ..layout import FlatLayout
from ..strategy import (
    WeightStrategy,
    check_spec,
    copy_tensors,
    flatten_weights,
    in_shared_memory,
    weights_spec,
    write_into,
)
from ..transports.channel import deadline_after, remaining
from ..transports.distributed import first_line, is_loopback, resolve_master
from ..transports.rpc import (
    SENDER_NAME,
    RPCTransport,
    Session,
    _agent_running,
    default_worker_name,
    drop_mailbox,
    join_worker_session,
    leave_session,
    mailbox,
    open_sender_session,
    sender_gone,
    start_agent,
)
from ..transports.staging import StagingPool
from .acked import AckedScheme
from .base import SENDER_CONNECTED
from .distributed import WORLD_SIZE

__all__ = ["RPCWeightSyncScheme"]

# A worker that got no update checks, at most this often (seconds), that its sender is still there.
SENDER_PROBE_EVERY = 0.5


class RPCWeightSyncScheme(AckedScheme):
    """Synchronize a model to workers reached by ``torch.distributed.rpc``.

    A send copies the weights once into a flat buffer and makes one RPC per
    targeted worker carrying it. The worker holds the update until its loop
    calls ``receive()``, applies it, and answers: the answer is the ack, so
    ``send_async`` returns futures that ``wait_async`` (or a transport's
    ``wait_ack``) completes, each bounded by ``timeout``. A worker whose
    process dies fails its RPC at once and is named.

    By default the scheme runs the RPC world itself: the sender serves a TCP
    store on ``master_addr:master_port`` and is ``weightsync-trainer``;
    worker ``i`` is ``weightsync-worker-<i>``. Every RPC scheme of a process
    shares that world (one agent per process). If your code already called
    ``rpc.init_rpc``, pass ``worker_names=`` (the workers' RPC names) to
    ``init_on_sender`` and the scheme uses your agent as it is.

    Args:
        master_addr: the sender's host as workers reach it (``None``:
            ``MASTER_ADDR``, else 127.0.0.1). The store binds this address only.
        master_port: the store's port (``None``: ``MASTER_PORT``, else a free port).
        latest_wins: a worker that fell behind applies only the newest update waiting for it.
        max_buffers: staging buffers the sender may hold for updates not acked yet.
        keep_storage: workers copy each update into their model's own
            tensors, whose memory then never changes. By default a worker
            whose model is on the CPU (and whose weights travel in their own
            dtype) switches its tensors to the buffer the update arrived in
            (a fresh one per message), which saves a copy of the weights per
            update. At the first update each tensor becomes a view of the
            buffer (the Parameter objects stay); later updates swap the
            memory behind that one storage with the new buffer's, O(1)
            whatever the number of tensors. A model in shared memory at
            ``init_on_receiver`` (``share_memory()``) is always copied into.
        allow_pickle: let ``master_addr`` be a network address. ``torch.distributed.rpc`` unpickles
            every message its peers send (that is how it calls functions), so an RPC world reachable
            from other machines runs whatever they send: opt in only if every machine that can reach
            it is yours. Off, a non-loopback ``master_addr`` is refused. An agent you started yourself
            (``worker_names=``) is yours to secure.
        Other arguments: see :class:`~weightsync.schemes.base.WeightSyncScheme`.
    """

    backend = "rpc"

    def __init__(
        self,
        strategy: str | WeightStrategy = "state_dict",
        sync: bool = True,
        timeout: float = 60.0,
        connect_timeout: float = 120.0,
        master_addr: str | None = None,
        master_port: int | None = None,
        latest_wins: bool = True,
        max_buffers: int = 2,
        wire_dtype: str | None = None,
        keep_storage: bool = False,
        on_failure: str = "raise",
        max_staleness: int | None = None,
        check_finite: bool = False,
        checksum: bool = False,
        allow_pickle: bool = False,
        flatten_sender: bool = False,
    ) -> None:
        super().__init__(
            strategy=strategy,
            sync=sync,
            timeout=timeout,
            connect_timeout=connect_timeout,
            wire_dtype=wire_dtype,
            on_failure=on_failure,
            max_staleness=max_staleness,
            check_finite=check_finite,
            checksum=checksum,
            flatten_sender=flatten_sender,
        )
        if isinstance(max_buffers, bool) or not isinstance(max_buffers, int) or max_buffers < 1:
            raise ConfigurationError(f"max_buffers must be a positive int, got {max_buffers!r}")
        resolve_master(master_addr, master_port)
        self.master_addr = master_addr
        self.master_port = master_port
        self.latest_wins = bool(latest_wins)
        self.max_buffers = max_buffers
        self.keep_storage = bool(keep_storage)
        self.allow_pickle = bool(allow_pickle)

    def _config_fields(self) -> set[str]:
        return super()._config_fields() | {
            "master_addr",
            "master_port",
            "latest_wins",
            "max_buffers",
            "keep_storage",
            "allow_pickle",
        }

    def _check_exposure(self, host: str, **where: Any) -> None:
        """Refuse an RPC world reachable from other machines unless ``allow_pickle`` says so."""
        if not self.allow_pickle and not is_loopback(host):
            raise ConfigurationError(
                f"master_addr={host!r} opens this RPC world to other machines, and torch.distributed.rpc "
                "unpickles every message its peers send: set allow_pickle=True if every machine that can reach "
                f"{host} is yours (see docs/multinode.md), or keep master_addr on loopback",
                **where,
            )

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        self._session: Session | None = None
        self._layout: FlatLayout | None = None
        self._pool: StagingPool | None = None
        self._answered = threading.Event()
        # Receiver side.
        self._mailbox: Any = None
        self._switch = False  # whether this receiver's model takes each message's buffer (set at connect)
        self._probed_at = 0.0  # when receive() last checked that the sender is still there

    @property
    def layout(self) -> FlatLayout | None:
        return self._layout

    def create_transport(self, **kwargs: Any) -> RPCTransport:
        """A transport to worker ``worker_idx`` (RPC name ``worker_name``) bound to this scheme."""
        return RPCTransport(scheme=self, **kwargs)

    # ----------------------------------------------------------------- sender
    def _init_sender_impl(self, **kwargs: Any) -> None:
        names = kwargs.pop("worker_names", None)
        super()._init_sender_impl(**kwargs)
        if names is not None:
            names = [str(n) for n in names]
            if self._num_workers is not None and self._num_workers != len(names):
                raise ConfigurationError(
                    f"num_workers={self._num_workers} but {len(names)} worker_names", model_id=self._model_id
                )
            if not _agent_running():
                raise ConfigurationError(
                    "worker_names= uses an RPC agent you started; call rpc.init_rpc first, or leave worker_names "
                    "out and the scheme runs the RPC world itself",
                    model_id=self._model_id,
                )
            self._num_workers = len(names)
        if self._num_workers is None:
            raise ConfigurationError("RPCWeightSyncScheme.init_on_sender needs num_workers= (or worker_names=)")
        self._layout = self._sender_layout()
        self._adopt_sender_model(self._layout)
        if names is None:
            master = resolve_master(self.master_addr, self.master_port)
            self._check_exposure(master[0], model_id=self._model_id)
            self._session = open_sender_session(master, self._num_workers + 1, self.connect_timeout)
        self._transports = {
            w: self.create_transport(worker_idx=w, worker_name=names[w] if names else None)
            for w in range(self._num_workers)
        }

    def _receiver_handoff(self) -> dict[str, Any]:
        sess = self._session
        if sess is None:
            return {"external": True}
        return {
            "token": sess.token,
            "master_addr": sess.host,
            "master_port": sess.port,
            "world_size": sess.world_size,
            "counter": sess.counter,
        }

    def _receiver_connection(self) -> dict[str, Any]:
        return self._receiver_handoff()

    @classmethod
    def check_receiver_connection(cls, connection: Any, model_id: str) -> dict[str, Any]:
        """``{"external": true}`` (the worker runs its own RPC agent), or the session to join: its token,
        the sender's store (host, port), the world size and the sender's ``init_rpc`` counter."""
        if connection == {"external": True} and type(connection["external"]) is bool:
            return dict(connection)
        fields = {
            "token": options.text(r"[0-9a-f]{16}", what="16 hex digits"),
            "master_addr": options.host,
            "master_port": options.port,
            "world_size": WORLD_SIZE,
            "counter": options.integer(0, 2**31 - 1),
        }
        return options.fields(connection, fields, "connection", required=tuple(fields))

    @classmethod
    def receiver_unpickles(cls, connection: Any) -> str | None:
        """The RPC world the connection names (``None`` for an agent of the worker's own): TensorPipe unpickles
        what its members send."""
        if connection.get("external"):
            return None
        return f"the RPC world at {connection['master_addr']}:{connection['master_port']}"

    def _rendezvous_complete(self) -> bool:
        return self._session is None or self._session.started

    def _connect_sender_impl(self, weights: Any) -> None:
        deadline = deadline_after(self.connect_timeout)
        if self._session is not None:
            start_agent(self._session, SENDER_NAME, 0, self.connect_timeout, model_id=self._model_id)
        self._send_initial(weights, remaining(deadline))

    def send_to(self, weights: Any, targets: list[int], *, wait: bool, timeout: float | None = None) -> None:
        """Publish one new version to ``targets``: one copy into a staging buffer, one RPC per worker."""
        assert self._layout is not None
        flat, whole = self._sender_weights(weights, self._layout)  # copied out under no_grad
        deadline = deadline_after(self.timeout if timeout is None else timeout)
        version = self._next_version
        self._errors.update(self._collect(sorted(self._transports), None, {}))
        failures = {w: self._failed[w] for w in targets if w in self._failed}
        live = [w for w in targets if w not in self._failed]
        if self._pool is None:
            self._pool = StagingPool(
                self._layout.nbytes, torch.device("cpu"), self.max_buffers, lambda fut: fut.done(), self._settle
            )
        staging = self._pool.acquire(deadline, model_id=self._model_id, version=version)
        if staging.views is None:  # typed views of a staging buffer are made once, not per send
            staging.views = self._layout.views(staging.tensor)
        if whole is not None:  # flatten_sender: the weights already lie in one buffer, in their places
            copy_tensors([staging.tensor], [whole])
        else:
            write_into(staging.views, flat)
        payload_digest = digest([staging.tensor]) if self.checksum else None
        for w in live:
            transport = self._transports[w]
            layout = self._layout.to_plain() if transport.acked is None else None  # until the worker has it
            try:
                future = transport.submit(version, staging.tensor, layout, self.timeout, payload_digest)
            except RuntimeError as exc:
                failures[w] = self._mark_dead(w, self._died(w, version, exc))
                continue
            future.add_done_callback(lambda _: self._answered.set())
            staging.readers[w] = future
        self._next_version += 1
        self._version = version
        if wait:
            expected = {w: version for w in live if w not in failures}
            failures.update(self._collect(live, deadline, expected))
        failures.update({w: self._errors.pop(w) for w in list(self._errors) if w in targets and w not in failures})
        raise_failures(failures, model_id=self._model_id, version=version)

    def _died(self, w: int, version: int | None, exc: BaseException) -> WorkerDiedError:
        name = self._transports[w].worker_name
        return WorkerDiedError(
            f"RPC peer {name} went away ({first_line(exc)})", model_id=self._model_id, worker_idx=w, version=version
        )

    def _settle(self, w: int, future: Any, seconds: float) -> bool:
        self._answered.wait(seconds)
        self._answered.clear()
        return future.done()

    def _collect(
        self, workers: list[int], deadline: float | None, expected: dict[int, int]
    ) -> dict[int, WeightSyncError]:
        """Take in answers: those already there (``deadline`` None), or until each worker acked ``expected``."""
        failures: dict[int, WeightSyncError] = {}
        while True:
            self._answered.clear()
            for w in workers:
                transport = self._transports[w]
                for version, future in sorted(transport.in_flight.items()):
                    if not future.done():
                        break
                    del transport.in_flight[version]
                    failure = self._answer(w, version, future)
                    if failure is not None:
                        failures[w] = failure
            pending = self._missing_acks(expected, failures)
            if deadline is None or not pending:
                break
            if remaining(deadline) <= 0:
                failures.update(self._ack_timeouts(pending, expected))
                break
            self._answered.wait(remaining(deadline))
        failures.update(self._gone_before_acking(expected, failures))
        return failures

    def _answer(self, w: int, version: int, future: Any) -> WeightSyncError | None:
        """Read one worker's answer: record its ack, or return what went wrong."""
        transport = self._transports[w]
        try:
            answer = future.wait()
        except RuntimeError as exc:
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                return SyncTimeoutError(
                    f"no ack for version {version} within the timeout (last acked: {transport.acked})",
                    model_id=self._model_id,
                    worker_idx=w,
                    version=version,
                )
            return self._mark_dead(w, self._died(w, version, exc))
        if answer.get("held") is not None:
            held = int(answer["held"])
            transport.acked = held if transport.acked is None else max(transport.acked, held)
        if answer.get("error"):
            error = answer["error"]
            return ReceiverError(
                error.get("type", "Error"),
                error.get("message", ""),
                model_id=self._model_id,
                worker_idx=w,
                version=version,
            )
        return None

    def _on_worker_lost(self, w: int) -> None:
        self._transports[w].in_flight.clear()
        if self._pool is not None:
            self._pool.forget(w)

    # --------------------------------------------------------------- receiver
    def _init_receiver_impl(self, **kwargs: Any) -> None:
        super()._init_receiver_impl(**kwargs)
        if self._model is None:
            raise ConfigurationError(
                "init_on_receiver needs model= (or a context holding the model)", model_id=self._model_id
            )
        if not self._handoff:
            raise ConfigurationError(
                "this receiver does not know its sender: hand it the scheme pickled after init_on_sender(), "
                "or its receiver_config(worker_idx)",
                model_id=self._model_id,
            )
        self._mailbox = mailbox(self._model_id)  # updates that arrive before connect() wait here
        # A model in shared memory may be read by processes of the worker's own: written into, never moved.
        self._switch = not (
            self.keep_storage or in_shared_memory(flatten_weights(self._model, self._strategy.extract_as))
        )

    def _connect_receiver_impl(self) -> None:
        assert self._handoff is not None and self._worker_idx is not None
        where = {"model_id": self._model_id, "worker_idx": self._worker_idx}
        deadline = deadline_after(self.connect_timeout)
        if not self._handoff.get("external"):
            self._check_exposure(self._handoff["master_addr"], **where)
            self._session = join_worker_session(self._handoff, self.connect_timeout, **where)
            try:
                start_agent(
                    self._session,
                    default_worker_name(self._worker_idx),
                    self._worker_idx + 1,
                    self.connect_timeout,
                    **where,
                )
            except BaseException:
                leave_session(self._session)
                self._session = None
                raise
        if self._take(remaining(deadline)) is None:
            raise SyncTimeoutError("no initial weights from the sender in time", **where)
        self._reported_version = self._version

    def _take(self, timeout: float) -> int | None:
        """Apply what waits in the mailbox (the newest only, with ``latest_wins``); the version now held, if new."""
        box = self._mailbox
        with box.cond:
            box.cond.wait_for(lambda: box.queue or box.closed, timeout)
            if not box.queue:
                if box.closed:
                    raise ConnectionClosedError(
                        "the sender shut down", model_id=self._model_id, worker_idx=self._worker_idx
                    )
                return None
            if self.latest_wins:
                taken = list(box.queue)
                box.queue.clear()
            else:
                taken = [box.queue.popleft()]
        update = taken[-1]
        where = {"model_id": self._model_id, "worker_idx": self._worker_idx, "version": update.version}
        try:
            for delivery in taken:
                if delivery.layout is not None:
                    self._layout = FlatLayout.from_plain(delivery.layout)
            if self._layout is None:
                raise ConfigurationError("received an update before the layout", **where)
            check_digest([update.buffer], update.digest, **where)
            dst = flatten_weights(self._model, self._strategy.extract_as)
            switch = self._switch and not self._layout.casts
            held = switch and self._bound.holds(dst)  # the model exactly as bound: keys, shapes, dtypes hold
            if not held:
                check_spec(self._layout.spec, weights_spec(dst), **where)
            # A message's buffer is this process's alone (TensorPipe allocates one per message), so a CPU
            # model can take its memory instead of a copy; the memory it held before is freed with the buffer.
            buffer, storage = update.buffer, update.buffer.untyped_storage()
            whole = buffer.storage_offset() == 0 and storage.nbytes() == buffer.numel() == self._bound.bytes.numel()
            with self.weights_lock:  # weights and version change together for readers holding the lock
                if held and whole:  # O(1): swap the memory behind the model's one storage with the buffer's
                    self._bound.swap(storage)
                elif switch:  # each tensor becomes a view of the buffer (about 1 us a tensor)
                    self._bound.bind(dst, storage, self._layout, self._layout.views(buffer))
                else:
                    write_into(dst, self._layout.views(buffer))
                self._version = update.version
        except Exception as exc:
            for delivery in taken:
                delivery.future.set_result(
                    {"held": self._version, "error": {"type": type(exc).__name__, "message": str(exc)[:4000]}}
                )
            raise
        for delivery in taken:
            delivery.future.set_result({"held": update.version})
        return update.version

    def _receive_impl(self, timeout: float) -> Any:
        if self._take(timeout) is None and self._session is not None:
            now = time.monotonic()
            if now - self._probed_at >= SENDER_PROBE_EVERY:  # no update came: is the sender still there?
                self._probed_at = now
                reason = sender_gone(self._session)
                if reason is not None:
                    raise ConnectionClosedError(
                        f"the sender went away ({reason})", model_id=self._model_id, worker_idx=self._worker_idx
                    )
        return self._newly_applied()

    # --------------------------------------------------------------- shutdown
    def _shutdown_impl(self) -> None:
        if self.is_receiver:
            drop_mailbox(self._model_id or "")
            self._bound.forget()
        for w, transport in self._transports.items():
            if w not in self._failed and self._state == SENDER_CONNECTED:
                transport.close(min(self.timeout, 5.0))
        self._transports.clear()
        self._pool = None
        if self._session is not None:
            leave_session(self._session)
            self._session = None
