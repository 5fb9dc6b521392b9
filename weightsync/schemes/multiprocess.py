"""``MultiProcessWeightSyncScheme``: every worker process keeps its own private copy."""

from __future__ import annotations

from ..strategy import WeightStrategy
from ..transports.mp import MPTransport
from .local import LocalScheme

__all__ = ["MultiProcessWeightSyncScheme"]


class MultiProcessWeightSyncScheme(LocalScheme):
    """Synchronize a model to worker processes on this machine, each with a private copy.

    A send writes the weights once into a shared staging slot; each targeted
    worker copies them into its own model (which may live on any device) and
    acks. The worker's model never shares memory with the trainer or with
    other workers, so it may be modified locally.

    A worker whose model is on the CPU moves its tensors, at the first
    update, into one private buffer laid out like the slot (the Parameter
    objects stay, each now a view of that buffer), so that every update is
    one copy whatever the number of tensors; their memory then stays the same
    from update to update. With 2000 tensors, copying them one by one costs
    about 1.5 us of dispatch each.

    Args:
        keep_storage: workers copy each update into their model's tensors one
            by one, and never move them. Also what a model off the CPU, or in
            shared memory at its first update (``share_memory()``: processes of
            the worker's own may read it), gets.
        Other arguments: see :class:`~weightsync.schemes.local.LocalScheme`.

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=30)
        scheme.init_on_sender(model_id="policy", model=policy, num_workers=2)
        procs = [ctx.Process(target=worker, args=(scheme, i)) for i in range(2)]  # pickled: receiver-ready
        ...
        scheme.connect()
        scheme.send()          # blocks until both workers applied and acked
    """

    backend = "multiprocess"
    transport_class = MPTransport

    def __init__(
        self,
        strategy: str | WeightStrategy = "tensordict",
        sync: bool = True,
        timeout: float = 60.0,
        connect_timeout: float = 120.0,
        background_thread: bool = False,
        latest_wins: bool = True,
        max_slots: int | None = None,
        keep_storage: bool = False,
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
            background_thread=background_thread,
            latest_wins=latest_wins,
            max_slots=max_slots,
            on_failure=on_failure,
            max_staleness=max_staleness,
            check_finite=check_finite,
            checksum=checksum,
            flatten_sender=flatten_sender,
        )
        self.keep_storage = bool(keep_storage)

    def _config_fields(self) -> set[str]:
        return super()._config_fields() | {"keep_storage"}
