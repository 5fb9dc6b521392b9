"""``DistributedTransport``: weight updates to ONE torch.distributed rank, over a process group of our own.

The scheme never touches the default process group a training job may have
set up: it opens (or joins, under a prefix of its own) a TCP store and builds a
standalone gloo or NCCL group on it, rank 0 the sender and rank ``i + 1``
worker ``i``. Updates are flat byte buffers (one point-to-point send per worker
per version, whatever the number of tensors); the store carries the
signalling (which version comes next, error details) and the group carries
the bytes and the acks, so a rank that dies fails the pending ack at once
instead of being waited on.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import threading
import time
from collections import deque
from concurrent.futures import CancelledError, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import (
    ConfigurationError,
    ConnectionClosedError,
    LifecycleError,
    SyncTimeoutError,
    TransportError,
    WorkerDiedError,
)
from .base import SenderBoundTransport
from .channel import deadline_after, remaining

if TYPE_CHECKING:
    from ..schemes.distributed import DistributedWeightSyncScheme

__all__ = [
    "DistributedTransport",
    "as_timedelta",
    "first_line",
    "connect_store",
    "interface_for",
    "is_loopback",
    "local_interfaces",
    "new_group",
    "is_timeout",
    "local_address",
    "open_store",
    "Waiter",
    "resolve_master",
    "store_json",
]

log = logging.getLogger("weightsync.transports.distributed")

TAG_DATA, TAG_ACK = 1, 2
ACK_OK, ACK_FAILED = 0, 1


#: The largest store value read as JSON: a layout of some 100,000 tensors. Anyone who reaches the store can
#: write its keys (it has no authentication), so what is read there is bounded and checked, never unpickled.
MAX_STORE_JSON = 16 * 1024 * 1024


def store_json(store: dist.Store, key: str) -> dict[str, Any]:
    """The JSON object stored under ``key``, read as data (bounded, an object, nothing else).

    Raises:
        TransportError: the value is too large, not JSON, or not a JSON object.
    """
    raw = store.get(key)
    if len(raw) > MAX_STORE_JSON:
        raise TransportError(f"store key {key!r} holds {len(raw)} bytes, over {MAX_STORE_JSON}; refusing it")
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise TransportError(f"store key {key!r} does not hold a JSON object; refusing it")
    return value


def as_timedelta(seconds: float) -> timedelta:
    return timedelta(seconds=max(float(seconds), 0.001))


def resolve_master(master_addr: str | None, master_port: int | None) -> tuple[str, int]:
    """Address and port of the sender's TCP store: the arguments, else ``MASTER_ADDR``/``MASTER_PORT``,
    else loopback and a free port (``0``)."""
    host = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port: Any = master_port if master_port is not None else os.environ.get("MASTER_PORT", 0)
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise ConfigurationError(f"master_port must be an int, got {port!r}") from None
    if not 0 <= port < 65536:
        raise ConfigurationError(f"master_port must be in 0..65535, got {port}")
    return host, port


def open_store(host: str, port: int, timeout: float) -> tuple[dist.Store, int, bool]:
    """Serve a TCP store bound to ``host:port`` (only that address); return (store, port, owned).

    If the port is taken (typically by the training job's own store at
    ``MASTER_PORT``), join that store as a client instead: the scheme then
    works under a key prefix of its own and leaves the job's keys alone.
    """
    try:
        sock = socket.create_server((host, port), backlog=1024)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE or port == 0:
            raise ConfigurationError(f"cannot serve a TCP store on {host}:{port}: {exc}") from exc
        log.info("%s:%d is taken; joining the store there under weightsync's own prefix", host, port)
        return connect_store(host, port, timeout), port, False
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=as_timedelta(timeout),
        master_listen_fd=sock.detach(),
    )
    return store, port, True


def connect_store(host: str, port: int, timeout: float, **where: Any) -> dist.Store:
    """A client of the TCP store at ``host:port``, waiting at most ``timeout`` for it to answer."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=as_timedelta(timeout))
    except dist.DistError as exc:
        raise SyncTimeoutError(f"no TCP store answered at {host}:{port} within {timeout:.0f}s", **where) from exc


