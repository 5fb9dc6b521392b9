"""What the schemes over torch.distributed (its process groups, its RPC) take alike: :class:`NetworkScheme`."""

from __future__ import annotations

from .. import checks, options
from ..options import option
from .payload import PayloadScheme

__all__ = ["WORLD_SIZE", "NetworkScheme"]

#: The size of a torch.distributed world a receiver config may name: the trainer and its workers.
WORLD_SIZE = checks.integer(2, 2**16)


class NetworkScheme(PayloadScheme):
    """Base of the schemes whose trainer serves a TCP store that workers reach at ``master_addr:master_port``."""

    master_addr: str | None = option(options.MASTER_ADDR)
    master_port: int | None = option(options.MASTER_PORT)
    latest_wins: bool = option(options.LATEST_WINS)
    keep_storage: bool = option(options.KEEP_STORAGE)
