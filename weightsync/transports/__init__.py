"""Transports: each engine's data plane, one package an engine (loaded on first use).

``local`` (worker processes on this machine), ``distributed`` (a torch.distributed
process group), ``rpc`` (torch.distributed.rpc) and ``ray`` (Ray actors); the
helpers they share sit beside them (``network``, ``store``, ``staging``,
``processes``).
"""

from __future__ import annotations

from .._lazy import lazy

_HOME = {
    name: module
    for module, names in {
        "base": ("PeerTransport", "TransportBackend"),
        "local": ("MPTransport", "SharedMemTransport"),
        "distributed": ("DistributedTransport",),
        "rpc": ("RPCTransport",),
        "ray": ("RayActorTransport", "RayTransport"),
    }.items()
    for name in names
}

__all__ = sorted(_HOME)

__getattr__, __dir__ = lazy(__name__, _HOME)
