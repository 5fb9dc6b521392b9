"""``SharedMemWeightSyncScheme``: workers read the published weights in place, in shared memory."""

from __future__ import annotations

from .. import options
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
    """

    backend = "shared_mem"
    OPTIONS = (*LocalScheme.OPTIONS, options.PER_WORKER_WEIGHTS)
    TRANSPORTS = {"shared_mem": LocalScheme.TRANSPORTS["shared_mem"], "mp": LocalScheme.TRANSPORTS["mp"]}
