"""``max_staleness``: a send that does not wait first bounds how far behind any targeted worker may fall."""

from __future__ import annotations

import time
from typing import Protocol

from ..errors import SyncTimeoutError, WeightSyncError, raise_failures
from ..metrics import SendMetrics
from .ledger import Ledger
from .timing import deadline_after, shown_seconds

__all__ = ["Bounded", "bound_staleness"]


class Bounded(Protocol):
    """What the bound reads and calls of the sender core (:class:`~weightsync.core.sender.Sender`)."""

    version: int | None
    ledger: Ledger
    metrics: SendMetrics
    model_id: str | None

    @property
    def timeout(self) -> float: ...
    def heard(self) -> None: ...
    def late(self, targets: list[int], version: int | None = None) -> dict[int, WeightSyncError]: ...
    def collect(self, expected: dict[int, int], deadline: float) -> dict[int, WeightSyncError]: ...
    def handle_failures(self, exc: WeightSyncError, version: int | None) -> None: ...


def bound_staleness(sender: Bounded, targets: list[int], limit: int) -> float:
    """Wait until no worker of ``targets`` lags more than ``limit`` (``max_staleness``) behind the next version, as
    far as the versions on their way to it can bring it: a worker with none (it said it failed the last one sent
    to it, or the sends since skipped it) has no ack coming, and one late is passed by: neither is waited for.
    Returns the seconds waited; raises, or drops (``on_failure``), the workers that did not catch up in time."""
    upcoming = (sender.version if sender.version is not None else -1) + 1
    expected = {}
    sender.heard()  # (a worker found late just now, as an RPC whose call gave up, is not waited for)
    passed = sender.late(targets)  # (the send names them)
    for w in sender.ledger.live(targets):
        peer = sender.ledger.peers[w]
        lag = upcoming - (peer.acked if peer.acked is not None else -1)
        sender.metrics.max_lag = max(sender.metrics.max_lag, lag - 1)
        if lag > limit and w not in passed and peer.sent is not None and not sender.ledger.has_acked(w, peer.sent):
            expected[w] = min(upcoming - limit, peer.sent)
    if not expected:
        return 0.0
    started = time.perf_counter()
    failures = sender.collect(expected, deadline_after(sender.timeout))
    sender.ledger.answered(failures)
    failures = sender.ledger.keep_answers(failures)  # (the send reports them as it would without a bound)
    waited = time.perf_counter() - started
    sender.metrics.staleness_waits += 1
    if failures:
        late = {
            w: SyncTimeoutError(
                f"lags more than max_staleness={limit} versions and did not catch up within "
                f"{shown_seconds(sender.timeout)} ({e.detail})",
                model_id=sender.model_id,
                worker_idx=w,
                version=upcoming,
            )
            if isinstance(e, SyncTimeoutError)
            else e
            for w, e in failures.items()
        }
        try:
            raise_failures(late, model_id=sender.model_id, version=upcoming)
        except WeightSyncError as exc:
            sender.handle_failures(exc, upcoming)
    return waited
