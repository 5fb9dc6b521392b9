"""The local engine: worker processes on this machine, over an authenticated abstract Unix socket and
anonymous shared memory (``multiprocess``, ``shared_mem``)."""

from __future__ import annotations

from ..._lazy import lazy

# Loaded on first use: defining a scheme loads its transport's settings (``settings``), never the engine.
__getattr__, __dir__ = lazy(__name__, {"MPTransport": "mp", "SharedMemTransport": "shared_mem"})
