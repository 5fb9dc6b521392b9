"""Backend names: which scheme class ``WeightSyncScheme.from_backend(name)`` builds.

Built-in schemes are imported lazily, so naming one whose engine is not
installed costs nothing until it is asked for. Third parties register their
own with :func:`register_backend`, or declare them as entry points in the
``weightsync.backends`` group (``name = "package.module:SchemeClass"``).
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from ..errors import ConfigurationError

if TYPE_CHECKING:
    from ..core.scheme import WeightSyncScheme

__all__ = ["available_backends", "builtin_scheme_paths", "get_backend", "register_backend"]

log = logging.getLogger("weightsync.registry")

ENTRY_POINT_GROUP = "weightsync.backends"

_BUILTIN: dict[str, str] = {
    "multiprocess": "weightsync.schemes.multiprocess:MultiProcessWeightSyncScheme",
    "shared_mem": "weightsync.schemes.shared_mem:SharedMemWeightSyncScheme",
    "no_sync": "weightsync.schemes.no_sync:NoWeightSyncScheme",
    "ray": "weightsync.schemes.ray:RayWeightSyncScheme",
    "ray_module_transform": "weightsync.schemes.ray:RayModuleTransformScheme",
    "rpc": "weightsync.schemes.rpc:RPCWeightSyncScheme",
    "distributed": "weightsync.schemes.distributed:DistributedWeightSyncScheme",
}
_ALIASES = {
    "mp": "multiprocess",
    "sharedmem": "shared_mem",
    "shared_memory": "shared_mem",
    "none": "no_sync",
    "torch_distributed": "distributed",
    "gloo": "distributed",
}
_registered: dict[str, type[WeightSyncScheme] | str] = {}
_entry_points_loaded = False


def register_backend(name: str, scheme: type[WeightSyncScheme] | str, *, replace: bool = False) -> None:
    """Register ``scheme`` (a class, or ``"module:Class"`` to import lazily) under ``name``.

    Raises:
        ConfigurationError: ``name`` is taken and ``replace`` is false.
    """
    if not name or not isinstance(name, str):
        raise ConfigurationError(f"backend name must be a non-empty string, got {name!r}")
    if not replace and (name in _registered or name in _BUILTIN):
        raise ConfigurationError(f"backend {name!r} is already registered (pass replace=True to override)")
    _registered[name] = scheme


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        _registered.setdefault(ep.name, ep.value)


def _table() -> dict[str, type[WeightSyncScheme] | str]:
    _load_entry_points()
    return {**_BUILTIN, **_registered}


def builtin_scheme_paths() -> list[str]:
    """``"module:Class"`` of every scheme weightsync ships."""
    return list(_BUILTIN.values())


def available_backends() -> list[str]:
    """Sorted names of every registered backend (built-in, registered and entry points)."""
    return sorted(_table())


def get_backend(name: str) -> type[WeightSyncScheme]:
    """The scheme class registered under ``name`` (aliases such as ``"mp"`` accepted).

    Raises:
        ConfigurationError: unknown name (the message lists the known ones), or its
            module could not be imported (for example a missing optional engine).
    """
    table = _table()
    key = _ALIASES.get(name, name)
    if key not in table:
        raise ConfigurationError(f"unknown weight-sync backend {name!r}; known: {sorted(table)}")
    target = table[key]
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigurationError(f"backend {name!r} ({table[key]}) is not available: {exc}") from exc
    return target
