"""Shared by the schemes whose workers ack each update over their engine (torch.distributed, RPC)."""

from __future__ import annotations

from typing import Any

from ..errors import WeightSyncError, raise_failures
from ..transports.channel import deadline_after
from .base import WeightSyncScheme

__all__ = ["AckedScheme"]


class AckedScheme(WeightSyncScheme):
    """Versions, async failures and bounded waits for schemes that collect per-worker acks.

    Subclasses implement ``send_to(weights, targets, wait=..., timeout=...)`` and
    ``_collect(workers, deadline, expected)``: take in the acks already there
    (``deadline`` None), or wait until each worker acked ``expected[w]``; return
    the failures by worker.
    """

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        self._errors: dict[int, WeightSyncError] = {}  # failures of async sends, reported at the next call
        self._next_version = 0

    def send_to(self, weights: Any, targets: list[int], *, wait: bool, timeout: float | None = None) -> None:
        raise NotImplementedError

    def _collect(
        self, workers: list[int], deadline: float | None, expected: dict[int, int]
    ) -> dict[int, WeightSyncError]:
        raise NotImplementedError

    def _send_impl(self, weights: Any, targets: list[int], wait: bool) -> None:
        self.send_to(weights, targets, wait=wait)

    def _send_initial(self, weights: Any, timeout: float, **kwargs: Any) -> None:
        """The initial weights to every worker; a worker that fails them is recorded as gone, then raised."""
        try:
            self.send_to(weights, sorted(self._transports), wait=True, timeout=timeout, **kwargs)
        except WeightSyncError as exc:
            for w, failure in (getattr(exc, "failures", None) or {exc.worker_idx: exc}).items():
                if w is not None:
                    self._mark_dead(w, failure)
            raise

    def wait_for(self, workers: list[int], timeout: float | None) -> None:
        """Wait until each of ``workers`` acked the last version sent to it (at most ``timeout``)."""
        deadline = deadline_after(self.timeout if timeout is None else timeout)
        expected = {w: self._transports[w].sent for w in workers if self._transports[w].sent is not None}
        failures = {w: self._errors.pop(w) for w in list(self._errors) if w in workers}
        failures.update({w: e for w, e in self._collect(workers, deadline, expected).items() if w not in failures})
        raise_failures(failures, model_id=self._model_id, version=self._version)

    def _wait_impl(self, timeout: float) -> None:
        self.wait_for(sorted(self._transports), timeout)
