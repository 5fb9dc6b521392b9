"""The torch.distributed.rpc engine: TensorPipe agents, one per process, in a world the sender forms."""

from .session import default_worker_name
from .transport import RPCTransport

__all__ = ["RPCTransport", "default_worker_name"]
