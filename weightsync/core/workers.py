"""Which workers a scheme serves, which one a receiver is, and which ones a call targets."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import ConfigurationError

__all__ = ["WorkersMixin"]


class WorkersMixin:
    """Worker counts and indices of :class:`~weightsync.core.scheme.WeightSyncScheme`, checked."""

    _model_id: str | None
    _num_workers: int | None
    _worker_idx: int | None
    _handoff: dict[str, Any] | None

    def _check_num_workers(self, num_workers: Any) -> int | None:
        if num_workers is None:
            return None
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ConfigurationError(
                f"num_workers must be a positive int, got {num_workers!r}", model_id=self._model_id
            )
        return num_workers

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
