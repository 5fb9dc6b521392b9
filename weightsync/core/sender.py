"""The trainer's side of every scheme: one pipeline, whatever the engine.

A send checks the weights, takes in what came back since the last call, has the engine stage the version once and
submit it to each live targeted worker, then collects acks against one deadline, applies the failure policy and
records the metrics. The engine (:class:`~weightsync.core.engine.SenderEngine`) only moves bytes and reports acks,
refusals and deaths to this object, its :class:`~weightsync.core.engine.Sink`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, Protocol

import torch

from ..errors import SyncTimeoutError, TransportError, WeightSyncError, WorkerDiedError, by_worker, raise_failures
from ..metrics import SendMetrics, SendRecord
from ..tensors.bound import BoundModel
from ..tensors.layout import FlatLayout
from ..tensors.strategy import check_finite, check_sent, flatten_weights
from .changes import Changes
from .children import KnownProcesses
from .engine import Outgoing, SenderEngine
from .ledger import Ledger, Peer
from .rejoin import Admitter
from .staleness import bound_staleness
from .timing import Progress, deadline_after, remaining, shown_seconds

__all__ = ["Sender", "SenderOptions"]

log = logging.getLogger("weightsync.core")


class SenderOptions(Protocol):
    """What the sender core reads of its scheme's options, read at each use (a scheme's ``timeout`` changed
    after ``init_on_sender`` governs the next wait)."""

    timeout: float
    connect_timeout: float
    sync: bool
    flatten_sender: bool
    check_finite: bool
    max_staleness: int | None
    on_failure: str

    @property
    def strategy_str(self) -> str: ...


class Sender:
    """Versions, the ack ledger, deadlines, the failure policy, staleness, metrics and rejoins of one scheme.

    Args:
        scheme: the scheme's options (``timeout``, ``connect_timeout``, ``sync``, ``on_failure``,
            ``max_staleness``, ``check_finite``, ``flatten_sender``, ``strategy_str``: :class:`SenderOptions`): the
            engine reads the timeouts here (:class:`~weightsync.core.engine.Sink`), never a copy of its own.
        model_id: the model's name.
        num_workers: how many workers.
        layout: where each tensor sits in a version's bytes.
        flat_weights: ``flat_weights(weights)``: the tensors of ``weights`` (``None``: the registered model) as
            the source's own objects.
        lock: the scheme's lock, held by every call that sends (and by the rejoin thread when it admits).
    """

    def __init__(
        self,
        scheme: SenderOptions,
        *,
        model_id: str | None,
        num_workers: int,
        layout: FlatLayout,
        flat_weights: Callable[[Any], dict[str, torch.Tensor]],
        lock: threading.RLock,
    ) -> None:
        self.options = scheme
        self.model_id = model_id
        self.layout = layout
        self._flat_weights = flat_weights
        self._lock = lock
        self.ledger = Ledger(model_id, {w: Peer() for w in range(num_workers)})
        self.metrics = SendMetrics()
        #: Under ``flatten_sender``: the trainer's weights as views of one storage.
        self.bound = BoundModel()
        self.engine: SenderEngine | None = None
        self.version: int | None = None
        self.next_version = 0
        self._naming: int | None = None  # the version deaths found now are named with (the one being sent)
        self._admitter: Admitter | None = None
        #: The worker processes this sender knows of: one that exits before it connected is named at once.
        self.processes = KnownProcesses()
        #: What the program's workers that have not connected said before they exited (a driver's ``last_words``).
        self.last_words: Callable[[list[int]], list[str]] | None = None
        self._progress: Progress | None = None
        #: Under the scheme's ``delta``: the trainer's copy of the newest version, and who is sent changes.
        self.changes = Changes(scheme, layout)

    # --------------------------------------------------------------- the sink
    timeout = property(
        lambda self: self.options.timeout, doc="The longest one update may take from its send to its ack: ``timeout``."
    )
    connect_timeout = property(
        lambda self: self.options.connect_timeout, doc="The longest a rendez-vous may take: ``connect_timeout``."
    )

    def acked(self, worker: int, held: int) -> None:
        self.ledger.ack(worker, held)

    def failed(self, worker: int, error: WeightSyncError) -> None:
        self.ledger.failed(worker, error)

    def unanswered(self, worker: int, error: SyncTimeoutError) -> None:
        self.ledger.unanswered(worker, error)

    def died(self, worker: int, error: WeightSyncError | str) -> None:
        if isinstance(error, str):
            version = self._naming if self._naming is not None else self.ledger.peers[worker].sent
            error = WorkerDiedError(error, model_id=self.model_id, worker_idx=worker, version=version)
        self.mark_dead(worker, error)

    def is_dead(self, worker: int) -> bool:
        return worker in self.ledger.dead

    def waiting(self, joined: Callable[[], Collection[int]]) -> None:
        """The engine's rendez-vous is waiting (it calls this at least twice a second): say now and then which
        workers are missing, and raise at once when a worker process this process started has exited.

        Raises:
            WorkerDiedError: a worker process it knows of (:class:`~weightsync.core.children.KnownProcesses`)
                exited.
        """
        n = len(self.ledger.peers)

        def missing() -> list[int]:
            return sorted(set(self.ledger.peers) - set(joined()))

        exited = self.processes.exited()
        if exited:
            absent = missing()
            said = self.last_words(absent) if self.last_words is not None else []
            raise WorkerDiedError(
                f"{'; '.join(exited)} before it connected (workers {absent} have not connected)"
                + "".join(f"; {words}" for words in said),
                model_id=self.model_id,
            )
        if self._progress is not None:
            self._progress.tick(lambda: f"{n - len(missing())} of {n} connected, missing {missing()}")

    def rejoining(self, worker: int, version: int | None = None) -> None:
        """``worker`` is coming back: from here on, a failure is the new process's (named with ``version``, what
        it is sent), and what it holds is what it acks next (the earlier process's acks say nothing of it); it is
        sent the version whole (changes sent to the earlier process do not count)."""
        self.ledger.renew(worker, version)
        self.changes.sent.pop(worker, None)

    def send_to(self, weights: Any, workers: list[int], *, wait: bool | None) -> None:
        with self._lock:
            self.send_version(weights, workers, wait=self.options.sync if wait is None else wait)

    def wait_for(self, workers: list[int], timeout: float | None) -> None:
        """Wait until each of ``workers`` acked the last version sent to it (at most ``timeout``, default the
        scheme's); raise what failed."""
        with self._lock:
            deadline = deadline_after(within := self.timeout if timeout is None else timeout)
            peers = self.ledger.peers
            failures = self.ledger.gone(workers, self.version)
            expected = {w: peers[w].sent for w in workers if peers[w].sent is not None and w not in failures}
            failures.update(self.collect(expected, deadline, within))  # type: ignore[arg-type]
            again = self.changes.whole_again(failures)
            if again is not None:  # as a send that waits does at once (send_version)
                self._send_whole_again(again, failures, deadline, within)
            self.ledger.answered(failures)
            raise_failures(failures, model_id=self.model_id, version=self.version)

    def _send_whole_again(
        self, out: Outgoing, failures: dict[int, WeightSyncError], deadline: float, within: float | None
    ) -> None:
        """Send ``out`` (a version sent as changes) whole to the workers that refused the changes; wait for them
        until ``deadline`` (``within``: as :meth:`collect`) and put what failed in ``failures``."""
        assert self.engine is not None
        refused = out.workers
        log.info("model %r: workers %s refused the changes of version %s; sent whole", self.model_id, refused,
                 out.version)  # fmt: skip
        out.workers = self.ledger.live(refused)
        try:
            if out.workers:  # (sent to no one, it would stand as the engine's newest: a whole version, unstaged)
                self.engine.submit(out, self.engine.stage(out, deadline))
                self.ledger.resent(out.workers, out.version)
        except WeightSyncError as exc:  # no free buffer in time: those workers keep the version they hold
            failures.update({w: exc for w in refused})
            return
        failures.update(self.ledger.gone([w for w in refused if w not in failures]))
        failures.update(self.collect({w: out.version for w in refused if w not in failures}, deadline, within))

    # ----------------------------------------------------------- the workers
    def mark_dead(self, worker: int, exc: WeightSyncError, *, said: bool = False) -> WeightSyncError:
        """Record ``worker`` as gone (once; logged unless ``said``: the caller logged why); later sends name it with
        ``exc``."""
        if worker not in self.ledger.dead:
            if not said:  # (the message, not the exception: a handler that keeps records must not keep its frames)
                log.warning("model %r: worker %d is gone: %s", self.model_id, worker, str(exc))
            self.ledger.dead[worker] = exc
            if self.engine is not None:
                self.engine.lost(worker, str(exc))
        return self.ledger.dead[worker]

    def rejoined(self, worker: int, version: int | None) -> None:
        """``worker`` is back, and was sent ``version``: it counts as live again (its engine said it was coming
        back before it sent it: :meth:`rejoining`; an ack that came since stands)."""
        self.ledger.dead.pop(worker, None)
        self.ledger.errors.pop(worker, None)
        self.ledger.peers[worker].sent = version
        self.metrics.dropped.pop(worker, None)
        self.metrics.rejoins[worker] = self.metrics.rejoins.get(worker, 0) + 1
        log.info("model %r: worker %d rejoined and was sent version %s", self.model_id, worker, version)

    def _admit(self, candidate: Any) -> None:
        assert self.engine is not None
        admitted = self.engine.admit(candidate)
        if admitted is not None:
            self.rejoined(*admitted)

    # ----------------------------------------------------------------- weights
    def adopt(self, model: Any) -> None:
        """``flatten_sender``, at init: move the registered model into one buffer laid out like the payload."""
        self.bound.adopt(flatten_weights(model, self.options.strategy_str), self.layout, self.model_id)

    def weights(self, weights: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """``weights`` (``None``: the registered model) as the source's own tensors, checked against the layout
        (for a caller that copies them out under ``no_grad``); and, under ``flatten_sender``, the bytes of the
        one storage they view, every tensor in its place (``None``: copy them tensor by tensor).

        Raises:
            WeightMismatchError: the weights do not match the layout.
        """
        flat = self._flat_weights(weights)
        flatten = self.options.flatten_sender
        held = flatten and self.bound.holds(flat)  # exactly as bound: keys, shapes and dtypes hold
        if not held:
            check_sent(flat, self.layout.spec, model_id=self.model_id)
        if not flatten:
            return flat, None
        return flat, self.bound.published(flat, self.layout, held, weights is None, self.model_id)

    # -------------------------------------------------------------- pipeline
    def connect(self, weights: Any, timeout: float) -> None:
        """The rendez-vous, then version 0 to every worker that joined; raise naming those that failed. ``weights``
        that do not fit are refused first (``WeightMismatchError``), before any wait: the scheme connects as before."""
        assert self.engine is not None
        if weights is not None:
            check_sent(self._flat_weights(weights), self.layout.spec, model_id=self.model_id)
        deadline = deadline_after(timeout)
        n = len(self.ledger.peers)
        self._progress = Progress(log, f"{n} worker{'s' if n != 1 else ''} to connect", timeout, model_id=self.model_id)
        try:
            refused = self.engine.rendezvous(deadline, timeout)
        finally:
            self._progress = None
        if self.engine.rejoins:
            self._admitter = Admitter(
                f"weightsync-{self.model_id}-admitter", self._lock, self.engine.poll_rejoin, self._admit,
                self.engine.discard,
            )  # fmt: skip
        for w, exc in refused.items():
            self.mark_dead(w, exc)
        failures = dict(refused)
        joined = [w for w in sorted(self.ledger.peers) if w not in refused]
        try:
            if joined:
                self.send_version(weights, joined, wait=True, deadline=deadline, initial=True)
        except WeightSyncError as exc:
            for w, failure in by_worker(exc).items():
                # A worker whose model does not fit is out for good, as is one that gave up on its side; where a
                # call pushes version 0, it is still on its way to a slow worker: late, as after any send's wait.
                if not (self.engine.pushes and isinstance(failure, SyncTimeoutError)):
                    self.mark_dead(w, failure)
            if not by_worker(exc):
                raise
            failures.update(by_worker(exc))
        raise_failures(failures, model_id=self.model_id, version=0)

    def send_version(
        self, weights: Any, targets: list[int], *, wait: bool, deadline: float | None = None, initial: bool = False
    ) -> None:
        """Publish one new version to ``targets``; wait for their acks when ``wait`` (until ``deadline``).

        Raises:
            WeightMismatchError: the weights do not fit; nothing was sent.
            SyncTimeoutError: no free buffer before ``deadline``; nothing was sent.
            WeightSyncError: workers that failed (the others hold the new version).
        """
        assert self.engine is not None
        flat, whole = self.weights(weights)
        deadline = deadline_after(self.timeout) if deadline is None else deadline
        version = self.next_version
        ledger = self.ledger
        self._naming = version
        try:
            self.heard()
            passed = self.late(targets, version)
            for w in passed:  # (what the versions on their way to it hold leaves the pool: the others wait for none)
                self.engine.set_aside(w)
            failures = {**ledger.gone(targets, version), **passed}  # (named by this send's version)
            live = [w for w in targets if w not in failures]
            out = Outgoing(version, flat, whole, live, initial)
            submitting = False
            try:
                # First: an engine stages the whole version only for workers not sent changes.
                self.changes.plan(out, ledger.peers, self.engine.takes_deltas)
                staged = self.engine.stage(out, deadline)
                submitting = True
                self.engine.submit(out, staged)
                self.next_version = version + 1  # (spent at once: a Ctrl-C below must not leave it to the next)
            except BaseException:
                # The copy may hold bytes of this version, which was not sent (or not to everyone): the next send
                # fills it whole, and the engine no longer takes it for the newest version (for one that rejoins).
                self.changes.unpublished()
                self.engine.unpublished()
                if submitting:  # some workers may hold this number's bytes: the next send never names others so
                    self.next_version = version + 1
                raise
            self.changes.submitted(out)
            for w in live:
                ledger.peers[w].sent = version
            failures.update(ledger.gone(live))  # found gone just now
            self.version = version
        finally:
            self._naming = None
        if wait:
            within = self.connect_timeout if initial else None  # (the connect's deadline)
            failures.update(self.collect({w: version for w in live if w not in failures}, deadline, within))
            again = self.changes.whole_again(failures)
            if again is not None:  # a worker that does not hold the base gets the version whole, in this send
                self._send_whole_again(again, failures, deadline, within)
        failures.update(self.engine.settle(live, deadline_after(self.timeout)))
        errors = ledger.take_errors([w for w in targets if w not in failures])
        # (not waited for: a time-out of an older version counts until the worker acked a later one)
        failures.update(
            {w: e for w, e in errors.items() if not _moot(e, version, version if wait else ledger.peers[w].acked)}
        )
        ledger.answered(failures)
        raise_failures(failures, model_id=self.model_id, version=version)

    def heard(self) -> None:
        """Take what came back from the live workers since the last look: acks, failures, deaths, calls that gave up
        waiting."""
        assert self.engine is not None
        self.engine.poll(self.ledger.live(sorted(self.ledger.peers)))

    def late(self, targets: list[int], version: int | None = None) -> dict[int, WeightSyncError]:
        """The workers of ``targets`` a send passes by (:meth:`SenderEngine.passes_by`; late again, where the engine
        holds versions back), each with its error."""
        if self.engine is None:
            return {}
        again = not self.engine.passes_late_by  # (it holds back: one more send, then passed by)
        late = self.ledger.late(targets, version)
        return {w: e for w, e in late.items() if self.engine.passes_by(w) or again and self.ledger.late_again(w)}

    def collect(
        self, expected: dict[int, int], deadline: float, within: float | None = None
    ) -> dict[int, WeightSyncError]:
        """Wait until each worker of ``expected`` acked at least its version, or ``deadline`` (``within`` seconds
        away, which a time-out names; default: the scheme's ``timeout``); return failures."""
        assert self.engine is not None
        ledger = self.ledger
        failures: dict[int, WeightSyncError] = {}
        while True:
            self.heard()
            failures.update(ledger.gone_before_acking(expected, failures))
            for w, e in ledger.take_errors([w for w in expected if w not in failures]).items():
                if not _moot(e, max(expected[w], ledger.peers[w].sent or -1), expected[w]):  # (a bound's is older)
                    failures[w] = e
            pending = ledger.missing(expected, failures)
            if not pending:
                return failures
            if remaining(deadline) <= 0:
                failures.update(
                    ledger.timeouts(pending, expected, shown_seconds(self.timeout if within is None else within))
                )
                return failures
            self.engine.wait(pending, deadline)

    # ---------------------------------------------------------------- policy
    def publish(self, weights: Any, targets: list[int], wait: bool) -> None:
        """One send under the failure policy, measured: bound staleness, publish, then raise or drop."""
        started = time.perf_counter()
        if self.options.check_finite:
            check_finite(self._flat_weights(weights), model_id=self.model_id)
        stale_wait = 0.0
        if not wait and self.options.max_staleness is not None:
            stale_wait = bound_staleness(self, targets, self.options.max_staleness)
        before = self.version
        failure: WeightSyncError | None = None
        try:
            try:
                self.send_version(weights, targets, wait=wait)
            except WeightSyncError as exc:
                if self.version != before or not self._past(exc):
                    raise
                self.send_version(weights, targets, wait=wait)  # (once more: the late are passed by)
        except WeightSyncError as exc:
            if self.version == before:  # nothing was published (bad weights, no free buffer): always raised
                raise
            failure = exc
        failures = by_worker(failure) if failure is not None else {}
        peers = self.ledger.peers
        record = SendRecord(
            version=self.version,
            workers=list(targets),
            nbytes=self.engine.payload_bytes() if self.engine is not None else 0,
            seconds=time.perf_counter() - started,
            acks={
                w: round(peers[w].acked_at - started, 6)
                for w in targets
                if w not in failures
                and self.version is not None
                and self.ledger.has_acked(w, self.version)
                and peers[w].acked_at >= started
            },
            failed={w: f"{type(e).__name__}: {e.detail}" for w, e in failures.items()},
            staleness_wait=stale_wait,
            changes=dict(self.changes.sent),  # (as sent: a refusal collected later takes its worker out)
        )
        self.metrics.add(record)
        log.debug("model %r: send %s", self.model_id, record)
        if failure is not None:
            self.handle_failures(failure, self.version)

    def _past(self, exc: WeightSyncError) -> bool:
        """A send that published nothing because workers held up its staging (no free buffer or slot in its wait,
        as sends that do not wait left versions to a stopped worker): they are late. Under ``drop`` they are
        dropped, else their engine sets aside what they hold; returns whether the send may go on past them."""
        assert self.engine is not None
        held = [w for w, e in by_worker(exc).items() if isinstance(e, SyncTimeoutError) and w in self.ledger.peers]
        if not held or not all(self.engine.passes_by(w) for w in held):
            return False
        self.ledger.held_up(held)
        if self.options.on_failure == "drop":
            self.handle_failures(exc, self.version)
            return True
        return all([self.engine.set_aside(w) for w in held])

    def wait(self, timeout: float) -> None:
        """``wait_async``: every worker's ack of the last version sent to it, under the failure policy."""
        try:
            self.wait_for(sorted(self.ledger.peers), timeout)
        except WeightSyncError as exc:
            self.handle_failures(exc, self.version)

    def handle_failures(self, exc: WeightSyncError, version: int | None) -> None:
        """Raise ``exc`` (``on_failure="raise"``), or drop the workers it names as dead or late and raise
        only what is left (a worker that refused the update, an error that names no worker)."""
        failures = by_worker(exc)
        if self.options.on_failure == "raise" or not failures:
            raise exc
        kept = {}
        dropped = len(self.metrics.dropped)
        for w, error in failures.items():
            if isinstance(error, (TransportError, SyncTimeoutError)):
                if w not in self.metrics.dropped:
                    log.warning(
                        "model %r: dropped worker %d at version %s: %s", self.model_id, w, version, error.detail
                    )
                    self.metrics.dropped[w] = f"{type(error).__name__}: {error.detail}"
                self.mark_dead(w, error, said=True)
            else:
                kept[w] = error
        if len(self.metrics.dropped) > dropped and not self.ledger.live(sorted(self.ledger.peers)):
            log.warning("model %r: every worker is dropped: sends reach none until one rejoins", self.model_id)
        raise_failures(kept, model_id=self.model_id, version=version)

    # --------------------------------------------------------------- reports
    def stats(self) -> dict[str, Any]:
        return self.metrics.summary(
            version=self.version,
            acked={w: p.acked for w, p in sorted(self.ledger.peers.items())},
            failed={w: f"{type(e).__name__}: {e.detail}" for w, e in self.ledger.dead.items()},
        )

    def close(self, timeout: float) -> None:
        """End the rejoin thread, then the engine (waiting at most ``timeout`` for either; 0: not at all)."""
        if self._admitter is not None:
            self._admitter.stop(timeout)
            self._admitter = None
        if self.engine is not None:
            self.engine.close(timeout)
        self.bound.forget()
        self.changes.close()


def _moot(error: WeightSyncError, expected: int, answered: int | None) -> bool:
    """Whether a failure found earlier says nothing of the version ``expected`` of its worker (the last sent to it):
    a refusal of an older version's changes (:meth:`Changes.moot`: that one went whole), or a time-out that a later
    answer overtook (:meth:`Ledger.overtaken`)."""
    return Ledger.overtaken(error, answered) or Changes.moot(error, expected)
