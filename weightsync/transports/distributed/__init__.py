"""The torch.distributed engine: a TCP store and a gloo (CPU) or NCCL (GPU) process group of its own."""

from .group import new_group
from .transport import DistributedTransport

__all__ = ["DistributedTransport", "new_group"]
