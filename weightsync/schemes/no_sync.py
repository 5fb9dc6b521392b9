"""``NoWeightSyncScheme``: the scheme for models that must not be synchronized."""

from __future__ import annotations

import threading
from typing import Any

from .base import WeightSyncScheme

__all__ = ["NoWeightSyncScheme"]


class NoWeightSyncScheme(WeightSyncScheme):
    """Every lifecycle call succeeds and nothing moves.

    Useful to switch synchronization off for one model with a config override
    while keeping the trainer's code unchanged. Versions still count, so code
    that reads ``scheme.version`` keeps working. ``receive(timeout)`` returns
    ``None`` after waiting ``timeout`` seconds, as another scheme would when no
    update comes, so a worker loop that blocks on it does not spin; ``shutdown()``
    ends the wait early.
    """

    backend = "no_sync"
    needs_worker_idx = False

    def _init_sender_impl(self, **kwargs: Any) -> None:
        pass  # handles meant for other schemes (pipes=, actors=, ...) are accepted and ignored

    def _init_receiver_impl(self, **kwargs: Any) -> None:
        pass

    def _connect_sender_impl(self, weights: Any) -> None:
        self._version = 0

    def _connect_receiver_impl(self) -> None:
        pass

    def _send_impl(self, weights: Any, targets: list[int], wait: bool) -> None:
        self._version = (self._version or 0) + 1

    def _wait_impl(self, timeout: float) -> None:
        pass

    def _receive_impl(self, timeout: float) -> Any:
        self._closing.wait(timeout)
        return None

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        self._closing = threading.Event()

    def _shutdown_impl(self) -> None:
        self._closing.set()

    def _targets(self, worker_ids: Any) -> list[int]:
        return [] if worker_ids is None else ([worker_ids] if isinstance(worker_ids, int) else list(worker_ids))
