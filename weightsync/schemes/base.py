"""The scheme lifecycle shared by every backend: :class:`WeightSyncScheme`.

A scheme object plays one role. In the trainer it is a *sender*:
``init_on_sender`` → ``connect`` → ``send``/``send_async``/``wait_async`` →
``shutdown``. In a worker it is a *receiver*: ``init_on_receiver`` →
``connect(worker_idx=...)`` → ``receive`` → ``shutdown``. A sender pickled
after ``init_on_sender`` arrives in the worker as a fresh, receiver-ready
scheme that knows how to reach the sender.

Subclasses implement the ``_*_impl`` hooks; this module owns the state
machine, argument checking, model resolution and the older facade
(``get_sender``, ``WeightSender``, ...).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from .. import options
from ..binding import BoundModel
from ..errors import (
    ConfigurationError,
    InvalidWeightsError,
    LifecycleError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
    raise_failures,
)
from ..layout import FlatLayout
from ..metrics import SendMetrics, SendRecord
from ..model_path import resolve_model
from ..strategy import WeightStrategy, check_spec, flatten_weights, weights_spec
from ..transports.base import TransportBackend
from ..transports.channel import deadline_after

__all__ = ["WeightReceiver", "WeightSender", "WeightSyncScheme"]

log = logging.getLogger("weightsync.schemes")

NEW, SENDER, SENDER_CONNECTED, RECEIVER, RECEIVER_CONNECTED, CLOSED = (
    "new",
    "initialized as sender",
    "connected sender",
    "initialized as receiver",
    "connected receiver",
    "shut down",
)


class WeightSyncScheme:
    """Base class of every scheme: the lifecycle of one model across workers.

    Args:
        strategy: ``"tensordict"`` or ``"state_dict"`` (a :class:`WeightStrategy` is accepted too).
        sync: ``send()`` blocks until every targeted worker applied and acked.
        timeout: seconds any single wait may last (acks, receives, shutdown).
        connect_timeout: seconds the rendez-vous in ``connect()`` may last.
        on_failure: what a send does about a worker that died or did not ack in
            time: ``"raise"`` (default) raises an error naming it; ``"drop"``
            logs a warning naming it, stops sending to it and goes on with the
            others (a restarted worker may rejoin where the scheme supports it).
            A worker that refuses an update (its model does not fit) raises in
            both modes: that is a bug to fix, not a fault to ride out.
        max_staleness: in asynchronous sends, how many versions a worker may lag
            behind the one being published; ``send_async`` first waits (at most
            ``timeout``) for workers further behind. ``None``: no bound.
        check_finite: refuse, in the caller and before any byte moves, weights
            holding NaN or Inf (:class:`~weightsync.errors.InvalidWeightsError`
            naming the tensors). Off by default: it reads every weight once.
    """

    #: Name under which the scheme is registered (see :func:`weightsync.register_backend`).
    backend: ClassVar[str] = ""
    #: Receivers must say which worker they are before connecting.
    needs_worker_idx: ClassVar[bool] = True
    #: The trainer's weights move into one buffer at init (the schemes that take the option set it).
    flatten_sender = False

    def __init__(
        self,
        strategy: str | WeightStrategy = "tensordict",
        sync: bool = True,
        timeout: float = 60.0,
        connect_timeout: float = 120.0,
        on_failure: str = "raise",
        max_staleness: int | None = None,
        check_finite: bool = False,
    ) -> None:
        self._strategy = strategy if isinstance(strategy, WeightStrategy) else WeightStrategy(strategy)
        if on_failure not in ("raise", "drop"):
            raise ConfigurationError(f"on_failure must be 'raise' or 'drop', got {on_failure!r}")
        if max_staleness is not None and (
            isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0
        ):
            raise ConfigurationError(f"max_staleness must be a non-negative int or None, got {max_staleness!r}")
        self.sync = bool(sync)
        self.timeout = options.seconds(timeout, "timeout")
        self.connect_timeout = options.seconds(connect_timeout, "connect_timeout")
        self.on_failure = on_failure
        self.max_staleness = max_staleness
        self.check_finite = bool(check_finite)
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._state = NEW
        self._model_id: str | None = None
        self._context: Any = None
        self._model: Any = None
        self._worker_idx: int | None = None
        self._num_workers: int | None = None
        self._version: int | None = None
        self._lock = threading.RLock()
        self._sender: WeightSender | None = None
        self._receiver: WeightReceiver | None = None
        self._handoff: dict[str, Any] | None = None
        # Sender side: one transport per worker, and the workers found dead (with the error that showed it).
        self._transports: dict[int, Any] = {}
        self._failed: dict[int, WeightSyncError] = {}
        self._errors: dict[int, WeightSyncError] = {}  # failures of async sends, reported at the next call
        self._metrics = SendMetrics()
        # Sender side, after connect: the thread that admits restarted workers (schemes that support rejoin).
        self._admitter: threading.Thread | None = None
        self._admitter_stop = threading.Event()
        # Receiver side: readers holding weights_lock see weights and version change together.
        self._reported_version: int | None = None
        self.weights_lock = threading.RLock()
        #: Sender under ``flatten_sender``: the trainer's weights as views of one storage. Receivers of the
        #: network schemes: their model, once bound (each scheme says how it uses it).
        self._bound = BoundModel()

    # ------------------------------------------------------------------ state
    @property
    def strategy(self) -> WeightStrategy:
        return self._strategy

    @property
    def state(self) -> str:
        return self._state

    @property
    def is_sender(self) -> bool:
        return self._state in (SENDER, SENDER_CONNECTED)

    @property
    def is_receiver(self) -> bool:
        return self._state in (RECEIVER, RECEIVER_CONNECTED)

    def _require(self, *states: str, action: str) -> None:
        if self._state not in states:
            raise LifecycleError(
                f"cannot {action}: scheme is {self._state}; {action} needs it {' or '.join(states)}",
                model_id=self._model_id,
                worker_idx=self._worker_idx,
            )

    # ------------------------------------------------------------- properties
    @property
    def model_id(self) -> str | None:
        return self._model_id

    @property
    def context(self) -> Any:
        return self._context

    @property
    def model(self) -> Any:
        return self._model

    @property
    def worker_idx(self) -> int | None:
        return self._worker_idx

    @property
    def num_workers(self) -> int | None:
        return self._num_workers

    @property
    def version(self) -> int | None:
        """Sender: the last version published. Receiver: the version it holds. ``None`` before any."""
        return self._version

    @property
    def acked_versions(self) -> dict[int, int | None]:
        """Sender only: the last version each worker acked (``None`` if none yet)."""
        return {w: t.acked for w, t in sorted(self._transports.items())}

    @property
    def failed_workers(self) -> dict[int, WeightSyncError]:
        """Sender only: workers found dead, with the error that revealed it."""
        return dict(self._failed)

    def _mark_dead(self, w: int, exc: WeightSyncError) -> WeightSyncError:
        """Record worker ``w`` as gone (once); later sends name it with ``exc``."""
        if w not in self._failed:
            log.warning("model %r: worker %d is gone: %s", self._model_id, w, exc)
            self._failed[w] = exc
            self._transports[w].dead = exc
            self._on_worker_lost(w)
        return self._failed[w]

    def _mark_named_dead(self, exc: WeightSyncError) -> None:
        """Record every worker ``exc`` names as gone: one that failed the initial weights gave up on its side,
        and later sends name it with this cause."""
        for w, failure in _by_worker(exc).items():
            self._mark_dead(w, failure)

    # ----------------------------------------------------------------- rejoin
    def _start_admitter(self, poll: Any, admit: Any, discard: Any = None) -> None:
        """Admit restarted workers from a thread of their own, once the rendez-vous is over.

        ``poll()`` waits a little (about 0.1 s) for a worker asking to rejoin and returns it, or ``None``;
        it raises ``EOFError`` when there is nothing more to wait on. ``admit(candidate)`` runs under the
        scheme's lock, so never during a send; ``discard(candidate)`` turns it away at shutdown.
        """

        def locked() -> bool:
            # The trainer may hold the lock for a whole send, or be shutting down (and joining this thread).
            while not self._lock.acquire(timeout=0.1):
                if self._admitter_stop.is_set():
                    return False
            if self._admitter_stop.is_set():
                self._lock.release()
                return False
            return True

        def loop() -> None:
            while not self._admitter_stop.is_set():
                try:
                    candidate = poll()
                except EOFError:
                    return
                if candidate is None:
                    continue
                if not locked():
                    if discard is not None:
                        discard(candidate)
                    return
                try:
                    admit(candidate)
                finally:
                    self._lock.release()

        self._admitter_stop.clear()
        self._admitter = threading.Thread(target=loop, name=f"weightsync-{self._model_id}-admitter", daemon=True)
        self._admitter.start()

    def _end_thread(self, thread: threading.Thread | None, stop: threading.Event, what: str) -> None:
        """Ask a helper thread to stop and wait for it, at most ``timeout`` (logged if it did not stop)."""
        if thread is None:
            return
        stop.set()
        thread.join(self.timeout)
        if thread.is_alive():
            log.error("model %r: the %s thread did not stop within %.1fs", self._model_id, what, self.timeout)

    def _stop_admitter(self) -> None:
        """End the admitter thread (it gives up the scheme's lock within 0.1 s)."""
        self._end_thread(self._admitter, self._admitter_stop, "rejoin")
        self._admitter = None

    def _rejoined(self, w: int, version: int | None) -> None:
        """Worker ``w`` is back, and was sent ``version``: it counts as live again."""
        self._failed.pop(w, None)
        self._errors.pop(w, None)
        self._metrics.dropped.pop(w, None)
        self._metrics.rejoins[w] = self._metrics.rejoins.get(w, 0) + 1
        log.info("model %r: worker %d rejoined and was sent version %s", self._model_id, w, version)

    def _has_acked(self, w: int, version: int) -> bool:
        """Worker ``w`` acked ``version`` or a later one."""
        acked = self._transports[w].acked
        return acked is not None and acked >= version

    def _missing_acks(self, expected: dict[int, int], failures: dict[int, WeightSyncError]) -> list[int]:
        """Live workers of ``expected`` (none of ``failures``) that have not acked their version yet."""
        return [
            w for w, v in expected.items() if w not in failures and w not in self._failed and not self._has_acked(w, v)
        ]

    def _gone_before_acking(
        self, expected: dict[int, int], failures: dict[int, WeightSyncError]
    ) -> dict[int, WeightSyncError]:
        """Workers of ``expected`` recorded as gone without acking their version (one that acked, then left,
        did its part), with the error that named them."""
        return {
            w: self._failed[w]
            for w, v in expected.items()
            if w in self._failed and w not in failures and not self._has_acked(w, v)
        }

    def _ack_timeouts(
        self, workers: list[int], expected: dict[int, int], within: str = "the timeout"
    ) -> dict[int, WeightSyncError]:
        """A :class:`SyncTimeoutError` for each of ``workers`` still without its ack of ``expected``."""
        return {
            w: SyncTimeoutError(
                f"no ack for version {expected[w]} within {within} (last acked: {self._transports[w].acked})",
                model_id=self._model_id,
                worker_idx=w,
                version=expected[w],
            )
            for w in workers
            if not self._has_acked(w, expected[w])
        }

    def _on_worker_lost(self, w: int) -> None:
        """Hook: release what a dead worker held."""

    @property
    def weights(self) -> Any:
        """The weights of the registered model, in the strategy's format (no copy)."""
        if self._model is None:
            return None
        return self._strategy.extract_weights(self._model)

    @property
    def sender_transports(self) -> dict[int, TransportBackend]:
        return dict(self._transports)

    @property
    def receiver_transport(self) -> TransportBackend | None:
        return None

    @property
    def shared_transport(self) -> Any:
        return None

    # -------------------------------------------------------------- lifecycle
    def init_on_sender(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        """Register the trainer side: the model (or weights) and the workers. Sends nothing.

        Args:
            model_id: the model's name, also a path inside ``context``
                (``"policy"``, ``"env.transform[0].module"``).
            context: an object that holds the model (``get_model(model_id)`` or by
                path) and may provide ``num_workers``.
            **kwargs: ``model=`` or ``weights=``, ``num_workers=``, and scheme-specific handles.

        Raises:
            LifecycleError: the scheme was already initialized.
            ConfigurationError: a required argument is missing or invalid.
        """
        with self._lock:
            self._require(NEW, action="init_on_sender")
            if self._handoff is not None:
                raise LifecycleError(
                    "this scheme was unpickled from a sender: it can only be initialized as a receiver",
                    model_id=model_id,
                )
            self._model_id = options.model_id(model_id, "model_id")
            self._context = context
            model = kwargs.pop("model", None)
            weights = kwargs.pop("weights", None)
            if model is None and weights is None and context is not None:
                model = resolve_model(context, model_id)
            self._model = model if model is not None else weights
            num_workers = kwargs.pop("num_workers", None)
            if num_workers is None and context is not None:
                num_workers = getattr(context, "num_workers", None)
            self._num_workers = self._check_num_workers(num_workers)
            self._init_sender_impl(**kwargs)
            self._state = SENDER

    def _check_num_workers(self, num_workers: Any) -> int | None:
        if num_workers is None:
            return None
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ConfigurationError(
                f"num_workers must be a positive int, got {num_workers!r}", model_id=self._model_id
            )
        return num_workers

    def init_on_receiver(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Register the worker side: its model and index. Receives nothing yet.

        Args:
            model_id: the model's name or path inside ``context`` (default: the one
                the scheme was handed with, else ``"policy"``).
            context: an object holding the worker's model.
            **kwargs: ``model=``, ``worker_idx=`` and scheme-specific handles.

        Raises:
            LifecycleError: the scheme was already initialized (for example as a sender).
        """
        with self._lock:
            self._require(NEW, action="init_on_receiver")
            model_id = model_id or self._model_id or "policy"
            self._model_id = model_id
            self._context = context
            model = kwargs.pop("model", None)
            if model is None and context is not None:
                model = resolve_model(context, model_id)
            self._model = model
            worker_idx = kwargs.pop("worker_idx", None)
            if worker_idx is not None:
                self._worker_idx = self._same_worker(worker_idx)
            self._init_receiver_impl(**kwargs)
            self._state = RECEIVER

    def init_on_worker(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Older name of :meth:`init_on_receiver`."""
        self.init_on_receiver(model_id, context, **kwargs)

    def _check_worker_idx(self, worker_idx: Any) -> int:
        if isinstance(worker_idx, bool) or not isinstance(worker_idx, int) or worker_idx < 0:
            raise ConfigurationError(
                f"worker_idx must be a non-negative int, got {worker_idx!r}", model_id=self._model_id
            )
        if self._num_workers is not None and worker_idx >= self._num_workers:
            raise ConfigurationError(
                f"worker_idx {worker_idx} out of range for {self._num_workers} workers", model_id=self._model_id
            )
        return worker_idx

    def _same_worker(self, worker_idx: Any) -> int:
        """``worker_idx``, checked, and the index a receiver config made this receiver for, if any."""
        idx = self._check_worker_idx(worker_idx)
        if self._handoff is not None and self._worker_idx is not None and idx != self._worker_idx:
            raise ConfigurationError(
                f"this receiver was made for worker {self._worker_idx} (its receiver config says so), "
                f"not worker {idx}: give each worker its own receiver config",
                model_id=self._model_id,
                worker_idx=idx,
            )
        return idx

    def connect(self, *, worker_idx: int | None = None, weights: Any = None) -> None:
        """Rendez-vous. Sender: wait for every worker and give each the initial weights
        (``weights`` overrides the registered model's). Receiver: join the sender,
        receive and apply the initial weights. Blocks for at most ``connect_timeout``.

        Raises:
            LifecycleError: called before init, or twice.
            SyncTimeoutError: a peer did not show up in time (named in the message).
        """
        with self._lock:
            if self._state == SENDER:
                if worker_idx is not None:
                    raise LifecycleError("connect(worker_idx=...) is the receiver's call; this scheme is a sender")
                try:
                    self._connect_sender_impl(weights)
                except WeightSyncError:
                    # Workers that failed the initial sync are named in the error; once every
                    # worker has joined, the others are served and the sender is connected.
                    if self._rendezvous_complete():
                        self._state = SENDER_CONNECTED
                    raise
                self._state = SENDER_CONNECTED
            elif self._state == RECEIVER:
                if worker_idx is not None:
                    self._worker_idx = self._same_worker(worker_idx)
                if self._worker_idx is None and self.needs_worker_idx:
                    raise ConfigurationError("a receiver needs worker_idx (in init_on_receiver or connect)")
                self._connect_receiver_impl()
                self._state = RECEIVER_CONNECTED
            else:
                self._require(SENDER, RECEIVER, action="connect")

    def setup_connection_and_weights(self, **kwargs: Any) -> None:
        """Older name of :meth:`connect`."""
        self.connect(**kwargs)

    def synchronize_weights(self, **kwargs: Any) -> None:
        """Older name of :meth:`connect`."""
        self.connect(**kwargs)

    def _targets(self, worker_ids: int | Iterable[int] | None) -> list[int]:
        n = self._num_workers or 0
        if worker_ids is None:
            return list(range(n))
        ids = [worker_ids] if isinstance(worker_ids, int) and not isinstance(worker_ids, bool) else worker_ids
        try:
            ids = list(ids)
        except TypeError:
            raise ConfigurationError(f"worker_ids must be None, an int or a list of ints, got {worker_ids!r}") from None
        bad = [w for w in ids if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < n]
        if bad:
            raise ConfigurationError(
                f"worker_ids {bad} are not workers of this scheme (valid: 0..{n - 1})", model_id=self._model_id
            )
        if len(set(ids)) != len(ids):
            raise ConfigurationError(f"worker_ids has duplicates: {ids}", model_id=self._model_id)
        return sorted(ids)

    def send(self, weights: Any = None, worker_ids: int | Iterable[int] | None = None) -> None:
        """Publish a new version to ``worker_ids`` (all by default).

        ``weights`` may be ``None`` (read the registered model now), an
        ``nn.Module``, a ``TensorDict`` or a dict. With ``sync=True`` this blocks
        until every targeted worker applied and acked (at most ``timeout`` s);
        with ``sync=False`` it returns once the update is published.

        Raises:
            LifecycleError: the scheme is not a connected sender.
            InvalidWeightsError: weights that cannot be sent (nothing was sent).
            WeightSyncError: a worker failed, died or timed out; the message names it.
                The other targeted workers hold the new version.
        """
        with self._lock:
            self._require(SENDER_CONNECTED, action="send")
            self._publish(weights, self._targets(worker_ids), wait=self.sync)

    def send_async(self, weights: Any = None, worker_ids: int | Iterable[int] | None = None) -> None:
        """Publish a new version without waiting; pair with :meth:`wait_async`.

        With ``max_staleness=k``, first waits (at most ``timeout``) until every targeted
        worker acked at least the version ``k`` behind the one about to be published.
        """
        with self._lock:
            self._require(SENDER_CONNECTED, action="send_async")
            self._publish(weights, self._targets(worker_ids), wait=False)

    def wait_async(self, timeout: float | None = None) -> None:
        """Wait until every worker acked the last version sent to it (at most ``timeout``, default the scheme's).

        Raises:
            SyncTimeoutError: naming the workers that did not ack in time (with ``on_failure="drop"``,
                they are dropped instead).
        """
        with self._lock:
            self._require(SENDER_CONNECTED, action="wait_async")
            try:
                self._wait_impl(self.timeout if timeout is None else timeout)
            except WeightSyncError as exc:
                self._handle_failures(exc, self._version)

    def _publish(self, weights: Any, targets: list[int], wait: bool) -> None:
        """One send under the failure policy, measured: bound staleness, publish, then raise or drop."""
        started = time.perf_counter()
        if self.check_finite:
            self._refuse_non_finite(weights)
        stale_wait = 0.0
        if not wait and self.max_staleness is not None:
            stale_wait = self._bound_staleness(targets)
        before = self._version
        failure: WeightSyncError | None = None
        try:
            self._send_impl(weights, targets, wait)
        except WeightSyncError as exc:
            if self._version == before:  # nothing was published (bad weights, no free slot): always raised
                raise
            failure = exc
        failures = _by_worker(failure) if failure is not None else {}
        record = SendRecord(
            version=self._version,
            workers=list(targets),
            nbytes=self._payload_bytes(),
            seconds=time.perf_counter() - started,
            acks={
                w: round(self._transports[w].acked_at - started, 6)
                for w in targets
                if w in self._transports
                and w not in failures
                and self._has_acked(w, self._version)
                and self._transports[w].acked_at >= started
            },
            failed={w: f"{type(e).__name__}: {e.detail}" for w, e in failures.items()},
            staleness_wait=stale_wait,
        )
        self._metrics.add(record)
        log.debug("model %r: send %s", self._model_id, record)
        if failure is not None:
            self._handle_failures(failure, self._version)

    def _refuse_non_finite(self, weights: Any) -> None:
        flat = self._flat_weights(weights)
        bad = sorted(
            key for key, t in flat.items() if t.is_floating_point() and not bool(torch.isfinite(t.detach()).all())
        )
        if bad:
            raise InvalidWeightsError(
                f"weights hold NaN or Inf in {bad} (check_finite=True); nothing was sent", model_id=self._model_id
            )

    def _handle_failures(self, exc: WeightSyncError, version: int | None) -> None:
        """Raise ``exc`` (``on_failure="raise"``), or drop the workers it names as dead or late and raise
        only what is left (a worker that refused the update, an error that names no worker)."""
        failures = _by_worker(exc)
        if self.on_failure == "raise" or not failures:
            raise exc
        kept = {}
        for w, error in failures.items():
            if isinstance(error, (TransportError, SyncTimeoutError)):
                if w not in self._metrics.dropped:
                    log.warning(
                        "model %r: dropped worker %d at version %s: %s", self._model_id, w, version, error.detail
                    )
                    self._metrics.dropped[w] = f"{type(error).__name__}: {error.detail}"
                self._mark_dead(w, error)
            else:
                kept[w] = error
        raise_failures(kept, model_id=self._model_id, version=version)

    def _bound_staleness(self, targets: list[int]) -> float:
        """Wait until no targeted worker lags more than ``max_staleness`` behind the next version."""
        assert self.max_staleness is not None
        upcoming = (self._version if self._version is not None else -1) + 1
        expected = {}
        for w in targets:
            if w in self._failed or w not in self._transports:
                continue
            acked = self._transports[w].acked
            lag = upcoming - (acked if acked is not None else -1)
            self._metrics.max_lag = max(self._metrics.max_lag, lag - 1)
            if lag > self.max_staleness:
                expected[w] = upcoming - self.max_staleness
        if not expected:
            return 0.0
        started = time.perf_counter()
        failures = self._await_acks(expected, deadline_after(self.timeout))
        waited = time.perf_counter() - started
        self._metrics.staleness_waits += 1
        if failures:
            late = {
                w: SyncTimeoutError(
                    f"lags more than max_staleness={self.max_staleness} versions and did not catch up within "
                    f"{self.timeout:.1f}s ({e.detail})",
                    model_id=self._model_id,
                    worker_idx=w,
                    version=upcoming,
                )
                if isinstance(e, SyncTimeoutError)
                else e
                for w, e in failures.items()
            }
            try:
                raise_failures(late, model_id=self._model_id, version=upcoming)
            except WeightSyncError as exc:
                self._handle_failures(exc, upcoming)
        return waited

    def _await_acks(self, expected: dict[int, int], deadline: float) -> dict[int, WeightSyncError]:
        """Wait until each worker of ``expected`` acked at least its version; return the failures."""
        raise NotImplementedError

    def _payload_bytes(self) -> int:
        layout = getattr(self, "layout", None)
        return int(layout.nbytes) if layout is not None else 0

    @property
    def last_send(self) -> SendRecord | None:
        """Sender: what the last send did (version, workers, bytes, seconds, per-worker ack times, failures)."""
        return self._metrics.last

    def stats(self) -> dict[str, Any]:
        """Sender: a summary of every send so far: counts, bytes, send-time and ack-time medians and
        maxima, failures, dropped workers (with the cause), rejoins, staleness, and each worker's
        last acked version and lag."""
        with self._lock:  # a rejoin may be admitted from the listener's thread meanwhile
            acked = self.acked_versions if self.is_sender else {}
            return self._metrics.summary(
                version=self._version,
                acked=acked,
                failed={w: f"{type(e).__name__}: {e.detail}" for w, e in self._failed.items()},
            )

    def receive(self, timeout: float | None = 0.0) -> Any:
        """Apply a pending update, if any; return the weights applied, or ``None``.

        Args:
            timeout: seconds to wait for an update: ``0`` (default) only checks,
                ``None`` waits up to the scheme's ``timeout``.

        Raises:
            LifecycleError: the scheme is not a connected receiver.
            WeightMismatchError: the update did not fit this worker's model; the
                model kept its weights and the sender was told.
            ConnectionClosedError: the sender shut down or died.
        """
        self._require(RECEIVER_CONNECTED, action="receive")
        return self._receive_impl(self.timeout if timeout is None else timeout)

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        """Write ``weights`` into this side's registered model, whole or not at all."""
        if not inplace:
            raise ConfigurationError(
                "apply_weights(inplace=False) is not supported: weights are always written in place"
            )
        if self._model is None:
            raise LifecycleError("apply_weights needs a registered model (init_on_sender/init_on_receiver)")
        self._strategy.apply_weights(self._model, weights, model_id=self._model_id, worker_idx=self._worker_idx)

    def shutdown(self) -> None:
        """Release every process, thread, socket and shared-memory slot this side holds. Idempotent."""
        with self._lock:
            if self._state in (NEW, CLOSED):
                self._state = CLOSED
                return
            try:
                self._shutdown_impl()
            finally:
                self._state = CLOSED

    def __enter__(self) -> WeightSyncScheme:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            if self._state not in (NEW, CLOSED):
                self.shutdown()
        except Exception:  # noqa: BLE001 - nothing may escape a finalizer
            pass

    # ---------------------------------------------------------------- weights
    def prepare_weights(
        self, weights: Any, model_id: str | None = None, strategy: WeightStrategy | None = None, context: Any = None
    ) -> Any:
        """Resolve ``weights`` to the strategy's format (no copy).

        ``None`` reads the model registered for ``model_id`` (or found in
        ``context``); a module, TensorDict or dict is converted.

        Raises:
            InvalidWeightsError: nothing to send, or non-tensor values.
        """
        strategy = strategy or self._strategy
        return strategy.format(self._flat_weights(weights, model_id, context, strategy))

    def _flat_weights(
        self,
        weights: Any,
        model_id: str | None = None,
        context: Any = None,
        strategy: WeightStrategy | None = None,
        *,
        detach: bool = True,
    ) -> dict:
        """``{dotted_key: tensor}`` of ``weights`` (``None``: the registered model). ``detach=False`` keeps the
        source's own tensors, for callers that only copy them out under ``no_grad`` (no per-tensor alias)."""
        strategy = strategy or self._strategy
        if weights is None:
            context = context if context is not None else self._context
            model_id = model_id or self._model_id
            if self._model is not None and (model_id == self._model_id):
                weights = self._model
            elif context is not None and model_id is not None:
                weights = resolve_model(context, model_id)
            if weights is None:
                raise InvalidWeightsError(
                    "no weights given and no model registered to read them from", model_id=model_id
                )
        if isinstance(weights, str):
            if context is None and self._context is None:
                raise InvalidWeightsError(f"weights given as path {weights!r} but no context to resolve it")
            weights = resolve_model(context if context is not None else self._context, weights)
        return strategy.flat(weights) if detach else flatten_weights(weights, strategy.extract_as)

    def _adopt_sender_model(self, layout: FlatLayout) -> None:
        """Sender, at init: ``flatten_sender`` moves the registered model into one buffer laid out by ``layout``."""
        if self.flatten_sender:
            self._bound.adopt(flatten_weights(self._model, self._strategy.extract_as), layout, self._model_id)

    def _sender_weights(self, weights: Any, layout: FlatLayout) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """Sender: ``weights`` (``None``: the registered model) as the source's own tensors, checked against
        ``layout`` (for a caller that copies them out under ``no_grad``); and, under ``flatten_sender``, the
        bytes of the one storage they view, every tensor in its place (``None``: copy them tensor by tensor).

        Raises:
            WeightMismatchError: the weights do not match ``layout``.
        """
        flat = self._flat_weights(weights, detach=False)
        held = self.flatten_sender and self._bound.holds(flat)  # exactly as bound: keys, shapes and dtypes hold
        if not held:
            check_spec(weights_spec(flat), layout.spec, model_id=self._model_id)
        if not self.flatten_sender:
            return flat, None
        return flat, self._bound.published(flat, layout, held, weights is None, self._model_id)

    # ------------------------------------------------------------ the facade
    def get_sender(self) -> WeightSender:
        """The sender facade. Raises :class:`LifecycleError` before ``init_on_sender``."""
        if not self.is_sender:
            raise LifecycleError(f"get_sender() needs init_on_sender() first; scheme is {self._state}")
        if self._sender is None:
            self._sender = WeightSender(self)
        return self._sender

    def get_receiver(self) -> WeightReceiver:
        """The receiver facade. Raises :class:`LifecycleError` before ``init_on_receiver``."""
        if not self.is_receiver:
            raise LifecycleError(f"get_receiver() needs init_on_receiver() first; scheme is {self._state}")
        if self._receiver is None:
            self._receiver = WeightReceiver(self)
        return self._receiver

    def create_sender(self) -> WeightSender:
        """A sender facade bound to this scheme (usable once ``init_on_sender`` ran)."""
        return WeightSender(self)

    def create_receiver(self) -> WeightReceiver:
        """A receiver facade bound to this scheme (usable once ``init_on_receiver`` ran)."""
        return WeightReceiver(self)

    def create_transport(self, **kwargs: Any) -> TransportBackend:
        """Build the transport for one peer; see each scheme for its arguments."""
        raise ConfigurationError(f"{type(self).__name__} has no transport to create")

    # ------------------------------------------------------- receiver configs
    def receiver_config(self, worker_idx: int) -> dict[str, Any]:
        """Plain data (YAML-able, no live objects, no secrets) from which worker ``worker_idx`` builds its side.

        In the worker: ``scheme = weightsync.config.from_config(cfg)`` (or
        ``hydra.utils.instantiate``), then ``scheme.init_on_receiver(model=...)``
        and ``scheme.connect()``. Works in any process of this host, also one
        started by hand.

        Raises:
            LifecycleError: called before ``init_on_sender``.
        """
        self._require(SENDER, SENDER_CONNECTED, action="receiver_config")
        idx = self._check_worker_idx(worker_idx)
        cls = type(self)
        scheme = {"_target_": f"{cls.__module__}.{cls.__qualname__}", "strategy": self._strategy.extract_as}
        scheme.update({name: getattr(self, name) for name in sorted(self._config_fields())})
        return {
            "_target_": "weightsync.config.make_receiver",
            "scheme": scheme,
            "model_id": self._model_id,
            "worker_idx": idx,
            "connection": self._receiver_connection(),
        }

    def _receiver_connection(self) -> dict[str, Any]:
        return {}

    @classmethod
    def check_receiver_connection(cls, connection: Mapping[str, Any], model_id: str) -> dict[str, Any]:
        """The ``connection`` of a receiver config for this class, checked as data: nothing is read or reached.

        Each scheme checks exactly what its ``receiver_config()`` emits there (by default, nothing). A
        third-party scheme that emits a connection overrides this.

        Raises:
            ConfigurationError: a field that is not this scheme's, a missing one, or one of the wrong shape.
        """
        return options.fields(connection, {}, "connection")

    @classmethod
    def receiver_unpickles(cls, connection: Mapping[str, Any]) -> str | None:
        """The peer whose messages a receiver built from ``connection`` would unpickle (``None``: none).

        :func:`weightsync.config.from_config` builds such a receiver only with the caller's ``allow_pickle``.
        """
        return None

    def _prepare_receiver(self, *, model_id: str, worker_idx: int, connection: dict[str, Any]) -> None:
        """Make a new scheme receiver-ready from a receiver config's fields."""
        self._require(NEW, action="prepare a receiver")
        self._model_id = model_id
        self._worker_idx = self._check_worker_idx(worker_idx)
        self._handoff = dict(connection)

    # ----------------------------------------------------------------- pickle
    def __getstate__(self) -> dict[str, Any]:
        """Configuration plus, for a sender, what a worker needs to reach it; never runtime state."""
        state = {k: v for k, v in self.__dict__.items() if k in self._config_fields()}
        state["_strategy"] = self._strategy.extract_as
        if self.is_sender or self._state == SENDER_CONNECTED:
            state["_handoff"] = self._receiver_handoff()
            state["_model_id"] = self._model_id
            state["_num_workers"] = self._num_workers
        elif self._handoff is not None:
            state["_handoff"] = self._handoff
            state["_model_id"] = self._model_id
            state["_num_workers"] = self._num_workers
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        strategy = WeightStrategy(state.pop("_strategy"))
        handoff = state.pop("_handoff", None)
        model_id = state.pop("_model_id", None)
        num_workers = state.pop("_num_workers", None)
        self.__dict__.update(state)
        self._strategy = strategy
        self._reset_runtime()
        self._handoff = handoff
        self._model_id = model_id
        self._num_workers = num_workers

    def _config_fields(self) -> set[str]:
        return {"sync", "timeout", "connect_timeout", "on_failure", "max_staleness", "check_finite"}

    def __copy__(self) -> WeightSyncScheme:
        raise LifecycleError("schemes are not copied; build a new one from the same arguments")

    def __deepcopy__(self, memo: dict) -> WeightSyncScheme:
        if self._state != NEW:
            raise LifecycleError("only a new (uninitialized) scheme can be deep-copied")
        clone = type(self).__new__(type(self))
        clone.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return clone

    # ------------------------------------------------------------------ hooks
    def _receiver_handoff(self) -> dict[str, Any]:
        return {}

    def _sender_layout(self, wire_dtype: torch.dtype | None = None) -> FlatLayout:
        """The flat layout of the registered model's weights (sender side, at init)."""
        if self._model is None:
            raise ConfigurationError(
                "init_on_sender needs model= or weights= (or a context holding the model)", model_id=self._model_id
            )
        flat = self._strategy.flat(self._model)
        if not flat:
            raise ConfigurationError("the model has no weights to synchronize", model_id=self._model_id)
        return FlatLayout.from_weights(flat, wire_dtype)

    def _newly_applied(self) -> Any:
        """Receiver: the weights if a version was applied since the last report (now reported), else ``None``."""
        with self.weights_lock:
            if self._version is None or self._version == self._reported_version:
                return None
            self._reported_version = self._version
            return self._strategy.extract_weights(self._model)

    def _rendezvous_complete(self) -> bool:
        """True once every worker has joined, even if some failed their initial sync."""
        return False

    def _init_sender_impl(self, **kwargs: Any) -> None:
        _no_extra(kwargs, "init_on_sender")

    def _init_receiver_impl(self, **kwargs: Any) -> None:
        _no_extra(kwargs, "init_on_receiver")

    def _connect_sender_impl(self, weights: Any) -> None:
        raise NotImplementedError

    def _connect_receiver_impl(self) -> None:
        raise NotImplementedError

    def _send_impl(self, weights: Any, targets: list[int], wait: bool) -> None:
        raise NotImplementedError

    def _wait_impl(self, timeout: float) -> None:
        raise NotImplementedError

    def _receive_impl(self, timeout: float) -> Any:
        raise NotImplementedError

    def _shutdown_impl(self) -> None:
        pass

    # --------------------------------------------------------------- registry
    @classmethod
    def from_backend(cls, name: str, **kwargs: Any) -> WeightSyncScheme:
        """Build the scheme registered under ``name`` (``"multiprocess"``, ``"shared_mem"``, ...)."""
        from .registry import get_backend

        return get_backend(name)(**kwargs)


def _by_worker(exc: WeightSyncError) -> dict[int, WeightSyncError]:
    """The per-worker failures an error stands for (none if it names no worker)."""
    failures = getattr(exc, "failures", None)
    if failures:
        return dict(failures)
    return {} if exc.worker_idx is None else {exc.worker_idx: exc}


def _no_extra(kwargs: dict[str, Any], where: str) -> None:
    if kwargs:
        raise ConfigurationError(f"{where} got unexpected arguments: {sorted(kwargs)}")


class WeightSender:
    """Older facade over a sender scheme: ``send``, ``send_async``, ``wait_async``, ``update_weights``."""

    def __init__(self, scheme: WeightSyncScheme) -> None:
        self._scheme = scheme

    @property
    def scheme(self) -> WeightSyncScheme:
        return self._scheme

    def send(self, weights: Any = None, worker_ids: int | Iterable[int] | None = None) -> None:
        self._scheme.send(weights, worker_ids)

    def send_async(self, weights: Any = None, worker_ids: int | Iterable[int] | None = None) -> None:
        self._scheme.send_async(weights, worker_ids)

    def wait_async(self, timeout: float | None = None) -> None:
        self._scheme.wait_async(timeout)

    def update_weights(self, weights: Any = None, worker_ids: int | Iterable[int] | None = None) -> None:
        """Send and wait for every targeted worker, whatever the scheme's ``sync``."""
        self._scheme.send_async(weights, worker_ids)
        self._scheme.wait_async()


class WeightReceiver:
    """Older facade over a receiver scheme: ``receive(timeout) -> bool`` and ``apply_weights``."""

    def __init__(self, scheme: WeightSyncScheme) -> None:
        self._scheme = scheme

    @property
    def scheme(self) -> WeightSyncScheme:
        return self._scheme

    def receive(self, timeout: float | None = 0.0) -> bool:
        """Apply a pending update; ``True`` if one was applied."""
        return self._scheme.receive(timeout) is not None

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        self._scheme.apply_weights(weights, inplace)

    @property
    def weights(self) -> Any:
        return self._scheme.weights
