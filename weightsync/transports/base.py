"""The protocol every transport implements: :class:`TransportBackend`."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["TransportBackend"]


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
