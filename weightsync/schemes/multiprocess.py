"""``MultiProcessWeightSyncScheme``: every worker process keeps its own private copy."""

from __future__ import annotations

from .. import options
from ..options import option
from .local import LocalScheme

__all__ = ["MultiProcessWeightSyncScheme"]


class MultiProcessWeightSyncScheme(LocalScheme, name="multiprocess", aliases=("mp",)):
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
    about 1.5 us of dispatch each. ``keep_storage`` copies tensor by tensor
    instead, and so does a model off the CPU, or in shared memory at its
    first update (``share_memory()``: processes of the worker's own may read
    it).

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=30)
        scheme.init_on_sender(model_id="policy", model=policy, num_workers=2)
        procs = [ctx.Process(target=worker, args=(scheme, i)) for i in range(2)]  # pickled: receiver-ready
        ...
        scheme.connect()
        scheme.send()          # blocks until both workers applied and acked
    """

    keep_storage: bool = option(options.KEEP_STORAGE)
