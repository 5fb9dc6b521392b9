"""The torch.distributed engine: a TCP store and a gloo (CPU) or NCCL (GPU) process group of its own."""

from __future__ import annotations

from ..._lazy import lazy

# Loaded on first use: defining a scheme loads its transport's settings (``settings``), never the engine.
__getattr__, __dir__ = lazy(__name__, {"DistributedTransport": "transport", "new_group": "group"})
