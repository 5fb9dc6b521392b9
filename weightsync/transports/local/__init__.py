"""The local engine: worker processes on this machine, over an authenticated abstract Unix socket and
anonymous shared memory (``multiprocess``, ``shared_mem``)."""

from .mp import MPTransport
from .shared_mem import SharedMemTransport

__all__ = ["MPTransport", "SharedMemTransport"]