def local_address(toward: str) -> str:
    """The address of this host's interface that routes to ``toward`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(toward), 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback: only local processes reach it."""
    import ipaddress

    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def local_interfaces() -> dict[str, str]:
    """This machine's network interfaces that have an IPv4 address: {address: interface name}."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name[:15].encode())
                found[socket.inet_ntoa(fcntl.ioctl(probe.fileno(), siocgifaddr, request)[20:24])] = name
            except OSError:  # no IPv4 address on this interface
                continue
    return found


def interface_for(address: str) -> str | None:
    """The name of this machine's network interface that holds IPv4 ``address`` (``None``: none does)."""
    return local_interfaces().get(address)


def new_group(backend: str, store: dist.Store, rank: int, size: int, timeout: float, master_addr: str) -> Any:
    """A standalone process group (not the default one, not registered with torch.distributed's world).

    gloo binds the interface that routes to ``master_addr`` (loopback for a
    local sender; ``GLOO_SOCKET_IFNAME`` overrides), so a single-host run
    never opens a socket outside 127.0.0.1.
    """
    if backend == "gloo":
        if not dist.is_gloo_available():
            raise ConfigurationError("backend='gloo' but this torch build has no gloo")
        ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        device = (
            dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0])
            if ifname
            else dist.ProcessGroupGloo.create_device(hostname=local_address(master_addr))
        )
        options = dist.ProcessGroupGloo._Options()
        options._devices = [device]
        options._timeout = as_timedelta(timeout)
        return dist.ProcessGroupGloo(store, rank, size, options)
    if backend == "nccl":
        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ConfigurationError("backend='nccl' needs CUDA and a torch build with NCCL; use backend='gloo' on CPU")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = as_timedelta(timeout)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ConfigurationError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def is_timeout(exc: BaseException) -> bool:
    """A gloo/NCCL wait that ran out of time, as opposed to a peer that went away."""
    return "timed out" in str(exc).lower() or "timeout" in type(exc).__name__.lower()


