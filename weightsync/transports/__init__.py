"""Transports: each engine's data plane, one package an engine (loaded on first use).

``local`` (worker processes on this machine), ``distributed`` (a torch.distributed
process group), ``rpc`` (torch.distributed.rpc) and ``ray`` (Ray actors); the
helpers they share sit beside them (``network``, ``store``, ``staging``,
``processes``).
"""

from __future__ import annotations

from .._lazy import lazy

__getattr__, __dir__ = lazy(
    __name__, {"PeerTransport": "base", "TransportBackend": "base"}, under="weightsync.transports."
)
