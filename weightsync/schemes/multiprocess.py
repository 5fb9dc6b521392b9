"""``MultiProcessWeightSyncScheme``: every worker process keeps its own private copy."""

from __future__ import annotations

from ..transports.mp import MPTransport
from .local import LocalScheme

__all__ = ["MultiProcessWeightSyncScheme"]


class MultiProcessWeightSyncScheme(LocalScheme):
    """Synchronize a model to worker processes on this machine, each with a private copy.

    A send writes the weights once into a shared staging slot; each targeted
    worker copies them into its own model (which may live on any device) and
    acks. The worker's model never shares memory with the trainer or with
    other workers, so it may be modified locally.

    Arguments: see :class:`~weightsync.schemes.local.LocalScheme`.

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
