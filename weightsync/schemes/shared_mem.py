"""``SharedMemWeightSyncScheme``: workers read the published weights in place, in shared memory."""

from __future__ import annotations

from ..strategy import WeightStrategy
from ..transports.shared_mem import SharedMemTransport
from .local import LocalScheme

__all__ = ["SharedMemWeightSyncScheme"]


class SharedMemWeightSyncScheme(LocalScheme):
    """Synchronize a model to worker processes through shared memory owned by weightsync.

    A send copies the trainer's weights once into a free shared slot; each
    targeted worker then switches its model's tensors to that slot, whole,
    without a second copy. The trainer's own parameters are never shared, so
    an optimizer step is invisible to workers until the next ``send()``; and
    the sender never writes into a slot a worker still uses, so no worker can
    see a mix of two versions.

    Worker models must live on the CPU to be switched (others are copied into)
    and must not be modified in place by the worker: their memory is the
    published snapshot, shared with the other workers that hold the same version.

    Args:
        per_worker_weights: give every worker slots of its own rather than
            sharing them among workers (more memory; independent versions).
        Other arguments: see :class:`~weightsync.schemes.local.LocalScheme`.
    """

    backend = "shared_mem"
    transport_class = SharedMemTransport

    def __init__(
        self,
        strategy: str | WeightStrategy = "tensordict",
        sync: bool = True,
        timeout: float = 60.0,
        connect_timeout: float = 120.0,
        background_thread: bool = False,
        latest_wins: bool = True,
        max_slots: int | None = None,
        per_worker_weights: bool = False,
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
        self.per_worker_weights = bool(per_worker_weights)

    def _config_fields(self) -> set[str]:
        return super()._config_fields() | {"per_worker_weights"}

    def _pool_key(self, worker: int) -> int | None:
        return worker if self.per_worker_weights else None
