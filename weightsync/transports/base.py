"""The protocol every transport implements: :class:`TransportBackend`."""

from __future__ import annotations

import time
from typing import Any, Protocol, runtime_checkable

__all__ = ["SenderBoundTransport", "TransportBackend"]


@runtime_checkable
class TransportBackend(Protocol):
    """The data plane to one receiver (or one shared buffer).

    Sender side: ``send_weights`` (blocks until the peer acked),
    ``send_weights_async``, ``wait_ack`` (bounded by a timeout) and
    ``check_connection``. Receiver side: ``receive_weights(timeout)`` and
    ``send_ack``. A method that makes no sense for a transport's role raises
    :class:`~weightsync.errors.LifecycleError`.
    """

    def send_weights(self, weights: Any) -> None: ...

    def send_weights_async(self, weights: Any) -> None: ...

    def wait_ack(self, timeout: float | None = None) -> None: ...

    def receive_weights(self, timeout: float | None = None, **kwargs: Any) -> Any: ...

    def send_ack(self, version: int, error: BaseException | None = None, held: int | None = None) -> None: ...

    def check_connection(self) -> bool: ...


class SenderBoundTransport:
    """Sender-side methods of a per-worker transport, carried out by the scheme that owns it.

    The scheme keeps versions and payloads; the transport publishes to its one
    worker through it.
    """

    worker_idx: int
    _scheme: Any
    #: ``time.perf_counter()`` when :attr:`acked` last moved (per-worker ack times in send metrics).
    acked_at: float = float("-inf")

    @property
    def acked(self) -> int | None:
        """The last version this worker acked (``None`` before any)."""
        return self.__dict__.get("_acked")

    @acked.setter
    def acked(self, version: int | None) -> None:
        if version != self.__dict__.get("_acked"):
            self.acked_at = time.perf_counter()
        self.__dict__["_acked"] = version

    def _sender(self) -> Any:
        if self._scheme is None:
            from ..errors import LifecycleError

            raise LifecycleError("this transport is a receiver's; sender methods need the sender side")
        return self._scheme

    def send_weights(self, weights: Any) -> None:
        """Publish ``weights`` to this worker only and wait for its ack (bounded by the scheme's timeout)."""
        self._sender().send_to(weights, [self.worker_idx], wait=True)

    def send_weights_async(self, weights: Any) -> None:
        """Publish ``weights`` to this worker only; :meth:`wait_ack` waits for the ack."""
        self._sender().send_to(weights, [self.worker_idx], wait=False)

    def wait_ack(self, timeout: float | None = None) -> None:
        """Wait until this worker acked the last version sent to it (bounded by ``timeout``)."""
        self._sender().wait_for([self.worker_idx], timeout)
