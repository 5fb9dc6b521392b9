"""The trainer's side of the RPC engine: this process's RPC world, staging buffers, one RPC per worker."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from ...core.engine import Outgoing, SenderEngine, Sink
from ...core.interrupts import held_interrupts
from ...core.timing import backed_off, deadline_after, remaining, shown_seconds, wait_until
from ...errors import ReceiverError, SyncTimeoutError, WeightSyncError, first_line
from ...tensors.layout import FlatLayout
from ..staging import Staging, StagingPool
from .mailbox import NO_RECEIVER
from .session import (
    GRACEFUL_S,
    SENDER_NAME,
    Session,
    forget_ended,
    leave_session,
    open_sender_session,
    say_ended,
    start_agent,
)
from .settings import RPCSettings
from .transport import RPCTransport

__all__ = ["RPCSender"]

#: Seconds the sender's goodbye to each worker may take at shutdown.
CLOSE_WAIT_S = 5.0
#: Seconds between two asks of a worker for an answer its version's call gave up on; each ask in a row that timed
#: out doubles that, up to :data:`ASK_AT_MOST_EVERY_S` (TensorPipe keeps each one's bytes until the worker reads).
ASK_EVERY_S = 0.25
ASK_AT_MOST_EVERY_S = 5.0
#: The most characters of a worker's word of why it is gone that an error quotes.
MAX_GONE = 200


def _timed_out(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


def _released(future: Any) -> bool:
    """Whether an RPC no longer reads its staging buffer: it was answered, or its peer is gone. One that timed
    out is not: TensorPipe goes on writing its bytes if the link comes back (the buffer is then retired)."""
    if not future.done():
        return False
    try:
        future.wait()
    except RuntimeError as exc:
        return not _timed_out(exc)
    return True


@dataclass
class _Asking:
    """A worker whose call for ``version`` (``whole``: the version whole, else its changes) gave up waiting for its
    answer: it is asked for it (:meth:`RPCSender._ask`) until it has answered that call or a later one."""

    version: int
    whole: bool
    due: float = 0.0  # when the next ask may go
    out: Any = None  # the ask's future, while one is out
    misses: int = 0  # asks in a row that timed out

    def answered_by(self, version: int, whole: bool) -> bool:
        """Whether an answer to ``version`` (``whole``, or its changes) answers the call asked about, or a later
        one: changes refused and then sent whole in the same send are two calls of one version, the whole one
        later."""
        return version > self.version or (version == self.version and (whole or not self.whole))


class RPCSender(SenderEngine):
    """The sender's RPC session (unless the caller runs RPC), staging buffers and one :class:`RPCTransport` per
    worker. The initial version's RPCs are bounded by the core's ``connect_timeout``, later ones only by the core's
    waits (:meth:`_bound`); a session the engine runs serves its store, bounded by ``connect_timeout``, from
    construction on.

    Args:
        settings: the transport's (``max_buffers``).
        names: the workers' RPC names in an agent the caller started (``None``: the engine runs the world).
        master: the store's host and port, for a world the engine runs.
    """

    takes_deltas = True

    def __init__(
        self,
        sink: Sink,
        layout: FlatLayout,
        num_workers: int,
        settings: RPCSettings,
        *,
        names: list[str] | None,
        master: tuple[str, int] | None,
        checksum: bool = False,
        gpu: torch.device | None = None,
    ) -> None:
        super().__init__(sink, layout, num_workers, checksum=checksum, gpu=gpu)
        self.settings = settings
        self.session: Session | None = None
        if names is None:
            assert master is not None
            self.session = open_sender_session(master, num_workers + 1, sink.connect_timeout)
            for w in range(num_workers):
                forget_ended(self.session, sink.model_id, w)
        #: What this sender's calls carry: a worker's receiver takes only its own sender's (the mailbox module).
        self.id = secrets.token_hex(8)
        self.transports = {
            w: RPCTransport(w, names[w] if names else None, model_id=sink.model_id, sink=sink, sender=self.id)
            for w in range(num_workers)
        }
        self.pool: StagingPool | None = None
        self._answered = threading.Event()  # set by every answer's future
        self._initial: set[tuple[int, int]] = set()  # (worker, version) of the initial versions' RPCs in flight
        self._has_layout: set[int] = set()  # workers that answered once: they hold the layout
        self._asking: dict[int, _Asking] = {}  # workers whose call gave up waiting for the answer (:meth:`_ask`)
        self._changes_out: set[tuple[int, int]] = set()  # (worker, version) of calls out that carry changes
        self._connected = False

    def handoff(self) -> dict[str, Any]:
        sess = self.session
        if sess is None:
            return {"external": True, "sender": self.id}
        return {
            "token": sess.token,
            "master_addr": sess.host,
            "master_port": sess.port,
            "world_size": sess.world_size,
            "counter": sess.counter,
            "sender": self.id,
        }

    connection = handoff

    def rendezvous(self, deadline: float, timeout: float) -> dict[int, WeightSyncError]:
        if self.session is not None:
            where = {"model_id": self.sink.model_id}
            start_agent(self.session, SENDER_NAME, 0, remaining(deadline), self.sink.waiting, **where)
        self._connected = True
        return {}

    def rendezvous_complete(self) -> bool:
        return self.session is None or self.session.started

    def stage(self, out: Outgoing, deadline: float) -> tuple[Staging, str | None] | None:
        if not out.whole_to:  # every worker is sent its changes
            return None
        if self.pool is None:
            cpu = torch.device("cpu")
            limit = self.settings.max_buffers
            self.pool = StagingPool(self.layout.nbytes, cpu, limit, _released, self._settle, self.pin)
        staging = self.pool.acquire(deadline, model_id=self.sink.model_id, version=out.version)
        if staging.views is None:  # typed views of a staging buffer are made once, not per send
            staging.views = self.layout.views(staging.tensor)
        out.write(staging.tensor, staging.views)
        return staging, self.digest([staging.tensor])

    def submit(self, out: Outgoing, staged: tuple[Staging, str | None] | None) -> None:
        if out.delta is not None:
            described = out.delta.to_plain()
            for w in out.delta_workers:  # (they acked a version: they hold the layout)
                with held_interrupts():  # (each call made and recorded in one step, as below)
                    self._submit(w, out.version, out.delta.body, None, None, described)
        if staged is None:
            return
        staging, payload_digest = staged
        for w in out.whole_to:
            layout = None if w in self._has_layout else self.layout.to_plain()  # until the worker has it
            # Made and recorded in one step: a call a Ctrl-C left unrecorded was neither waited for, nor counted
            # as reading its buffer, which the next send could refill while the call still sent it.
            with held_interrupts():
                future = self._submit(w, out.version, staging.tensor, layout, payload_digest, initial=out.initial)
                if future is not None:
                    staging.readers[w] = future

    def _submit(
        self,
        w: int,
        version: int,
        buffer: torch.Tensor,
        layout: dict | None,
        payload_digest: str | None,
        delta: dict | None = None,
        initial: bool = False,
    ) -> Any:
        """One RPC bringing ``version`` to worker ``w``; its future, or ``None`` if the worker is gone. ``initial``:
        the version of ``connect()``, bound by ``connect_timeout`` (a worker's first apply may compile code)."""
        transport = self.transports[w]
        try:
            future = transport.submit(version, buffer, layout, self._bound(initial), payload_digest, delta)
            if initial:
                self._initial.add((w, version))
            if delta is not None:
                self._changes_out.add((w, version))
        except RuntimeError as exc:
            self.sink.died(w, f"RPC peer {transport.worker_name} went away ({first_line(exc)})")
            return None
        future.add_done_callback(lambda _: self._answered.set())
        return future

    def _bound(self, initial: bool) -> float:
        """The longest one RPC of a version waits for its answer: the initial version's, ``connect_timeout``; a later
        one's, in a world this engine runs, no bound of its own (0: TensorPipe's "never"). The core's wait bounds
        the send, and a worker that did not answer in it is late, passed by while its call is out (its answer, when
        it comes, is its ack). In a world the caller runs, ``timeout``: the caller's own graceful shutdown waits for
        every call still out, with no bound of its own (:meth:`close` bounds this engine's). A call that gave up
        leaves its worker late as well, asked for the answer by small calls (:meth:`_ask`): sent each version
        anew, a stopped worker cost each send that ``timeout``, and TensorPipe kept the bytes of every call until
        it read again (the trainer grew by the model's size a send)."""
        if initial:
            return self.sink.connect_timeout
        return 0.0 if self.session is not None else self.sink.timeout

    def _settle(self, w: int, future: Any, seconds: float) -> bool:
        self._answered.wait(seconds)
        self._answered.clear()
        return _released(future)

    def poll(self, workers: list[int]) -> None:
        self._answered.clear()  # before looking: an answer that lands after the look sets it again
        for w in workers:
            transport = self.transports[w]
            for version, future in sorted(transport.in_flight.items()):
                if not future.done():
                    break
                with held_interrupts():  # (taken and read in one step: an answer taken and not read was lost)
                    del transport.in_flight[version]
                    self._answer(w, version, future)
                if self.sink.is_dead(w):
                    break
            if w in self._asking and not self.sink.is_dead(w):
                self._ask(w)

    def _answer(self, w: int, version: int, future: Any) -> None:
        """Read one worker's answer: its ack, its failure, or that it is gone."""
        transport, initial = self.transports[w], (w, version) in self._initial
        whole = (w, version) not in self._changes_out
        self._initial.discard((w, version))
        self._changes_out.discard((w, version))
        try:
            answer = future.wait()
        except RuntimeError as exc:
            if _timed_out(exc):
                if self.pool is not None:
                    self.pool.retire(w)  # its bytes may still go out once the link is back
                asking = self._asking.get(w)
                if asking is None:
                    self._asking[w] = _Asking(version, whole)
                elif not asking.answered_by(version, whole):  # (a later call: its answer is the one asked for)
                    asking.version, asking.whole = version, whole
                self.sink.unanswered(
                    w,
                    SyncTimeoutError(
                        f"no ack for version {version} within {shown_seconds(self._bound(initial))}",
                        model_id=self.sink.model_id,
                        worker_idx=w,
                        version=version,
                    ),
                )
            else:
                self.sink.died(w, f"RPC peer {transport.worker_name} went away ({first_line(exc)})")
            return
        asking = self._asking.get(w)
        if asking is not None and asking.answered_by(version, whole):  # (the answer asked for is no longer news)
            del self._asking[w]
        self._take(w, version, answer)

    def _take(self, w: int, version: int, answer: dict[str, Any]) -> None:
        """``answer``, worker ``w``'s to ``version``: its ack, and its failure if it failed, or that it is gone."""
        if answer.get("gone"):  # (its receiver of this sender shut down: the mailbox answers for it)
            self.sink.died(w, f"RPC peer {self.transports[w].worker_name}: {str(answer['gone'])[:MAX_GONE]}")
            return
        if answer.get("held") is not None:
            self._has_layout.add(w)
            self.sink.acked(w, int(answer["held"]))
        if answer.get("error"):
            error = answer["error"]
            self.sink.failed(
                w,
                ReceiverError(
                    str(error.get("type", "Error")), str(error.get("message", "")), model_id=self.sink.model_id,
                    worker_idx=w, version=version,
                ),
            )  # fmt: skip

    def _ask(self, w: int) -> None:
        """Ask worker ``w``, whose call gave up waiting, for the newest call it answered (one ask out at a time,
        backing off while they time out); once that is the call asked about or a later one, its answer is taken as
        the call's, and the worker is no longer late on it."""
        asking, transport = self._asking[w], self.transports[w]
        if asking.out is not None and asking.out.done():
            with held_interrupts():  # (read and taken in one step: an answer read and not taken left it late for good)
                out, asking.out = asking.out, None
                try:
                    last = out.wait()
                except RuntimeError as exc:
                    if not _timed_out(exc):
                        self.sink.died(w, f"RPC peer {transport.worker_name} went away ({first_line(exc)})")
                        return
                    asking.misses += 1
                    asking.due = time.monotonic() + backed_off(ASK_EVERY_S, asking.misses, ASK_AT_MOST_EVERY_S)
                    return
                asking.misses = 0
                if last == NO_RECEIVER:  # (asked four times a second while sends ran, it never answered)
                    del self._asking[w]
                    self.sink.died(w, f"RPC peer {transport.worker_name}: its receiver shut down")
                    return
                if last is not None and asking.answered_by(int(last[0]), bool(last[1])):
                    self._take(w, int(last[0]), last[2])
                    del self._asking[w]
                    return
        if asking.out is None and time.monotonic() >= asking.due:
            asking.due = time.monotonic() + ASK_EVERY_S
            try:
                asking.out = transport.ask_last_answer(self.sink.timeout)
            except RuntimeError as exc:
                self.sink.died(w, f"RPC peer {transport.worker_name} went away ({first_line(exc)})")
                return
            asking.out.add_done_callback(lambda _: self._answered.set())

    def wait(self, workers: list[int], deadline: float) -> None:
        asking = any(w in self._asking for w in workers)  # (its next ask is due within ASK_EVERY_S, made by a poll)
        self._answered.wait(min(remaining(deadline), ASK_EVERY_S) if asking else remaining(deadline))

    def set_aside(self, worker: int) -> bool:
        if self.pool is not None:
            self.pool.retire(worker)  # (the sends still reading its buffers keep them alive)
        return True

    def lost(self, worker: int, reason: str) -> None:
        self.transports[worker].in_flight.clear()
        self._asking.pop(worker, None)
        self._changes_out = {(w, v) for w, v in self._changes_out if w != worker}
        if self.pool is not None:
            self.pool.retire(worker)  # RPC cannot cancel a send: what it still writes must not change
        # (a worker dropped alive, a stalled one, is told: RPC cannot take its rank back into the world)
        say_ended(self.session, self.sink.model_id, worker, f"the sender dropped this worker ({reason})")

    def close(self, timeout: float) -> None:
        # Every worker alive hears the goodbye: the whole world is shutting down, by its barrier. One dead (dropped,
        # or gone) never joins it: the others are told to leave alone, as this sender does (they waited for a
        # barrier nobody else joined, and torch printed its failure at their every exit).
        whole = self._connected and not any(self.sink.is_dead(w) for w in self.transports)
        clean = whole
        calls = [future for transport in self.transports.values() for future in transport.in_flight.values()]
        calls += [asking.out for asking in self._asking.values() if asking.out is not None]
        for w, transport in self.transports.items():
            alive = self._connected and not self.sink.is_dead(w)
            heard = alive and transport.close(min(timeout, CLOSE_WAIT_S), whole)
            if alive and not heard:  # (one that did not hear it reads it in the store: say_ended)
                say_ended(self.session, self.sink.model_id, w, "the sender shut down")
            clean = heard and clean
        if clean and calls:
            # The world's barrier (TensorPipe's graceful shutdown) waits, with no bound, for every call still out,
            # and a version's call has none of its own: each worker that heard the goodbye answers what it still
            # holds as it closes. One that does not in time (hung in its own code) leaves this sender to stop alone.
            clean = wait_until(lambda: all(f.done() for f in calls), deadline_after(min(timeout, GRACEFUL_S)), 0.01)
        self.transports.clear()
        self.pool = None
        if self.session is not None:
            leave_session(self.session, clean=clean)
            self.session = None
