"""The trainer's side of the torch.distributed engine: a TCP store, a group of our own, staging buffers.

``init_on_sender`` serves the store (or joins the job's own under a prefix of its own) and leaves the layout there;
the rendez-vous collects each worker's hello (a worker whose model does not fit says so, by name) and forms the group,
rank 0 the sender. A version is staged in a flat buffer no send still reads; submitting it announces it in the store
and sends it to each worker bucket by bucket, each bucket copied while the previous one is on the wire. A restarted
worker forms a two-rank group of its own with the sender and is sent the newest version published.

Everything written to the store for workers is sealed with the run key, and each version's bytes get a keyed digest
(hashed bucket by bucket, while the buckets go out), published sealed once every bucket was sent. What the sender
reads from the store (hellos, requests to rejoin) is bounded and type-checked before its proof is; garbage there
refuses that worker, and never stops the rejoin thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any

import torch
import torch.distributed as dist

from ...core.engine import Outgoing, SenderEngine, Sink
from ...core.interrupts import held_interrupts
from ...core.timing import deadline_after, remaining, shown_seconds, wait_until
from ...errors import (
    AuthenticationError,
    ConfigurationError,
    ReceiverError,
    SyncTimeoutError,
    WeightSyncError,
    first_line,
)
from ...tensors.copies import copy_tensors, write_into
from ...tensors.layout import FlatLayout
from .. import descriptors
from ..keyfiles import KEY_BYTES, key_name, remove_key_file, write_key_file
from ..network import local_address
from ..staging import Staging, StagingPool
from ..store import SILENT_TIMEOUTS, open_store, store_set
from .auth import NO_BYTES, Sealer, fastest_mac, layout_tag, new_nonce, run_prefix
from .group import GROUP_TIMEOUT_FACTOR, Link, gpu_identity, new_group_within
from .line import LINE_WAIT_S, Line, Listener
from .messages import announcement
from .rejoins import Admitting, RejoinRequests, read_hello
from .settings import DistributedSettings
from .transport import ACK_OK, DistributedTransport

__all__ = ["DistributedSender", "on_a_line"]

log = logging.getLogger("weightsync.transports.distributed")

#: Seconds the sender's goodbye to each worker may take at shutdown.
CLOSE_WAIT_S = 5.0
#: Seconds between two looks at the store while workers join, or ask to rejoin.
STORE_POLL_S = 0.01
#: A version of at most this many bytes is hashed before it is announced, its digest in the announcement (a few
#: hundred microseconds of hashing at most, against a store round trip per worker); a larger one is hashed while
#: gloo sends it, its digest set in the store once the last bucket is out.
INLINE_DIGEST_BYTES = 4 << 20
#: The slice a sender waits in on its workers' lines when some acks come over the group instead (seconds).
MIXED_WAIT_S = 0.001


def on_a_line(device: torch.device) -> bool:
    """Whether bytes staged on ``device`` may travel on a worker's line: from host memory only (a GPU's go over
    NCCL, never through a socket)."""
    return device.type == "cpu"


class DistributedSender(Admitting, SenderEngine):
    """The sender's store, group, staging buffers and one :class:`DistributedTransport` per worker.

    Every version's bytes carry a keyed digest that workers check whatever the scheme's ``checksum`` (it checks
    more than a checksum: who sent them, as well as that they arrived whole). The store is served, and so is
    bound by the core's ``connect_timeout``, from construction on.

    Args:
        settings: the transport's (``backend``, ``bucket_mb``, ``max_buffers``).
        master: the store's host and port (port 0: a free one).
    """

    rejoins = True
    takes_deltas = True

    def __init__(
        self,
        sink: Sink,
        layout: FlatLayout,
        num_workers: int,
        settings: DistributedSettings,
        *,
        master: tuple[str, int],
        gpu: torch.device | None = None,
    ) -> None:
        super().__init__(sink, layout, num_workers, gpu=gpu)
        self.settings = settings
        self.device = settings.device
        self.buckets = layout.buckets(settings.bucket_bytes)
        host, port = master
        self._base_store: dist.Store | None
        self._base_store, self.address, _ = open_store(host, port, sink.connect_timeout)  # (an IP: workers dial it)
        # The run key, which workers get out of band, and the prefix drawn from it: several models (or the job's
        # own store) share nothing, and only a holder of the key knows where the run's keys are.
        self.authkey = secrets.token_bytes(KEY_BYTES)
        self._key_file: str | None = None
        self.prefix = run_prefix(sink.model_id or "", self.authkey)
        self.store: dist.Store | None = dist.PrefixStore(self.prefix, self._base_store)
        self.sealer = Sealer(self.authkey, self.prefix)
        self.mac = fastest_mac(layout.nbytes)  # what authenticates each message's bytes (named in its announcement)
        described = json.dumps(layout.to_plain()).encode()
        self.layout_tag = layout_tag(described)  # what each version's digest binds: the layout, in order
        store_set(self.store, "layout", self.sealer.seal("layout", described))
        # Each worker's line (.line): the port is open until the rendez-vous took the lines, its address sealed.
        self.listener: Listener | None = Listener(local_address(self.address[0]))
        line_at = {"host": self.listener.address[0], "port": self.listener.address[1]}
        store_set(self.store, "line", self.sealer.seal("line", json.dumps(line_at)))
        self._nonce = ""  # the one-time key's nonce of the version being staged
        self.link = Link(sealer=self.sealer)
        self.transports = {
            w: DistributedTransport(w, link=self.link, device=self.device, model_id=sink.model_id, sink=sink)
            for w in range(num_workers)
        }
        self.pool: StagingPool | None = None
        #: (staging, version, keyed digest, its nonce) of the last send
        self.newest: tuple[Staging, int, str, str] | None = None
        self.hellos: dict[int, dict[str, Any]] = {}  # what each worker said when it (re)joined
        self.requests = RejoinRequests(self.prefix, self.address, num_workers, sink.model_id)
        #: The newest version's bytes (the sender core's) and version, where only changes were sent of it.
        self._unstaged: tuple[torch.Tensor | None, int] | None = None

    def handoff(self) -> dict[str, Any]:
        return {**self._where_to(), "authkey": self.authkey.hex()}

    def connection(self) -> dict[str, Any]:
        """Where to connect, the path of the run key's file (written now): never the key itself, and the run's
        prefix in the store (not a secret), which the worker checks its model_id and key against."""
        if self._key_file is None:
            self._key_file = write_key_file(key_name(), self.authkey)
        return {**self._where_to(), "authkey_file": self._key_file, "run": self.prefix}

    def _where_to(self) -> dict[str, Any]:
        return {"master_addr": self.address[0], "master_port": self.address[1], "world_size": self.num_workers + 1}

    def _group_timeout(self, deadline: float) -> float:
        return max(remaining(deadline), GROUP_TIMEOUT_FACTOR * self.sink.timeout)

    # ------------------------------------------------------------ rendez-vous
    def rendezvous(self, deadline: float, timeout: float) -> dict[int, WeightSyncError]:
        assert self.store is not None
        hellos = [f"hello/{w}" for w in range(self.num_workers)]
        model_id = self.sink.model_id
        store = self.store
        assert store is not None  # open until close()
        try:

            def joined() -> list[int]:
                return [w for w, key in enumerate(hellos) if store.check([key])]

            if not wait_until(lambda: store.check(hellos), deadline, STORE_POLL_S, lambda: self.sink.waiting(joined)):
                missing = sorted(set(range(self.num_workers)) - set(joined()))
                raise SyncTimeoutError(
                    f"workers {missing} did not join within {shown_seconds(timeout)} "
                    f"(store at {self.address[0]}:{self.address[1]})",
                    model_id=model_id,
                    worker_idx=missing[0] if len(missing) == 1 else None,
                )
            refused: dict[int, WeightSyncError] = {}
            # NCCL refuses two ranks on one GPU, and only at the first transfer: name it now, by worker.
            holders = {gpu_identity(): "the sender"} if self.settings.backend == "nccl" else {}
            verdict: dict[str, Any] = {}
            nonces = {}  # each process let in, by its hello's nonce (messages.addressed)
            for w, key in enumerate(hellos):
                hello, problem = read_hello(self.store, key, self.authkey, w, 1)
                self.hellos[w] = hello
                if problem is None:
                    nonces[str(w)] = hello["nonce"]
                if problem is not None:
                    verdict[str(w)] = problem
                    refused[w] = AuthenticationError(f"{problem}: refused", model_id=model_id, worker_idx=w)
                    log.warning("model %r: refused worker %d at the rendez-vous: %s", model_id, w, problem)
                elif not hello.get("ok"):
                    refused[w] = ReceiverError(
                        str(hello.get("type", "Error")), str(hello.get("message", "")), model_id=model_id, worker_idx=w
                    )
                elif hello.get("gpu") in holders:
                    verdict[str(w)] = (
                        f"worker {w} is on the same GPU as {holders[hello['gpu']]} ({hello['gpu']}), and NCCL needs "
                        "one GPU per rank: give each worker a GPU of its own (CUDA_VISIBLE_DEVICES or "
                        "torch.cuda.set_device) or use backend='gloo'"
                    )
                    refused[w] = ConfigurationError(verdict[str(w)], model_id=model_id, worker_idx=w)
                elif hello.get("gpu"):
                    holders[hello["gpu"]] = f"worker {w}"
            lines = self._take_lines(set(range(self.num_workers)) - set(refused), deadline)
            said = {**verdict, "lines": sorted(lines), "nonces": nonces}  # (a worker not in lines: its doorbell)
            store_set(self.store, "verdict", self.sealer.seal("verdict", json.dumps(said)))
            # Anyone who reaches the store may claim a rank of the group as it forms: the wait ends at the deadline.
            self.link.pg = new_group_within(
                deadline,
                "the process group with every worker",
                self.settings.backend,
                self.store,
                0,
                self.num_workers + 1,
                self._group_timeout(deadline),
                self.address[0],
                model_id=model_id,
            )
            self.link.store = self.store
            self.requests.open(remaining(deadline))
        except dist.DistError as exc:
            raise SyncTimeoutError(
                f"the process group did not form within {shown_seconds(timeout)}: {first_line(exc)}", model_id=model_id
            ) from None
        return refused

    def _take_lines(self, workers: set[int], deadline: float) -> dict[int, Line]:
        """Take the lines of ``workers`` (every one of them up, or :data:`LINE_WAIT_S`, at most until ``deadline``),
        and close the port."""
        assert self.listener is not None
        write_timeout = GROUP_TIMEOUT_FACTOR * self.sink.timeout  # as long as gloo waits on a stalled peer
        silence = SILENT_TIMEOUTS * self.sink.timeout  # as long as a store's client waits on a vanished host

        def make(w: int, sock: Any) -> Line:
            return Line(sock, f"weightsync-{self.sink.model_id}-line{w}", write_timeout, silence)

        try:
            until = min(deadline, deadline_after(LINE_WAIT_S))
            lines = self.listener.accept(self.authkey, self.prefix, workers, until, make)
        finally:
            self.listener.close()
            self.listener = None
        for w, line in lines.items():
            self.transports[w].line = line
        return lines

    def rendezvous_complete(self) -> bool:
        return self.link.pg is not None

    # ---------------------------------------------------------------- sending
    def stage(self, out: Outgoing, deadline: float) -> Staging:
        if self.pool is None:
            done = lambda works: all(work.done() for work in works)  # noqa: E731
            limit = self.settings.max_buffers
            self.pool = StagingPool(self.layout.nbytes, self.device, limit, done, self._settle, self.pin)
        staging = self.pool.acquire(deadline, model_id=self.sink.model_id, version=out.version)
        self.newest = None  # until the whole version is in the buffer
        self._nonce = new_nonce()
        if out.initial:
            assert self.store is not None
            said = announcement(out.version, self._nonce, self.mac)
            store_set(self.store, "initial", self.sealer.seal("initial", json.dumps(said)))
        return staging

    def submit(self, out: Outgoing, staging: Staging) -> None:
        changed = set(out.delta_workers) if out.delta is not None else set()
        whole = [w for w in out.workers if w not in changed]
        if staging.views is None:
            staging.views = self.layout.views(staging.tensor)
        mac = self.sealer.payload_mac(self.layout_tag, staging.tensor, out.version, self._nonce, self.mac)
        # A small version is staged and hashed before any worker hears of it: its digest rides in the sealed
        # announcement, which spares each worker the store's round trips to read it, and the workers wake to a
        # trainer with nothing left to do but send (on a host with few cores, they would take the cores it copies on).
        said_digest, inline = None, []
        if whole and not out.initial and self.layout.nbytes <= INLINE_DIGEST_BYTES:
            for bucket in self.buckets:
                self._stage_bucket(out, staging, bucket)
            said_digest = mac.hexdigest()
        sending = []
        for w in whole:
            transport = self.transports[w]
            # A small version goes on the worker's line with its announcement, where it has one.
            inline_ok = said_digest is not None and transport.line is not None and on_a_line(staging.tensor.device)
            body = staging.tensor if inline_ok else None
            try:
                # (written and numbered in one step: a Ctrl-C in it cut a frame on the line in two, or left its
                # number to the next message, which the worker refused, and it was named dead)
                with held_interrupts():
                    sent = transport.announce(
                        out.version, self._nonce, self.mac, initial=out.initial, taken=self.reports_taken,
                        digest=said_digest, body=body,
                    )  # fmt: skip
                    staging.readers[w] = []
            except (RuntimeError, WeightSyncError) as exc:  # the store or the peer is gone
                self._gone(w, exc)
                continue
            if sent is not None:
                staging.readers[w].append(sent)
                inline.append(w)
            else:
                sending.append(w)
        if changed:
            self._send_changes(out, sorted(changed), staging)
            if not sending and not inline:  # the version's bytes are copied (and hashed) only for a worker that rejoins
                self.newest, self._unstaged = None, (out.published, out.version)
                return
        # Bucket by bucket: while gloo sends one, the next is copied into the staging buffer (also where only
        # changes were sent: a worker that rejoins is sent the newest version from there).
        for bucket in self.buckets:
            start, end = bucket[2], bucket[3]
            if said_digest is None:
                self._stage_bucket(out, staging, bucket)
            for w in list(sending):
                try:
                    staging.readers[w].append(self.transports[w].send_part(staging.tensor[start:end]))
                except RuntimeError as exc:  # the peer is gone: gloo refuses to send to it
                    self._gone(w, exc)
                    sending.remove(w)
            mac.ready(end)  # hashed while gloo's thread sends the bucket
        payload_digest = mac.hexdigest() if said_digest is None else said_digest
        # Every worker's digest first: each worker waits for its own to check the bytes, and waits on nothing else.
        for w in list(sending) if said_digest is None else []:
            try:
                self.transports[w].set_digest(payload_digest, out.version)  # the workers check it before applying
            except RuntimeError as exc:  # the store is gone
                self._gone(w, exc)
                sending.remove(w)
        for w in inline + sending:
            try:
                self.transports[w].expect_ack(out.version)
            except RuntimeError as exc:  # the peer died since its parts went out: gloo refuses the receive
                self._gone(w, exc)
        self.newest = (staging, out.version, payload_digest, self._nonce)  # what a worker that rejoins is sent
        self._unstaged = None

    def _stage_bucket(self, out: Outgoing, staging: Staging, bucket: tuple[int, int, int, int]) -> None:
        """Copy one bucket of version ``out`` into ``staging`` (``bucket``: its first and last slot, its bytes)."""
        first, last, start, end = bucket
        if out.whole is not None:  # flatten_sender: the bucket's bytes already lie in one buffer, in place
            copy_tensors([staging.tensor[start:end]], [out.whole[start:end]])
        else:
            assert staging.views is not None
            write_into({s.key: staging.views[s.key] for s in self.layout.slots[first:last]}, out.flat)

    def _send_changes(self, out: Outgoing, workers: list[int], staging: Staging) -> None:
        """Send ``out.delta`` to ``workers`` (they hold its base): announced with its description and the keyed
        digest of its body, which follows as one part."""
        delta = out.delta
        assert delta is not None
        nonce = new_nonce()
        body = delta.body.to(self.device)  # (the CPU's own tensor with gloo)
        mac = self.sealer.payload_mac(self.layout_tag, body, out.version, nonce, self.mac)
        digest, described = mac.hexdigest() if body.numel() else NO_BYTES, delta.to_plain()
        for w in workers:
            transport = self.transports[w]
            try:
                with held_interrupts():  # (as a whole version's announcement: in one step)
                    transport.announce(
                        out.version, nonce, self.mac, delta=described, taken=self.reports_taken, digest=digest
                    )
                    staging.readers[w] = [transport.send_part(body)] if body.numel() else []
                transport.expect_ack(out.version)
            except (RuntimeError, WeightSyncError) as exc:  # the peer is gone: gloo refuses to send to it
                self._gone(w, exc)

    def _gone(self, w: int, exc: BaseException) -> None:
        """Worker ``w``'s rank went away (gloo or the store refused, or a send to it failed): it is dead."""
        self.sink.died(w, f"its rank {w + 1} went away ({first_line(exc)})")

    def _settle(self, w: int, works: list, seconds: float) -> bool:
        """Wait a little on the sends to worker ``w``; ``True`` once none reads its buffer any more."""
        wait_futures(works, timeout=seconds)
        if not all(work.done() for work in works):
            return False
        for work in works:
            if work.cancelled() or work.exception() is not None:
                self._gone(w, work.exception() or RuntimeError("cancelled"))
                break
        return True

    # ------------------------------------------------------------------ acks
    def poll(self, workers: list[int]) -> None:
        for w in workers:
            transport = self.transports[w]
            while not self.sink.is_dead(w):
                with held_interrupts():  # (taken and handed on in one step: an ack taken and dropped was lost)
                    if not self._hand_on_ack(w, transport):
                        break

    def _hand_on_ack(self, w: int, transport: DistributedTransport) -> bool:
        """Take worker ``w``'s oldest ack that arrived and hand it on; ``False`` where none did, or it is gone."""
        try:
            got = transport.take_ack()
        except WeightSyncError as exc:
            self.sink.died(w, exc)
            return False
        if got is None:
            return False
        pending, held, status = got
        if status != ACK_OK:
            detail = transport.error_detail(pending.seq)  # (looked for within a bound)
            self.sink.failed(
                w,
                ReceiverError(
                    detail["type"], detail["message"], model_id=self.sink.model_id, worker_idx=w,
                    version=pending.version,
                ),
            )  # fmt: skip
        if status == ACK_OK or held >= 0:
            self.sink.acked(w, held)
        return True

    def wait(self, workers: list[int], deadline: float) -> None:
        heads = [f for f in (self.transports[w].waiting_on() for w in workers) if f is not None]
        lines = [h for h in heads if isinstance(h, Line)]
        futures = [h for h in heads if not isinstance(h, Line)]
        if any(line.fileno() < 0 for line in lines):  # a line closed: poll() says why, now
            return
        if lines:  # acks on lines are read on this thread: it waits on their sockets (in slices, with futures too)
            left = min(remaining(deadline), MIXED_WAIT_S) if futures else remaining(deadline)
            try:
                descriptors.readable([line.fileno() for line in lines], left)
            except (ValueError, OSError):  # a line closed meanwhile (its writer failed): poll() says why
                return
        if futures:
            wait_futures(futures, timeout=0.0 if lines else remaining(deadline), return_when=FIRST_COMPLETED)
        if not lines and not futures:  # nothing on its way from them: nothing can come before the deadline
            time.sleep(remaining(deadline))

    def wait_sent(self, worker: int, deadline: float) -> None:
        newest = self.newest
        works = newest[0].readers.get(worker, []) if newest is not None else []
        if works:  # gloo's sends of the newest version to this worker, each done once its bytes were taken
            wait_futures(works, timeout=max(remaining(deadline), 0.0))
        transport = self.transports.get(worker)
        if transport is not None and not self.sink.is_dead(worker):  # ... and the worker's check of them, last
            transport.wait_taken(deadline)

    def unpublished(self) -> None:
        self._unstaged = None  # (a whole version staged before, in self.newest, still stands)

    def set_aside(self, worker: int) -> bool:
        if self.pool is not None:
            self.pool.retire(worker)  # (the sends still reading its buffers keep them alive)
        return True

    def lost(self, worker: int, reason: str) -> None:
        self.transports[worker].drop(reason)
        if self.pool is not None:
            self.pool.forget(worker)

    # --------------------------------------------------------------- shutdown
    def close(self, timeout: float) -> None:
        self.requests.close()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self._key_file is not None:
            remove_key_file(self._key_file)
            self._key_file = None
        if self.store is not None:  # a dropped worker asking to rejoin stops waiting for an answer
            with contextlib.suppress(dist.DistError):
                store_set(self.store, "shutdown", self.sealer.seal("shutdown", "1"))
        for w, transport in self.transports.items():
            if not self.sink.is_dead(w):
                transport.close(min(timeout, CLOSE_WAIT_S))
            elif transport.line is not None:  # (a dead worker's line: nothing to say on it)
                transport.line.close(0.0)
        self.transports.clear()
        self.pool = None
        self.newest = None
        self.link.pg = self.link.store = None
        self.store = self._base_store = None
