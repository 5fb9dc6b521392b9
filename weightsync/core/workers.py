"""Which workers a scheme serves, which one a receiver is, and which ones a call targets: checks of plain values.

Each function takes what it checks and the model's name (for the error), and raises
:class:`~weightsync.errors.ConfigurationError` naming the value it refuses.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ConfigurationError

__all__ = ["MAX_WORKERS", "check_num_workers", "check_worker_idx", "same_worker", "targets"]


#: The most workers one scheme serves: each holds a channel, a rank or an actor, and state of its own on the
#: sender (a count of 10**9 ran for a minute, then ended in a bare MemoryError).
MAX_WORKERS = 65536


def check_num_workers(num_workers: Any, model_id: str | None) -> int | None:
    """``num_workers``, a positive int up to :data:`MAX_WORKERS` (numpy's too), or ``None`` (not known yet)."""
    if num_workers is None:
        return None
    if (
        isinstance(num_workers, bool)
        or not isinstance(num_workers, numbers.Integral)
        or not 1 <= int(num_workers) <= MAX_WORKERS
    ):
        raise ConfigurationError(
            f"num_workers must be a positive int of at most {MAX_WORKERS}, got {num_workers!r}", model_id=model_id
        )
    return int(num_workers)


def _index(value: Any) -> int | None:
    """``value`` as a worker's index, if it is an int (numpy's too; not a bool); ``None`` where it is none."""
    return None if isinstance(value, bool) or not isinstance(value, numbers.Integral) else int(value)


def check_worker_idx(worker_idx: Any, num_workers: int | None, model_id: str | None) -> int:
    """``worker_idx``, a non-negative int (numpy's too), below ``num_workers`` when that is known."""
    idx = _index(worker_idx)
    if idx is None or idx < 0:
        raise ConfigurationError(f"worker_idx must be a non-negative int, got {worker_idx!r}", model_id=model_id)
    if num_workers is not None and idx >= num_workers:
        raise ConfigurationError(f"worker_idx {idx} out of range for {num_workers} workers", model_id=model_id)
    return idx


def same_worker(worker_idx: Any, num_workers: int | None, made_for: int | None, model_id: str | None) -> int:
    """``worker_idx``, checked, and the index ``made_for`` a receiver config made the receiver for, if any."""
    idx = check_worker_idx(worker_idx, num_workers, model_id)
    if made_for is not None and idx != made_for:
        raise ConfigurationError(
            f"this receiver was made for worker {made_for} (its receiver config says so), "
            f"not worker {idx}: give each worker its own receiver config",
            model_id=model_id,
            worker_idx=idx,
        )
    return idx


def targets(worker_ids: int | Iterable[int] | None, num_workers: int, model_id: str | None) -> list[int]:
    """The workers ``worker_ids`` names, sorted: one index, several (numpy's ints too), or ``None`` for all
    ``num_workers`` (an empty list names none: the version is published for workers that rejoin)."""
    if worker_ids is None:
        return list(range(num_workers))
    one = _index(worker_ids)
    given = [worker_ids] if one is not None else worker_ids
    if isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Iterable):
        raise ConfigurationError(f"worker_ids must be None, an int or a list of ints, got {worker_ids!r}")
    try:
        given = list(given)
    except TypeError:  # (a 0-d array or tensor says it is iterable, and is not)
        raise ConfigurationError(f"worker_ids must be None, an int or a list of ints, got {worker_ids!r}") from None
    ids = [_index(w) for w in given]
    bad = [g for g, w in zip(given, ids) if w is None or not 0 <= w < num_workers]
    if bad:
        raise ConfigurationError(
            f"worker_ids {bad} are not workers of this scheme (valid: 0..{num_workers - 1})", model_id=model_id
        )
    if len(set(ids)) != len(ids):
        raise ConfigurationError(f"worker_ids has duplicates: {ids}", model_id=model_id)
    return sorted(int(w) for w in ids if w is not None)
