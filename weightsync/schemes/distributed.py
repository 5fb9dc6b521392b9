"""``DistributedWeightSyncScheme``: weights over a torch.distributed process group (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
from concurrent.futures import wait as wait_futures
from typing import Any

import torch
import torch.distributed as dist

from .. import options
from ..errors import (
    ConfigurationError,
    ConnectionClosedError,
    ReceiverError,
    SyncTimeoutError,
    WeightMismatchError,
    WeightSyncError,
    WorkerDiedError,
    raise_failures,
)
from ..integrity import check_digest, digest, digest_device_check
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
from ..transports.distributed import (
    ACK_OK,
    DistributedTransport,
    as_timedelta,
    connect_store,
    first_line,
    new_group,
    open_store,
    resolve_master,
    store_json,
)
from ..transports.processes import process_identity, process_is_gone
from ..transports.staging import StagingPool
from .acked import AckedScheme

log = logging.getLogger("weightsync.schemes")

#: The size of a torch.distributed world a receiver config may name: the trainer and its workers.
WORLD_SIZE = options.integer(2, 2**16)

__all__ = ["DistributedWeightSyncScheme"]


class DistributedWeightSyncScheme(AckedScheme):
    """Synchronize a model to workers over a torch.distributed process group of its own.

    The sender serves a TCP store (``master_addr:master_port``) and forms a
    group with its workers: rank 0 is the sender, rank ``i + 1`` worker ``i``.
    The group is standalone: the default process group, if the training job
    uses one, is not touched; if ``master_port`` is already the job's store,
    the scheme joins it under a key prefix of its own. A send copies the
    weights once into a flat buffer and sends it to each targeted worker
    (one message per worker, whatever the number of tensors); the worker
    acks over the group, so a dead rank fails the send at once.

    A worker applies updates in ``receive()`` (in its own thread: no update
    lands while it computes); ``latest_wins`` makes a worker that fell behind
    apply only the newest of the versions waiting for it.

    A worker that died (or was dropped) may be started again under its index:
    it forms a two-rank group with the sender and gets the newest version
    published, while the others go on in the first group. A worker whose
    process is still alive keeps its index (checked when both run on one
    machine; from another machine the newcomer replaces it).

    Args:
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA; weights travel
            GPU to GPU).
        master_addr: the sender's host as workers reach it (``None``:
            ``MASTER_ADDR``, else 127.0.0.1). The store binds this address only.
        master_port: the store's port (``None``: ``MASTER_PORT``, else a free port).
        latest_wins: a worker applies only the newest of its pending versions.
        max_buffers: staging buffers the sender may hold while workers still
            read earlier versions; a send waits (up to ``timeout``) for one
            to be free. Peak extra sender memory is ``max_buffers`` x the model.
        bucket_mb: the weights go in buckets of at most this many MB (split at
            tensor boundaries; a larger tensor is a bucket of its own), each
            copied into the staging buffer while the previous one is on the
            wire. ``None``: one message. A worker applies an update only once
            every bucket of it has arrived.
        keep_storage: workers copy each update into their model's own
            tensors, whose memory then never changes. By default a worker
            whose model is on the CPU (and whose weights travel in their own
            dtype) switches its tensors to the buffer the update arrived in,
            which saves a copy of the weights per update at the same memory:
            two receive buffers, one of them the model's. At the first
            update each tensor becomes a view of the buffer (the Parameter
            objects stay); later updates swap the memory behind that one
            storage with the buffer just received, O(1) whatever the number
            of tensors. A model in shared memory at connect
            (``share_memory()``) is always copied into.
        Other arguments: see :class:`~weightsync.schemes.base.WeightSyncScheme`.

    ``init_on_sender`` needs ``num_workers=``; workers get the scheme pickled
    or as ``receiver_config(i)`` and call ``init_on_receiver(model=...,
    worker_idx=i)`` then ``connect()``.
    """

    backend = "distributed"

    def __init__(
        self,
        strategy: str | WeightStrategy = "tensordict",
        sync: bool = True,
        timeout: float = 60.0,
        connect_timeout: float = 120.0,
        backend: str = "gloo",
        master_addr: str | None = None,
        master_port: int | None = None,
        latest_wins: bool = True,
        max_buffers: int = 2,
        wire_dtype: str | None = None,
        bucket_mb: float | None = None,
        keep_storage: bool = False,
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
            wire_dtype=wire_dtype,
            on_failure=on_failure,
            max_staleness=max_staleness,
            check_finite=check_finite,
            checksum=checksum,
            flatten_sender=flatten_sender,
        )
        if backend not in ("gloo", "nccl"):
            raise ConfigurationError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if isinstance(max_buffers, bool) or not isinstance(max_buffers, int) or max_buffers < 1:
            raise ConfigurationError(f"max_buffers must be a positive int, got {max_buffers!r}")
        resolve_master(master_addr, master_port)  # validates the port now, not at connect
        # An instance attribute: the class attribute ``backend`` stays the registry name ("distributed").
        self.backend = backend
        self.master_addr = master_addr
        self.master_port = master_port
        self.latest_wins = bool(latest_wins)
        self.max_buffers = max_buffers
        if bucket_mb is not None and (
            isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0
        ):
            raise ConfigurationError(f"bucket_mb must be a positive number of megabytes or None, got {bucket_mb!r}")
        self.bucket_mb = bucket_mb
        self.keep_storage = bool(keep_storage)

    def _config_fields(self) -> set[str]:
        return super()._config_fields() | {
            "backend",
            "master_addr",
            "master_port",
            "latest_wins",
            "max_buffers",
            "bucket_mb",
            "keep_storage",
        }

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        self._store: dist.Store | None = None
        self._base_store: dist.Store | None = None
        self._pg: Any = None
        self._layout: FlatLayout | None = None
        self._address: tuple[str, int] | None = None
        self._prefix: str | None = None
        self._pool: StagingPool | None = None
        self._buckets: list[tuple[int, int, int, int]] = []  # (first slot, last slot, start byte, end byte)
        self._newest: tuple[Any, int, str | None] | None = None  # (staging, version, checksum) of the last send
        self._hellos: dict[int, dict[str, Any]] = {}  # what each worker said when it (re)joined
        self._gens: dict[int, int] = {}  # worker -> the generation (connection count) admitted last
        self._rejoins_seen = 0
        self._admit_store: dist.Store | None = None  # the rejoin thread's own client of the store
        # Receiver side.
        self._transport: DistributedTransport | None = None
        # The buffer the next message lands in is _recv_buffers[_recv_at]. A worker whose model switches to
        # the buffer of the version it applied receives the next one into the other buffer.
        self._recv_buffers: list[torch.Tensor] = []
        self._recv_views: list[dict[str, torch.Tensor]] = []
        self._recv_at = 0
        self._switch = False  # whether this receiver's model switches to the received buffer
        self._closed = False

    def _check_backend(self) -> None:
        if self.backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ConfigurationError(
                "backend='nccl' needs CUDA and a torch build with NCCL; use backend='gloo' on CPU",
                model_id=self._model_id,
            )
        digest_device_check(self.checksum, self._device, model_id=self._model_id)

    @property
    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    @property
    def layout(self) -> FlatLayout | None:
        return self._layout

    @property
    def receiver_transport(self) -> DistributedTransport | None:
        return self._transport

    def create_transport(self, **kwargs: Any) -> DistributedTransport:
        """A transport to worker ``worker_idx`` bound to this scheme."""
        return DistributedTransport(scheme=self, **kwargs)

    # ----------------------------------------------------------------- sender
    def _init_sender_impl(self, **kwargs: Any) -> None:
        super()._init_sender_impl(**kwargs)
        self._check_backend()
        if self._num_workers is None:
            raise ConfigurationError("DistributedWeightSyncScheme.init_on_sender needs num_workers=")
        self._layout = self._sender_layout()
        self._adopt_sender_model(self._layout)
        self._buckets = self._layout.buckets(self._bucket_bytes)
        host, port = resolve_master(self.master_addr, self.master_port)
        self._base_store, port, _ = open_store(host, port, self.connect_timeout)
        self._address = (host, port)
        # A prefix of our own: several models (or the job's own store) share nothing.
        self._prefix = f"weightsync/{self._model_id}/{secrets.token_hex(8)}"
        self._store = dist.PrefixStore(self._prefix, self._base_store)
        self._store.set("layout", json.dumps(self._layout.to_plain()))
        if self.backend == "nccl":
            self._store.set("gpu", _gpu_identity())
        self._transports = {w: self.create_transport(worker_idx=w, sync=self.sync) for w in range(self._num_workers)}

    def _group_timeout(self, deadline: float) -> float:
        """The group's own operation timeout: the rest of the rendez-vous, and never less than 4 x ``timeout``
        (past it, gloo disconnects a peer that stalled in the middle of an update)."""
        return max(remaining(deadline), 4 * self.timeout)

    def _receiver_handoff(self) -> dict[str, Any]:
        assert self._address is not None
        return {
            "master_addr": self._address[0],
            "master_port": self._address[1],
            "prefix": self._prefix,
            "world_size": (self._num_workers or 0) + 1,
        }

    def _receiver_connection(self) -> dict[str, Any]:
        return self._receiver_handoff()

    @classmethod
    def check_receiver_connection(cls, connection: Any, model_id: str) -> dict[str, Any]:
        """The sender's store (host, port), the scheme's key prefix in it (for ``model_id``), the world size."""
        fields = {"master_addr": options.host, "master_port": options.port, "prefix": None, "world_size": WORLD_SIZE}
        checked = options.fields(connection, fields, "connection", required=tuple(fields))
        prefix = checked["prefix"]
        if type(prefix) is not str or not re.fullmatch(re.escape(f"weightsync/{model_id}/") + "[0-9a-f]{16}", prefix):
            raise ConfigurationError(
                f"connection.prefix must be weightsync/<model_id>/<16 hex digits> for model_id {model_id!r}, "
                f"got {prefix!r:.120}"
            )
        return checked

    def _rendezvous_complete(self) -> bool:
        return self._pg is not None

    def _connect_sender_impl(self, weights: Any) -> None:
        assert self._store is not None and self._num_workers is not None
        deadline = deadline_after(self.connect_timeout)
        hellos = [f"hello/{w}" for w in range(self._num_workers)]
        try:
            while not self._store.check(hellos):
                if remaining(deadline) <= 0:
                    missing = [w for w, key in enumerate(hellos) if not self._store.check([key])]
                    raise SyncTimeoutError(
                        f"workers {missing} did not join within {self.connect_timeout:.0f}s "
                        f"(store at {self._address[0]}:{self._address[1]})",
                        model_id=self._model_id,
                        worker_idx=missing[0] if len(missing) == 1 else None,
                    )
                threading.Event().wait(min(0.01, remaining(deadline)))
            refused: dict[int, WeightSyncError] = {}
            # NCCL refuses two ranks on one GPU, and only at the first transfer: name it now, by worker.
            holders = {_gpu_identity(): "the sender"} if self.backend == "nccl" else {}
            verdict = {}
            for w, key in enumerate(hellos):
                hello = self._hellos[w] = store_json(self._store, key)
                if not hello.get("ok"):
                    refused[w] = ReceiverError(
                        hello.get("type", "Error"), hello.get("message", ""), model_id=self._model_id, worker_idx=w
                    )
                elif hello.get("gpu") in holders:
                    verdict[str(w)] = (
                        f"worker {w} is on the same GPU as {holders[hello['gpu']]} ({hello['gpu']}), and NCCL needs "
                        "one GPU per rank: give each worker a GPU of its own (CUDA_VISIBLE_DEVICES or "
                        "torch.cuda.set_device) or use backend='gloo'"
                    )
                    refused[w] = ConfigurationError(verdict[str(w)], model_id=self._model_id, worker_idx=w)
                elif hello.get("gpu"):
                    holders[hello["gpu"]] = f"worker {w}"
            self._store.set("verdict", json.dumps(verdict))
            self._pg = new_group(
                self.backend, self._store, 0, self._num_workers + 1, self._group_timeout(deadline), self._address[0]
            )
            self._admit_store = dist.PrefixStore(
                self._prefix, connect_store(*self._address, remaining(deadline), model_id=self._model_id)
            )
        except dist.DistError as exc:
            raise SyncTimeoutError(
                f"the process group did not form within {self.connect_timeout:.0f}s: {first_line(exc)}",
                model_id=self._model_id,
            ) from None
        self._start_admitter(self._poll_rejoin, self._admit)
        for w, exc in refused.items():
            self._mark_dead(w, exc)
        ok = [w for w in range(self._num_workers) if w not in refused]
        try:
            if ok:
                self.send_to(weights, ok, wait=True, timeout=remaining(deadline), initial=True)
        except WeightSyncError as exc:
            refused.update(getattr(exc, "failures", None) or {exc.worker_idx: exc})
        raise_failures(refused, model_id=self._model_id, version=0)

    def send_to(
        self, weights: Any, targets: list[int], *, wait: bool, timeout: float | None = None, initial: bool = False
    ) -> None:
        """Publish one new version to ``targets``: one copy into a staging buffer, one send per worker."""
        assert self._layout is not None
        flat, whole = self._sender_weights(weights, self._layout)  # copied out under no_grad
        deadline = deadline_after(self.timeout if timeout is None else timeout)
        version = self._next_version
        self._errors.update(self._collect(sorted(self._transports), None, {}))  # earlier async sends' outcomes
        failures = {w: self._failed[w] for w in targets if w in self._failed}
        live = [w for w in targets if w not in self._failed]
        if self._pool is None:
            self._pool = StagingPool(
                self._layout.nbytes,
                self._device,
                self.max_buffers,
                lambda works: all(work.done() for work in works),
                self._settle,
            )
        staging = self._pool.acquire(deadline, model_id=self._model_id, version=version)
        self._newest = None  # until the whole version is in the buffer
        if initial:
            self._store.set("initial", str(version))
        sending = []
        for w in live:
            try:
                self._transports[w].announce(version, initial=initial)
            except RuntimeError as exc:  # the store or the peer is gone
                failures[w] = self._mark_dead(w, self._died(w, version, exc))
                continue
            sending.append(w)
            staging.readers[w] = []
        # Bucket by bucket: while gloo sends one, the next is copied into the staging buffer.
        if staging.views is None:
            staging.views = self._layout.views(staging.tensor)
        for first, last, start, end in self._buckets:
            if whole is not None:  # flatten_sender: the bucket's bytes already lie in one buffer, in place
                copy_tensors([staging.tensor[start:end]], [whole[start:end]])
            else:
                write_into({s.key: staging.views[s.key] for s in self._layout.slots[first:last]}, flat)
            for w in list(sending):
                try:
                    staging.readers[w].append(self._transports[w].send_part(staging.tensor[start:end]))
                except RuntimeError as exc:  # the peer is gone: gloo refuses to send to it
                    failures[w] = self._mark_dead(w, self._died(w, version, exc))
                    sending.remove(w)
        payload_digest = digest([staging.tensor]) if self.checksum else None  # once every bucket is written
        for w in sending if payload_digest else ():  # the workers check it before applying
            self._transports[w].store.set(f"digest/{w}/{self._transports[w].seq}", payload_digest)
        self._newest = (staging, version, payload_digest)  # what a worker that rejoins is sent
        for w in sending:
            self._transports[w].expect_ack(version, self._device)
        self._next_version += 1
        self._version = version
        if wait:
            failures.update(self._collect(live, deadline, {w: version for w in live if w not in failures}))
        failures.update({w: self._errors.pop(w) for w in list(self._errors) if w in targets and w not in failures})
        raise_failures(failures, model_id=self._model_id, version=version)

    def _died(self, w: int, version: int | None, exc: BaseException) -> WorkerDiedError:
        return WorkerDiedError(
            f"its rank {w + 1} went away ({first_line(exc)})", model_id=self._model_id, worker_idx=w, version=version
        )

    def _settle(self, w: int, works: list, seconds: float) -> bool:
        """Wait a little on the sends to worker ``w``; ``True`` once none reads its buffer any more."""
        wait_futures(works, timeout=seconds)
        if not all(work.done() for work in works):
            return False
        for work in works:
            if work.cancelled() or work.exception() is not None:
                self._mark_dead(w, self._died(w, self._version, work.exception() or RuntimeError("cancelled")))
                break
        return True

    @property
    def _bucket_bytes(self) -> int | None:
        return None if self.bucket_mb is None else max(1, int(self.bucket_mb * 1e6))

    @property
    def _recv_buffer(self) -> torch.Tensor:
        return self._recv_buffers[self._recv_at]

    def _recv_parts(self) -> list[torch.Tensor]:
        buffer = self._recv_buffer
        return [buffer[start:end] for _, _, start, end in self._buckets]

    def _collect(
        self, workers: list[int], deadline: float | None, expected: dict[int, int]
    ) -> dict[int, WeightSyncError]:
        """Take in acks: those already there (``deadline`` None), or until each worker acked ``expected``."""
        failures: dict[int, WeightSyncError] = {}
        for w in workers:
            transport = self._transports[w]
            if w in self._failed:
                if w in expected and not self._has_acked(w, expected[w]):
                    failures[w] = self._failed[w]
                continue
            while transport.pending:
                if deadline is not None and w in expected and (transport.acked or -1) >= expected[w]:
                    break
                try:
                    got = transport.take_ack(deadline if w in expected or deadline is None else None)
                except SyncTimeoutError as exc:
                    failures[w] = exc
                    break
                except WorkerDiedError as exc:
                    failures[w] = self._mark_dead(w, exc)
                    break
                if got is None:
                    break
                pending, _, status = got
                if status != ACK_OK:
                    detail = transport.error_detail(pending.seq)
                    failures[w] = ReceiverError(
                        detail.get("type", "Error"),
                        detail.get("message", ""),
                        model_id=self._model_id,
                        worker_idx=w,
                        version=pending.version,
                    )
        return failures

    def _on_worker_lost(self, w: int) -> None:
        self._transports[w].stop_waiting(0.0)
        if self._pool is not None:
            self._pool.forget(w)

    # ----------------------------------------------------------------- rejoin
    def _poll_rejoin(self) -> tuple[int, int, dict[str, Any], Any, dist.Store] | None:
        """The rejoin thread's wait: a worker connecting again, answered and with its two-rank group formed.

        Runs without the scheme's lock (sends go on meanwhile): a restarted worker announces itself by
        bumping ``gen/<w>`` and ``rejoins``; it is refused if its earlier process is still alive.
        """
        store = self._admit_store
        if store is None or self._num_workers is None:
            raise EOFError
        try:
            asked = int(store.add("rejoins", 0))
            found = None
            if asked > self._rejoins_seen:
                for w in range(self._num_workers):
                    gen = int(store.add(f"gen/{w}", 0))
                    if gen > self._gens.get(w, 1) and store.check([f"rejoin/{w}/{gen}"]):
                        found = w, gen, store_json(store, f"rejoin/{w}/{gen}")
                        self._gens[w] = gen
                        break
                self._rejoins_seen = self._rejoins_seen + 1 if found else asked
            if found is None:
                self._admitter_stop.wait(0.05)
                return None
            w, gen, hello = found
            problem = self._rejoin_problem(w, hello)
            store.set(f"verdict/{w}/{gen}", json.dumps({"ok": True} if problem is None else {"refused": problem}))
            if problem is not None:
                log.warning("model %r: refused worker %d connecting again: %s", self._model_id, w, problem)
                return None
            pair = dist.PrefixStore(f"pair/{w}/{gen}", store)
            pg = new_group(self.backend, pair, 0, 2, max(self.connect_timeout, 4 * self.timeout), self._address[0])
        except dist.DistError as exc:
            if self._admitter_stop.is_set():
                raise EOFError from None
            log.warning("model %r: a worker connecting again could not join: %s", self._model_id, first_line(exc))
            return None
        return w, gen, hello, pg, pair

    def _rejoin_problem(self, w: int, hello: dict[str, Any]) -> str | None:
        """Why worker ``w`` may not come back with ``hello`` (``None``: it may)."""
        if not hello.get("ok"):
            return f"{hello.get('type', 'Error')}: {hello.get('message', '')}"
        earlier = self._hellos.get(w, {}).get("process")
        gone = True if w in self._failed else process_is_gone(earlier)
        if gone is False:
            return f"worker {w} is already connected (its process {earlier['pid']} is alive)"
        if gone is None:
            log.warning(
                "model %r: worker %d connected again from another machine; it replaces the earlier process",
                self._model_id,
                w,
            )
        gpu = hello.get("gpu")
        if gpu is not None:
            live = {v.get("gpu") for u, v in self._hellos.items() if u != w and u not in self._failed}
            if gpu == _gpu_identity() or gpu in live:
                return f"its GPU {gpu} is already used by another rank, and NCCL needs one GPU per rank"
        return None

    def _admit(self, candidate: tuple[int, int, dict[str, Any], Any, dist.Store]) -> None:
        """Under the scheme's lock: make the rejoined worker's transport current and send it the newest
        version published (the bytes the others got, even if the trainer's model has moved on)."""
        w, gen, hello, pg, pair = candidate
        old = self._transports.get(w)
        if old is not None and w not in self._failed:
            old.close(0.0)  # its process is gone: nothing to wait for
        transport = self._transports[w] = self.create_transport(worker_idx=w, sync=self.sync).use_pair(pg, pair)
        self._failed.pop(w, None)  # from here on, a failure is this new process's
        self._hellos[w] = hello
        if self._pool is not None:
            self._pool.forget(w)
        if self._newest is None:
            self._mark_dead(w, WorkerDiedError("failed to rejoin: no whole version to send", model_id=self._model_id))
            return
        staging, version, payload_digest = self._newest
        try:
            pair.set("initial", str(version))
            transport.announce(version, initial=True)
            staging.readers[w] = [transport.send_part(staging.tensor[start:end]) for *_, start, end in self._buckets]
            if payload_digest is not None:
                pair.set(f"digest/{w}/0", payload_digest)
            transport.expect_ack(version, self._device)
        except (RuntimeError, dist.DistError) as exc:
            self._mark_dead(w, self._died(w, version, exc))
            return
        self._rejoined(w, version)

    # --------------------------------------------------------------- receiver
    def _init_receiver_impl(self, **kwargs: Any) -> None:
        handoff = dict(self._handoff or {})
        for key in ("master_addr", "master_port", "prefix", "world_size"):
            if kwargs.get(key) is not None:
                handoff[key] = kwargs.pop(key)
            kwargs.pop(key, None)
        super()._init_receiver_impl(**kwargs)
        self._check_backend()
        if self._model is None:
            raise ConfigurationError(
                "init_on_receiver needs model= (or a context holding the model)", model_id=self._model_id
            )
        if not handoff.get("prefix"):
            raise ConfigurationError(
                "this receiver does not know its sender: hand it the scheme pickled after init_on_sender(), "
                "or its receiver_config(worker_idx)",
                model_id=self._model_id,
            )
        self._handoff = handoff

    def _connect_receiver_impl(self) -> None:
        assert self._handoff is not None and self._worker_idx is not None
        where = {"model_id": self._model_id, "worker_idx": self._worker_idx}
        deadline = deadline_after(self.connect_timeout)
        host, port = self._handoff["master_addr"], int(self._handoff["master_port"])
        base = connect_store(host, port, self.connect_timeout, **where)
        store = dist.PrefixStore(self._handoff["prefix"], base)
        try:
            store.wait(["layout"], as_timedelta(remaining(deadline)))
            self._layout = FlatLayout.from_plain(store_json(store, "layout"))
            refusal = None
            try:
                check_spec(
                    self._layout.spec, weights_spec(flatten_weights(self._model, self._strategy.extract_as)), **where
                )
            except WeightMismatchError as exc:
                refusal = exc
            hello = (
                {"ok": True}
                if refusal is None
                else {"ok": False, "type": type(refusal).__name__, "message": str(refusal)[:4000]}
            )
            hello["process"] = process_identity()
            if self.backend == "nccl":
                hello["gpu"] = _gpu_identity()
            world = int(self._handoff["world_size"])
            self._num_workers = world - 1
            w = self._worker_idx
            gen = int(store.add(f"gen/{w}", 1))  # how many processes have connected as worker w, this one included
            group = None  # the first group; a restarted worker gets a pair group of its own
            if gen == 1:
                store.set(f"hello/{w}", json.dumps(hello))
                store.wait(["verdict"], as_timedelta(remaining(deadline)))
                reason = store_json(store, "verdict").get(str(w))
                # Every worker joins the group, even one that refused: the group forms only with all of them.
                self._pg = new_group(self.backend, store, w + 1, world, self._group_timeout(deadline), host)
            else:  # a restart: a two-rank group of its own with the sender, if the sender lets it in
                store.set(f"rejoin/{w}/{gen}", json.dumps(hello))
                store.add("rejoins", 1)
                store.wait([f"verdict/{w}/{gen}"], as_timedelta(remaining(deadline)))
                reason = store_json(store, f"verdict/{w}/{gen}").get("refused")
                if reason is None:
                    pair = dist.PrefixStore(f"pair/{w}/{gen}", store)
                    self._pg = new_group(self.backend, pair, 1, 2, self._group_timeout(deadline), host)
                    group = (self._pg, pair)
                elif refusal is None:
                    reason = f"the sender refused this worker: {reason}"
            if reason is not None and refusal is None:
                refusal = ConfigurationError(reason, **where)
        except dist.DistError as exc:
            raise SyncTimeoutError(f"could not join the sender's group: {first_line(exc)}", **where) from None
        self._base_store, self._store = base, store
        if refusal is not None:
            self._pg = None
            raise refusal
        self._transport = self.create_transport(worker_idx=self._worker_idx, sync=self.sync)
        if group is not None:
            self._transport.use_pair(*group)
        self._recv_buffers = [torch.empty(self._layout.nbytes, dtype=torch.uint8, device=self._device)]
        self._recv_views = [self._layout.views(self._recv_buffers[0])]
        self._switch = (
            not (self.keep_storage or self._layout.casts)
            and self._device.type == "cpu"
            and not in_shared_memory(flatten_weights(self._model, self._strategy.extract_as))
        )
        self._buckets = self._layout.buckets(self._bucket_bytes)
        self._transport.receive_initial_weights(self._recv_parts(), remaining(deadline))
        version = int(self._transport.store.get("initial"))
        self._apply([0], version, self._expected_digest(0, remaining(deadline)))
        self._reported_version = self._version

    def _expected_digest(self, seq: int, timeout: float) -> str | None:
        """The sender's checksum of message ``seq`` (``None`` without ``checksum``); it is set once every
        bucket was written, so it may follow the data by a moment."""
        if not self.checksum:
            return None
        assert self._transport is not None
        key, store = f"digest/{self._worker_idx}/{seq}", self._transport.store
        try:
            store.wait([key], as_timedelta(max(timeout, 0.001)))
            value = store.get(key).decode()
            store.delete_key(key)
        except dist.DistError as exc:
            raise ConnectionClosedError(
                f"no checksum from the sender ({first_line(exc)})", model_id=self._model_id, worker_idx=self._worker_idx
            ) from None
        return value

    def _apply(self, seqs: list[int], version: int, expected: str | None = None) -> None:
        """Write the received buffer into the model as ``version`` (``expected``: its checksum); ack every
        message in ``seqs``."""
        assert self._transport is not None and self._layout is not None and self._recv_buffers
        where = {"model_id": self._model_id, "worker_idx": self._worker_idx, "version": version}
        try:
            check_digest([self._recv_buffer], expected, **where)
            dst = flatten_weights(self._model, self._strategy.extract_as)
            held = self._switch and self._bound.holds(dst)  # the model exactly as bound: keys, shapes, dtypes hold
            if not held:
                check_spec(self._layout.spec, weights_spec(dst), **where)
            if self._switch and not held and len(self._recv_buffers) == 1:  # before: a failure changes nothing
                self._recv_buffers.append(torch.empty_like(self._recv_buffers[0]))
                self._recv_views.append(self._layout.views(self._recv_buffers[1]))
            with self.weights_lock:  # weights and version change together for readers holding the lock
                if held:
                    # O(1): the model's storage takes the received memory, the receive buffer the memory the
                    # model had (the next message lands there). Re-pointing 2000 tensors took 2.4 ms.
                    self._bound.swap(self._recv_buffer.untyped_storage())
                elif self._switch:  # bound to this buffer; the next message lands in the other one
                    self._bound.bind(
                        dst, self._recv_buffer.untyped_storage(), self._layout, self._recv_views[self._recv_at]
                    )
                    self._recv_at = 1 - self._recv_at
                else:
                    write_into(dst, self._recv_views[self._recv_at])
                self._version = version
        except Exception as exc:
            self._transport.send_ack(version, error=exc, held=self._version, seqs=tuple(seqs))
            raise
        self._transport.send_ack(version, held=version, seqs=tuple(seqs))

    def _receive_impl(self, timeout: float) -> Any:
        assert self._transport is not None and self._recv_buffers
        if self._closed:
            raise ConnectionClosedError("the sender shut down", model_id=self._model_id, worker_idx=self._worker_idx)
        deadline = deadline_after(timeout)
        seqs, version = [], None
        while True:
            msg = self._transport.next_message(0.0 if seqs else remaining(deadline))
            if msg is None:
                break
            if msg.get("closed"):
                self._closed = True
                break
            version = int(msg["version"])
            self._transport.receive_into(self._recv_parts(), self.timeout, version)
            seqs.append(self._transport.seq)
            expected = self._expected_digest(self._transport.seq, self.timeout)
            if not self.latest_wins:
                break
        if seqs:
            self._apply(seqs, version, expected)
        elif self._closed:
            raise ConnectionClosedError("the sender shut down", model_id=self._model_id, worker_idx=self._worker_idx)
        return self._newly_applied()

    # --------------------------------------------------------------- shutdown
    def _shutdown_impl(self) -> None:
        self._stop_admitter()
        self._admit_store = None
        for w, transport in self._transports.items():
            if w not in self._failed:
                transport.close(min(self.timeout, 5.0))
        self._transports.clear()
        self._pool = None
        self._newest = None
        self._transport = None
        self._recv_buffers = []  # a model switched to one keeps it: it is the model's memory now
        self._recv_views = []
        self._bound.forget()
        self._pg = None
        self._store = None
        self._base_store = None


def _gpu_identity() -> str:
    """This process's current GPU, by UUID: two processes on one GPU compare equal whatever their device indices."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
