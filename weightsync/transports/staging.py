"""Staging buffers for network sends: a flat copy of the weights that in-flight sends may still read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.timing import remaining
from ..errors import held_up

__all__ = ["Staging", "StagingPool"]

#: Seconds a send waiting for a free buffer gives each in-flight send at a time before it looks again.
SETTLE_S = 0.05


class Staging:
    """One flat send buffer and, per worker, the send still reading it (``pin``: in page-locked host memory,
    which a GPU copies into at the bus's speed)."""

    def __init__(self, nbytes: int, device: torch.device, pin: bool = False) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
        self.readers: dict[int, Any] = {}  # worker -> its in-flight send(s) (Works or Futures)
        self.views: dict[str, torch.Tensor] | None = None  # typed views of the buffer, made once by its user

    def busy(self, done: Callable[[Any], bool]) -> list[int]:
        """Workers whose send still reads this buffer."""
        self.readers = {w: op for w, op in self.readers.items() if not done(op)}
        return sorted(self.readers)


class StagingPool:
    """At most ``limit`` staging buffers; a send takes one no in-flight send reads.

    Args:
        nbytes: size of each buffer (the flat layout's).
        device: where buffers live (CPU, or the GPU for NCCL).
        limit: most buffers held at once; peak extra memory is ``limit`` x ``nbytes``.
        done: whether an in-flight send has finished.
        settle: waits a little on one in-flight send; ``False`` if still running.
        pin: host buffers are page-locked (the trainer's weights are on a GPU).
    """

    def __init__(
        self,
        nbytes: int,
        device: torch.device,
        limit: int,
        done: Callable[[Any], bool],
        settle: Callable[[int, Any, float], bool],
        pin: bool = False,
    ) -> None:
        self.nbytes, self.device, self.limit, self.pin = nbytes, device, limit, pin and device.type == "cpu"
        self._done, self._settle = done, settle
        self.buffers: list[Staging] = []

    def acquire(self, deadline: float, **where: Any) -> Staging:
        """A free buffer, waiting (until ``deadline``) for the oldest one's sends to finish.

        Raises:
            SyncTimeoutError: every buffer is still read by a worker that did not take its update in time (each
                such worker named: :class:`~weightsync.errors.SendFailedError` for several).
        """
        while True:
            for staging in self.buffers:
                if not staging.busy(self._done):
                    return staging
            if len(self.buffers) < self.limit:
                self.buffers.append(Staging(self.nbytes, self.device, self.pin))
                return self.buffers[-1]
            oldest = self.buffers[0]
            if remaining(deadline) <= 0:
                busy = oldest.busy(self._done)
                said = (
                    f"workers {busy} have not taken earlier versions off the wire; nothing was sent (all {self.limit} "
                    "staging buffers are in use)"
                )
                if busy:
                    held_up(said, busy, **where)
                continue  # (its last send ended just now: it is free)
            for w, op in list(oldest.readers.items()):
                if self._settle(w, op, min(remaining(deadline), SETTLE_S)):
                    oldest.readers.pop(w, None)

    def forget(self, worker: int) -> None:
        """A worker is gone and its sends were cancelled: they no longer hold any buffer."""
        for staging in self.buffers:
            staging.readers.pop(worker, None)

    def retire(self, worker: int) -> None:
        """A send to ``worker`` gave up while its engine may still read the buffer (an RPC that timed out is
        still written to the wire if the link comes back): the buffers it read leave the pool for good, so no
        later version is written into bytes that may yet be sent under an earlier one. The engine's own
        reference keeps each alive until it is done with it; the pool makes new ones in their place."""
        self.buffers = [staging for staging in self.buffers if worker not in staging.readers]
