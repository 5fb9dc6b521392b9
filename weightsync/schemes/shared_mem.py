"""``SharedMemWeightSyncScheme``: workers read the published weights in place, in shared memory."""

from __future__ import annotations

from .. import options
from ..options import option
from ..transports.local.settings import MPSettings, SharedMemSettings
from .local import LocalScheme

__all__ = ["SharedMemWeightSyncScheme"]


class SharedMemWeightSyncScheme(LocalScheme, name="shared_mem", aliases=("sharedmem", "shared_memory")):
    """Synchronize a model to worker processes through shared memory owned by weightsync.

    A send copies the trainer's weights once into a free shared slot; each
    targeted worker then switches its model's tensors to that slot, whole,
    without a second copy. The trainer's own parameters are never shared, so
    an optimizer step is invisible to workers until the next ``send()``; and
    the sender never writes into a slot a worker still uses, so no worker can
    see a mix of two versions.

    A worker model switches whole when it is on the CPU (host slots) or on the
    trainer's own GPU (slots in the trainer's GPU memory, through CUDA IPC; the
    GPU is matched by UUID). A model elsewhere (another GPU, several devices)
    is copied into from pinned host slots. A switched model must not be
    modified in place by the worker: its memory is the published snapshot,
    shared with the other workers that hold the same version (its mapping is
    writable, so a BatchNorm in training mode does not crash the worker, but
    what it writes, every worker of that version sees). On a GPU, a worker
    whose sender shut down or died moves its model to private memory at once.
    """

    per_worker_weights: bool = option(options.PER_WORKER_WEIGHTS)

    TRANSPORTS = (SharedMemSettings, MPSettings)
