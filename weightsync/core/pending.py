"""A version taken off the transport ahead of its apply (``scheme.take``), for a program that pauses to load it."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from ..errors import LifecycleError

if TYPE_CHECKING:
    from .engine import Delivery
    from .receiver import Receiver

__all__ = ["PendingUpdate"]


class PendingUpdate:
    """A version taken off the transport and not applied yet (:meth:`~weightsync.core.scheme.WeightSyncScheme.take`):
    its bytes are in this process; :meth:`apply` checks and applies it as ``receive()`` would, and acks it. The
    worker takes no other version until it was applied (or refused), or discarded (:meth:`discard`).

    Attributes:
        version: the version it is.
    """

    def __init__(self, receiver: Receiver, taken: list[Delivery]) -> None:
        self._receiver, self._taken = receiver, taken
        self.version: int = taken[-1].version
        self._done = False
        receiver.release_pending = weakref.WeakMethod(self.release)  # (its shutdown lets go of the bytes held here)

    def apply(self) -> int:
        """Apply it (and ack it); return the version the worker now holds.

        Raises:
            LifecycleError: it was applied or discarded already, or the worker's scheme shut down.
            WeightMismatchError, IntegrityError, ConfigurationError: it was refused (and acked so); the model
                kept its weights.
        """
        taken = self._taken  # (a shutdown meanwhile lets this object's go)
        self._claim()
        try:
            return self._receiver.apply(taken)
        finally:
            self.release()

    def discard(self) -> None:
        """Let it go without applying it (a program that will not load it: it must apply or discard each version
        it takes, or take no other). The sender is told this worker did not apply it (a failure that names it; a
        version refused when taken, such as changes against a copy this worker does not hold, with that refusal,
        and its sender then sends it whole); the model keeps its weights, and the worker takes the next version.

        Raises:
            LifecycleError: it was applied or discarded already (after the scheme shut down, it does nothing).
        """
        if self._receiver.closed:  # (shut down: the engine let everything go already)
            self._done = True
            self.release()
            return
        self._claim()
        try:
            self._receiver.discard(self._taken)
        finally:
            self.release()

    def release(self) -> None:
        """Let go of the version's bytes (once it was applied or discarded, or its scheme shut down): a shared
        slot's mapping, a segment's descriptor, held for as long as the program keeps this object."""
        self._taken = []

    def _claim(self) -> None:
        """Mark it done, unless it was applied or discarded already, or its scheme shut down (raised)."""
        if self._done:
            raise LifecycleError(f"version {self.version} was applied or discarded already", **self._receiver.where)
        if self._receiver.closed:
            raise LifecycleError(f"version {self.version}: the worker's scheme shut down", **self._receiver.where)
        self._done = True

    def __repr__(self) -> str:
        return f"PendingUpdate(version={self.version}{', done' if self._done else ''})"
