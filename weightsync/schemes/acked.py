"""Shared by the schemes whose workers ack each update over their engine (torch.distributed, RPC)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigurationError, WeightSyncError, raise_failures
from ..layout import FlatLayout, wire_dtype_from_name
from ..strategy import WeightStrategy
from ..transports.channel import deadline_after
from .base import WeightSyncScheme

__all__ = ["AckedScheme"]


class AckedScheme(WeightSyncScheme):
    """Versions, async failures, bounded waits and the wire dtype of schemes that collect per-worker acks.

    Args:
        wire_dtype: floating weights travel as this dtype (for example ``"bfloat16"``
            for a float32 model: half the bytes) and are cast back to the model's
            dtype when applied; ``None`` sends them as they are. See the guide for
            the precision lost.
        checksum: the sender hashes each payload (XXH3-64) and receivers check it
            before applying; a corrupted or truncated payload is refused with
            :class:`~weightsync.errors.IntegrityError`. Off by default (see the
            benchmarks for its cost).
        flatten_sender: at ``init_on_sender``, the trainer's weights (the
            registered model; every tensor on the CPU) move into one buffer
            laid out like the payload: each tensor becomes a view of it, with
            its values, and the Parameter objects stay. A send then copies (or
            puts) that one buffer, where copying the tensors one by one costs
            dispatch and memory bandwidth per tensor. Off by default, because
            it changes the trainer's memory (see the guide); cannot be
            combined with ``wire_dtype``.
        Other arguments: see :class:`~weightsync.schemes.base.WeightSyncScheme`.

    Subclasses implement ``send_to(weights, targets, wait=..., timeout=...)`` and
    ``_collect(workers, deadline, expected)``: take in the acks already there
    (``deadline`` None), or wait until each worker acked ``expected[w]``; return
    the failures by worker.
    """

    def __init__(
        self,
        strategy: str | WeightStrategy = "tensordict",
        sync: bool = True,
        timeout: float = 60.0,
        connect_timeout: float = 120.0,
        wire_dtype: str | None = None,
        on_failure: str = "raise",
        max_staleness: int | None = None,
        check_finite: bool = False,
        checksum: bool = False,
        flatten_sender: bool = False,
    ) -> None:
        super().__init__(
            strategy=strategy,
            sync=sync,
            timeout=timeout,
            connect_timeout=connect_timeout,
            on_failure=on_failure,
            max_staleness=max_staleness,
            check_finite=check_finite,
        )
        wire_dtype_from_name(wire_dtype)  # a bad name fails here, not at connect
        self.wire_dtype = wire_dtype
        self.checksum = bool(checksum)
        self.flatten_sender = bool(flatten_sender)
        if self.flatten_sender and wire_dtype is not None:
            raise ConfigurationError(
                f"flatten_sender publishes the trainer's weights in their own dtype; it cannot be combined with "
                f"wire_dtype={wire_dtype!r}"
            )

    def _config_fields(self) -> set[str]:
        return super()._config_fields() | {"wire_dtype", "checksum", "flatten_sender"}

    def _sender_layout(self, wire_dtype: torch.dtype | None = None) -> FlatLayout:
        return super()._sender_layout(wire_dtype or wire_dtype_from_name(self.wire_dtype))

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        self._next_version = 0

    def send_to(self, weights: Any, targets: list[int], *, wait: bool, timeout: float | None = None) -> None:
        raise NotImplementedError

    def _collect(
        self, workers: list[int], deadline: float | None, expected: dict[int, int]
    ) -> dict[int, WeightSyncError]:
        raise NotImplementedError

    def _await_acks(self, expected: dict[int, int], deadline: float) -> dict[int, WeightSyncError]:
        return self._collect(sorted(expected), deadline, expected)

    def _send_impl(self, weights: Any, targets: list[int], wait: bool) -> None:
        self.send_to(weights, targets, wait=wait)

    def _send_initial(self, weights: Any, timeout: float, **kwargs: Any) -> None:
        """The initial weights to every worker; a worker that fails them is recorded as gone, then raised."""
        try:
            self.send_to(weights, sorted(self._transports), wait=True, timeout=timeout, **kwargs)
        except WeightSyncError as exc:
            self._mark_named_dead(exc)
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
