"""What each send did, for the caller (``scheme.last_send``, ``scheme.stats()``) and the debug log."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SendMetrics", "SendRecord"]

#: How many recent sends the medians and maxima of :meth:`SendMetrics.summary` cover.
WINDOW = 1000


@dataclass(frozen=True)
class SendRecord:
    """One ``send``/``send_async`` on the sender.

    Attributes:
        version: the version published.
        workers: the workers it targeted.
        nbytes: bytes of one copy of the payload (the wire dtype's, when one is set).
        seconds: how long the call took, waiting for acks included when it waited.
        acks: seconds from the start of the call to each worker's ack, for the workers
            whose ack arrived during the call.
        failed: workers that failed in this send, with the error's type and message.
        staleness_wait: seconds spent first waiting for workers that lagged more than
            ``max_staleness`` versions.
        changes: the workers sent only what changed (the scheme's ``delta``), with the bytes that took.
    """

    version: int | None
    workers: list[int]
    nbytes: int
    seconds: float
    acks: dict[int, float] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    staleness_wait: float = 0.0
    changes: dict[int, int] = field(default_factory=dict)

    def __str__(self) -> str:
        acks = ", ".join(f"{w}: {s * 1e3:.2f} ms" for w, s in sorted(self.acks.items()))
        text = (
            f"version {self.version} to workers {self.workers}: {self.nbytes} bytes in {self.seconds * 1e3:.2f} ms"
            f" (acks {{{acks}}})"
        )
        if self.staleness_wait:
            text += f", {self.staleness_wait * 1e3:.2f} ms waiting for lagging workers"
        if self.changes:
            text += f", only what changed to workers {sorted(self.changes)} ({max(self.changes.values())} bytes)"
        if self.failed:
            text += f", failed: {self.failed}"
        return text


class SendMetrics:
    """Counters over every send, and the last :data:`WINDOW` records for medians and maxima."""

    def __init__(self) -> None:
        self.sends = 0
        self.bytes = 0
        self.failures = 0
        self.records: deque[SendRecord] = deque(maxlen=WINDOW)
        self.dropped: dict[int, str] = {}  # worker -> the cause it was dropped for
        self.rejoins: dict[int, int] = {}  # worker -> how many times it rejoined
        self.max_lag = 0
        self.staleness_waits = 0
        self.changes_sent = 0  # updates of one worker sent as what changed

    @property
    def last(self) -> SendRecord | None:
        return self.records[-1] if self.records else None

    def add(self, record: SendRecord) -> None:
        self.sends += 1
        self.bytes += sum(record.changes.get(w, record.nbytes) for w in record.workers if w not in record.failed)
        self.changes_sent += sum(1 for w in record.changes if w not in record.failed)
        self.failures += len(record.failed)
        self.records.append(record)

    def summary(self, *, version: int | None, acked: dict[int, int | None], failed: dict[int, str]) -> dict[str, Any]:
        seconds = [r.seconds for r in self.records]
        acks = [s for r in self.records for s in r.acks.values()]
        return {
            "sends": self.sends,
            "version": version,
            "bytes_sent": self.bytes,
            "send_seconds": _spread(seconds),
            "ack_seconds": _spread(acks),
            "worker_failures": self.failures,
            "failed_workers": dict(failed),
            "dropped_workers": dict(self.dropped),
            "rejoins": dict(self.rejoins),
            "acked_versions": dict(acked),
            "lag": {w: None if a is None or version is None else version - a for w, a in acked.items()},
            "max_lag_seen": self.max_lag,
            "staleness_waits": self.staleness_waits,
            "changes_sent": self.changes_sent,
        }


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "max": None}
    return {"median": statistics.median(values), "max": max(values)}