class Waiter:
    """Completes one peer's gloo/NCCL operations, in order, on a thread of its own.

    gloo offers no non-blocking completion test for point-to-point operations,
    and a wait with a timeout closes the connection to the peer: a slow worker
    would be cut off. The thread waits without a timeout (the group's own
    operation timeout still applies); callers wait on the returned futures
    with theirs. A dead peer fails the pending operations at once.
    """

    def __init__(self, name: str) -> None:
        self._queue: deque[tuple[Any, Future]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, work: Any) -> Future:
        future: Future = Future()
        with self._cond:
            self._queue.append((work, future))
            self._cond.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop)
                if self._stop:
                    for _, future in self._queue:
                        future.cancel()
                    return
                work, future = self._queue.popleft()
            try:
                work.wait()
                future.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)

    def close(self, timeout: float) -> bool:
        """Stop after the operation in progress; ``False`` if it is still blocked after ``timeout``."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()


@dataclass
class _Pending:
    """An update on its way to one worker: its sequence number, version and the ack being received."""

    seq: int
    version: int
    ack: torch.Tensor
    done: Future


class DistributedTransport(SenderBoundTransport):
    """The data plane to ONE rank of :class:`~weightsync.schemes.distributed.DistributedWeightSyncScheme`.

    On the sender, one per worker: ``send_weights`` / ``send_weights_async`` /
    ``wait_ack`` (through the scheme, which owns versions and staging
    buffers) and ``send_initial_weights``. On the receiver, the worker's own:
    ``receive_initial_weights``, ``receive_weights(timeout)`` and ``send_ack``.

    Args:
        worker_idx: the worker this transport reaches (its rank is ``worker_idx + 1``).
        sync: ``send_weights`` waits for the ack (``send_weights_async`` never does).
        scheme: the scheme that owns the group and the store.
    """

    def __init__(self, worker_idx: int = 0, sync: bool = True, scheme: DistributedWeightSyncScheme | None = None):
        self.worker_idx = worker_idx
        self.rank = worker_idx + 1  # the worker's rank in the group this transport uses
        self.sync = sync
        self._scheme = scheme
        self._own_group: tuple[Any, dist.Store] | None = None
        self.acked: int | None = None
        self.sent: int | None = None
        self.dead: BaseException | None = None
        self.seq = 0  # sequence number of the last message to this worker (the initial weights are 0)
        self.pending: deque[_Pending] = deque()
        self._waiter: Waiter | None = None

    def _group(self) -> tuple[Any, dist.Store]:
        if self._own_group is not None:
            return self._own_group
        scheme = self._scheme
        if scheme is None or scheme._pg is None or scheme._store is None:
            raise LifecycleError("this transport's scheme is not connected")
        return scheme._pg, scheme._store

    def use_pair(self, pg: Any, store: dist.Store) -> DistributedTransport:
        """Use a group and store of this transport's own instead of the scheme's: the two-rank group (sender
        rank 0, worker rank 1) formed when a restarted worker rejoins, and its store prefix. Returns ``self``."""
        self._own_group = (pg, store)
        self.rank = 1
        return self

    @property
    def store(self) -> dist.Store:
        """The store carrying this worker's signalling (announcements, checksums, error details)."""
        return self._group()[1]

    def _where(self, version: int | None = None) -> dict[str, Any]:
        return {
            "model_id": self._scheme.model_id if self._scheme else None,
            "worker_idx": self.worker_idx,
            "version": version,
        }

    # ----------------------------------------------------------------- sender
    def send_weights(self, weights: Any) -> None:
        """Publish ``weights`` to this worker only; wait for its ack when ``sync`` (bounded by the scheme's timeout)."""
        self._sender().send_to(weights, [self.worker_idx], wait=self.sync)

    def announce(self, version: int, *, initial: bool = False) -> None:
        """Start message ``version``: announce it in the store (the parts follow over the group).

        The initial weights are sent without an announcement: the worker is
        in ``connect()`` waiting for exactly them.
        """
        _, store = self._group()
        seq = 0 if initial else self.seq + 1
        if not initial:
            store.set(f"msg/{self.worker_idx}/{seq}", json.dumps({"version": version}))
        self.seq = seq
        if self._waiter is None:
            self._waiter = Waiter(f"weightsync-{self._scheme.model_id}-rank{self.rank}")

    def send_part(self, part: torch.Tensor) -> Future:
        """Send one bucket of the message announced last; its future completes once ``part`` is no longer read."""
        pg, _ = self._group()
        assert self._waiter is not None
        return self._waiter.watch(pg.send([part], self.rank, TAG_DATA))

    def expect_ack(self, version: int, device: torch.device) -> None:
        """Post the receive of the ack of the message announced last (every part of it sent)."""
        pg, _ = self._group()
        assert self._waiter is not None
        ack = torch.zeros(3, dtype=torch.int64, device=device)
        self.pending.append(_Pending(self.seq, version, ack, self._waiter.watch(pg.recv([ack], self.rank, TAG_ACK))))
        self.sent = version

    def send_initial_weights(self, weights: Any) -> None:
        """Send the initial weights during ``connect()``, without store signalling."""
        self._sender().send_to(weights, [self.worker_idx], wait=True, initial=True)

    def take_ack(self, deadline: float | None) -> tuple[_Pending, int, int] | None:
        """The oldest pending ack as (pending, held version, status), waiting until ``deadline``
        (``None``: only if already there). Raises WorkerDiedError or SyncTimeoutError.

        A slow worker stays connected: only the wait on the ack's future times out.
        """
        if not self.pending:
            return None
        head = self.pending[0]
        wait_futures([head.done], timeout=remaining(deadline) if deadline is not None else 0)
        if not head.done.done():
            if deadline is None:
                return None
            raise SyncTimeoutError(
                f"no ack for version {head.version} within the timeout (last acked: {self.acked})",
                **self._where(head.version),
            )
        try:
            head.done.result()
        except (RuntimeError, CancelledError) as exc:
            raise WorkerDiedError(
                f"its rank {self.rank} went away ({first_line(exc)})", **self._where(head.version)
            ) from None
        self.pending.popleft()
        seq, held, status = (int(x) for x in head.ack.tolist())
        if seq != head.seq:
            raise ConnectionClosedError(
                f"ack out of order: expected message {head.seq}, got {seq}", **self._where(head.version)
            )
        if status == ACK_OK:
            self.acked = held if self.acked is None else max(self.acked, held)
        return head, held, status

    def error_detail(self, seq: int) -> dict[str, str]:
        """What the worker wrote about its failure to apply message ``seq``."""
        _, store = self._group()
        try:
            if store.check([f"err/{self.worker_idx}/{seq}"]):
                detail = store_json(store, f"err/{self.worker_idx}/{seq}")
                return {"type": str(detail.get("type", "Error"))[:200], "message": str(detail.get("message", ""))}
        except (dist.DistError, TransportError):
            pass
        return {"type": "UnknownError", "message": "the worker reported a failure without details"}

    def close(self, timeout: float) -> None:
        """Tell the worker the sender is gone (its next ``receive`` raises ConnectionClosedError)."""
        with contextlib.suppress(LifecycleError, dist.DistError):
            _, store = self._group()
            store.set(f"msg/{self.worker_idx}/{self.seq + 1}", json.dumps({"closed": True}))
        self.stop_waiting(timeout)

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
        """The next announcement for this worker, waiting up to ``timeout``; ``None`` if none came."""
        _, store = self._group()
        key = f"msg/{self.worker_idx}/{self.seq + 1}"
        deadline, pause = deadline_after(timeout), 0.0005
        try:
            while not store.check([key]):
                if remaining(deadline) <= 0:
                    return None
                time.sleep(min(pause, remaining(deadline)))
                pause = min(pause * 2, 0.02)
            msg = store_json(store, key)
            store.delete_key(key)
        except dist.DistError as exc:
            raise ConnectionClosedError(f"the sender's store went away ({first_line(exc)})", **self._where()) from None
        self.seq += 1
        return msg

    def receive_into(self, parts: list[torch.Tensor], timeout: float, version: int | None) -> None:
        """Receive the parts of the message just announced (or the initial weights), in order, within ``timeout``."""
        pg, _ = self._group()
        deadline = deadline_after(timeout)
        try:
            works = [pg.recv([part], 0, TAG_DATA) for part in parts]  # posted at once: parts arrive in order
            for work in works:
                work.wait(as_timedelta(max(remaining(deadline), 0.001)))
        except RuntimeError as exc:
            if is_timeout(exc):
                raise SyncTimeoutError("the announced update did not arrive in time", **self._where(version)) from None
            raise ConnectionClosedError(f"the sender went away ({first_line(exc)})", **self._where(version)) from None

    def receive_initial_weights(self, parts: list[torch.Tensor], timeout: float) -> None:
        """Receive the initial weights during ``connect()`` (no store signalling)."""
        self.receive_into(parts, timeout, 0)

    def receive_weights(self, timeout: float | None = None, **kwargs: Any) -> Any:
        """Receive and apply pending updates (see the scheme's ``receive``); the weights applied or ``None``."""
        if self._scheme is None:
            raise LifecycleError("this transport has no receiver scheme")
        return self._scheme.receive(timeout)

    def send_ack(
        self, version: int, error: BaseException | None = None, held: int | None = None, *, seqs: tuple[int, ...] = ()
    ) -> None:
        """Ack messages ``seqs`` (the last one received when empty): ``held`` is the version now held."""
        pg, store = self._group()
        device = self._scheme._device if self._scheme is not None else torch.device("cpu")
        for seq in seqs or (self.seq,):
            status = ACK_OK if error is None else ACK_FAILED
            if error is not None:
                store.set(
                    f"err/{self.worker_idx}/{seq}",
                    json.dumps({"type": type(error).__name__, "message": str(error)[:4000]}),
                )
            ack = torch.tensor([seq, -1 if held is None else held, status], dtype=torch.int64, device=device)
            try:
                pg.send([ack], 0, TAG_ACK).wait(as_timedelta(self._scheme.timeout if self._scheme else 60.0))
            except RuntimeError as exc:
                raise ConnectionClosedError(
                    f"the sender went away ({first_line(exc)})", **self._where(version)
                ) from None

    def check_connection(self) -> bool:
        return self.dead is None and self._scheme is not None and self._scheme._pg is not None


def first_line(exc: BaseException) -> str:
    """The gist of an engine's error: its first line, without the source location and the boilerplate advice."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else type(exc).__name__
    return text.split(". This is typically")[0][:300]
