"""The torch.distributed.rpc engine: TensorPipe agents, one per process, in a world the sender forms."""

from __future__ import annotations

from ..._lazy import lazy

# Loaded on first use: defining a scheme loads its transport's settings (``settings``), never the engine.
__getattr__, __dir__ = lazy(__name__, {"RPCTransport": "transport", "default_worker_name": "session"})
