"""The older API, for code written against it: the lifecycle's older names (``init_on_worker``,
``setup_connection_and_weights``, ``synchronize_weights``), ``apply_weights``, ``get_sender()``/``WeightSender``,
``get_receiver()``/``WeightReceiver``, ``create_transport(...)``, and the older transports' ``send_to``/``wait_for``,
each over the scheme's own calls (:class:`~weightsync.core.scheme.WeightSyncScheme`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConfigurationError, LifecycleError
from .properties import SchemeProperties
from .states import SENDER_CONNECTED

__all__ = ["SchemeFacades", "WeightReceiver", "WeightSender"]


class _Facade:
    def __init__(self, scheme: Any) -> None:
        self._scheme = scheme

    @property
    def scheme(self) -> Any:
        """The scheme this facade calls."""
        return self._scheme


class WeightSender(_Facade):
    """Older facade over a sender scheme: ``send``, ``send_async``, ``wait_async``, ``update_weights``."""

    def send(self, weights: Any = None, worker_ids: int | Iterable[int] | None = None) -> None:
        self._scheme.send(weights, worker_ids)

    def send_async(self, weights: Any = None, worker_ids: int | Iterable[int] | None = None) -> None:
        self._scheme.send_async(weights, worker_ids)

    def wait_async(self, timeout: float | None = None) -> None:
        self._scheme.wait_async(timeout)

    def update_weights(self, weights: Any = None, worker_ids: int | Iterable[int] | None = None) -> None:
        """Send and wait for every targeted worker, whatever the scheme's ``sync``."""
        self._scheme.send_async(weights, worker_ids)
        self._scheme.wait_async()


class WeightReceiver(_Facade):
    """Older facade over a receiver scheme: ``receive(timeout) -> bool`` and ``apply_weights``."""

    def receive(self, timeout: float | None = 0.0) -> bool:
        """Apply a pending update; ``True`` if one was applied."""
        return self._scheme.receive(timeout) is not None

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        self._scheme.apply_weights(weights, inplace)

    @property
    def weights(self) -> Any:
        return self._scheme.weights


class SchemeFacades(SchemeProperties):
    """The older API of every scheme, over its runtime (:class:`SchemeProperties`): facade accessors (a scheme names
    its own facade classes), and the older transport API's sends and waits."""

    sender_facade: ClassVar[type] = WeightSender
    receiver_facade: ClassVar[type] = WeightReceiver

    if TYPE_CHECKING:  # the lifecycle's calls, the scheme's own (:class:`~weightsync.core.scheme.WeightSyncScheme`)

        def init_on_receiver(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None: ...

        def connect(self, *args: Any, **kwargs: Any) -> None: ...

    def init_on_worker(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Older name of :meth:`init_on_receiver`."""
        self.init_on_receiver(model_id, context, **kwargs)

    def setup_connection_and_weights(self, **kwargs: Any) -> None:
        """Older name of :meth:`connect`."""
        self.connect(**kwargs)

    def synchronize_weights(self, **kwargs: Any) -> None:
        """Older name of :meth:`connect`."""
        self.connect(**kwargs)

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        """Write ``weights`` into this side's registered model, whole or not at all. A worker whose model maps the
        slot of its version (``shared_mem``) is given memory of its own first: the slot is the other workers' too."""
        rt = self._runtime
        if not inplace:
            raise ConfigurationError(
                "apply_weights(inplace=False) is not supported: weights are always written in place"
            )
        if rt.model is None:
            raise LifecycleError("apply_weights needs a registered model (init_on_sender/init_on_receiver)")
        with rt.weights_lock:
            if rt.receiving is not None and rt.receiving.engine.placement == "share":
                rt.receiving.bound.release()  # (the next version maps its slot again)
            rt.strategy.apply_weights(rt.model, weights, model_id=rt.model_id, worker_idx=rt.worker_idx)

    def get_sender(self) -> Any:
        """The sender facade. Raises :class:`LifecycleError` before ``init_on_sender``."""
        if not self.is_sender:
            raise LifecycleError(f"get_sender() needs init_on_sender() first; scheme is {self.state}")
        return self._runtime.facades.setdefault("sender", self.sender_facade(self))

    def get_receiver(self) -> Any:
        """The receiver facade. Raises :class:`LifecycleError` before ``init_on_receiver``."""
        if not self.is_receiver:
            raise LifecycleError(f"get_receiver() needs init_on_receiver() first; scheme is {self.state}")
        return self._runtime.facades.setdefault("receiver", self.receiver_facade(self))

    def create_sender(self) -> Any:
        """A sender facade bound to this scheme (usable once ``init_on_sender`` ran)."""
        return self.sender_facade(self)

    def create_receiver(self) -> Any:
        """A receiver facade bound to this scheme (usable once ``init_on_receiver`` ran)."""
        return self.receiver_facade(self)

    def create_transport(self, **kwargs: Any) -> Any:
        """Build the transport for one peer; see each scheme for its arguments."""
        raise ConfigurationError(f"{type(self).__name__} has no transport to create")

    def send_to(self, weights: Any, targets: list[int], *, wait: bool) -> None:
        """Publish one new version to ``targets`` (no failure policy, no metrics): the older transport API."""
        rt = self._runtime
        rt.require(SENDER_CONNECTED, action="send_to")
        assert rt.sending is not None
        rt.sending.send_to(weights, targets, wait=wait)

    def wait_for(self, workers: list[int], timeout: float | None) -> None:
        """Wait until each of ``workers`` acked the last version sent to it (at most ``timeout``)."""
        rt = self._runtime
        rt.require(SENDER_CONNECTED, action="wait_for")
        assert rt.sending is not None
        rt.sending.wait_for(workers, timeout)
