"""``NoWeightSyncScheme``: the scheme for models that must not be synchronized."""

from __future__ import annotations

import threading
from typing import Any

from .. import checks
from ..core.scheme import WeightSyncScheme
from ..core.states import RECEIVER_CONNECTED
from ..errors import ConfigurationError
from ..tensors.strategy import check_finite, check_sent, weights_spec

__all__ = ["NoWeightSyncScheme"]


class NoWeightSyncScheme(WeightSyncScheme, name="no_sync", aliases=("none",), config="NoSyncSchemeConfig"):
    """Every lifecycle call succeeds and nothing moves.

    Useful to switch synchronization off for one model with a config override
    while keeping the trainer's code unchanged. Versions still count, so code
    that reads ``scheme.version`` keeps working. ``receive(timeout)`` returns
    ``None`` after waiting ``timeout`` seconds, as another scheme would when no
    update comes, so a worker loop that blocks on it does not spin; ``shutdown()``
    ends the wait early.
    """

    needs_worker_idx = False

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        self._closing = threading.Event()
        self._count: int | None = None

    @property
    def version(self) -> int | None:
        return self._count

    def _open_sender(self, kwargs: dict[str, Any]) -> None:
        pass  # handles meant for other schemes (pipes=, actors=, ...) are accepted and ignored

    def _open_receiver(self, kwargs: dict[str, Any]) -> None:
        pass

    def _connect_sender(self, weights: Any) -> None:
        self._count = 0

    def _connect_receiver(self) -> None:
        weights = self._strategy.flat(self.model) if self.model is not None else {}
        if any(tensor.is_meta for tensor in weights.values()):
            raise ConfigurationError(
                "no_sync moves no weights, and this worker's model has none (its tensors are on the meta device, "
                "as TorchRL's collectors send a policy to their workers): build the policy in the worker "
                "(policy_factory=), or use a scheme that moves weights",
                model_id=self.model_id,
                worker_idx=self.worker_idx,
            )

    def _send(self, weights: Any, targets: list[int], wait: bool) -> None:
        # What another scheme refuses in the caller is refused here too: a switch to no_sync hides no bug
        if weights is not None or self._runtime.model is not None:  # (with neither, nothing to look at)
            flat = self._flat_weights(weights)  # (weights it cannot take: named)
            if weights is not None and self._runtime.model is not None:  # (keys, shapes, dtypes: the model's)
                check_sent(flat, weights_spec(self._flat_weights(None)), model_id=self.model_id)
            if self.check_finite:
                check_finite(flat, model_id=self.model_id)
        self._count = (self._count or 0) + 1

    def _receive(self, timeout: float) -> Any:
        self._closing.wait(timeout)
        return None

    def take(self, timeout: float | None = 0.0) -> None:
        """``None`` after waiting ``timeout``, as another scheme's take when nothing comes."""
        self._runtime.require(RECEIVER_CONNECTED, action="take")
        self._receive(checks.within(timeout, self.timeout, "take(timeout)"))

    def _close(self, timeout: float) -> None:
        self._closing.set()

    def _targets(self, worker_ids: Any) -> list[int]:
        if self._runtime.num_workers is not None:  # (checked as every scheme checks them)
            return super()._targets(worker_ids)
        return [] if worker_ids is None else ([worker_ids] if isinstance(worker_ids, int) else list(worker_ids))
