"""What every transport is: :class:`TransportBackend`, and the sender's transport to one worker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..errors import LifecycleError

if TYPE_CHECKING:
    from ..core.engine import Sink

__all__ = ["PeerTransport", "TransportBackend"]


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


class PeerTransport:
    """The sender's transport to one worker. Its engine moves the bytes; what the older API asks of it
    (``send_weights`` and the like) goes through the sender's pipeline, the ``sink`` it was given.
    """

    #: Whether ``send_weights`` waits for the ack (``None``: as the scheme's ``sync`` says, which the sender's
    #: pipeline reads).
    sync: bool | None = True

    def __init__(self, worker_idx: int, sink: Sink | None = None) -> None:
        self.worker_idx = worker_idx
        self._sink = sink

    def _sender(self) -> Sink:
        if self._sink is None:
            raise LifecycleError("this transport is a receiver's; sender methods need the sender side")
        return self._sink

    def send_weights(self, weights: Any) -> None:
        """Publish ``weights`` to this worker only and wait for its ack (bounded by the scheme's timeout)."""
        self._sender().send_to(weights, [self.worker_idx], wait=self.sync)

    def send_weights_async(self, weights: Any) -> None:
        """Publish ``weights`` to this worker only; :meth:`wait_ack` waits for the ack."""
        self._sender().send_to(weights, [self.worker_idx], wait=False)

    def wait_ack(self, timeout: float | None = None) -> None:
        """Wait until this worker acked the last version sent to it (bounded by ``timeout``)."""
        self._sender().wait_for([self.worker_idx], timeout)

    def receive_weights(self, timeout: float | None = None, **kwargs: Any) -> Any:
        raise LifecycleError(f"{type(self).__name__} is a sender's transport; a worker receives with scheme.receive()")

    def send_ack(self, version: int, error: BaseException | None = None, held: int | None = None) -> None:
        raise LifecycleError(f"{type(self).__name__} is a sender's transport; its worker acks by applying")

    def check_connection(self) -> bool:
        """``False`` once the worker is known gone (a receiver's transport: ``True``)."""
        return self._sink is None or not self._sink.is_dead(self.worker_idx)
