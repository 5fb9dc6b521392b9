"""Which transport a scheme runs over, and that transport's settings: by name, by class, or Hydra's partial."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from ..errors import ConfigurationError

__all__ = ["choose_transport", "transport_class"]


def transport_class(path: str) -> Any:
    """The transport class at ``"module:Class"`` (imported on first use)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def choose_transport(scheme: Any, transport: Any, given: set[str]) -> str | None:
    """The name of the transport ``transport`` names among ``scheme.TRANSPORTS`` (``None``: the first);
    the settings a partial binds become the scheme's options.

    Raises:
        ConfigurationError: a transport the scheme does not run over, a setting the transport does not
            have (or a bad value), or a setting also given to the scheme with another value.
    """
    transports = scheme.TRANSPORTS
    if not transports:
        if transport is not None:
            raise ConfigurationError(f"{type(scheme).__name__} has no transport to choose, got {transport!r}")
        return None
    settings: dict[str, Any] = {}
    if isinstance(transport, functools.partial):
        settings, transport = dict(transport.keywords), transport.func
    if transport is None:
        return next(iter(transports))
    name = transport if isinstance(transport, str) else _name_of(transports, transport)
    if name not in transports:
        raise ConfigurationError(
            f"{type(scheme).__name__} runs over the transports {sorted(transports)}, got {transport!r}"
        )
    known = {o.name: o for o in scheme.TRANSPORT_SETTINGS}
    for key, value in settings.items():
        if key not in known:
            raise ConfigurationError(f"transport {name!r} has no setting {key!r}; it has {sorted(known)}")
        value = known[key].check(value, f"transport.{key}")
        if key in given and getattr(scheme, key) != value:
            raise ConfigurationError(
                f"{key} given twice with different values: {getattr(scheme, key)!r}, and {value!r} in the transport"
            )
        setattr(scheme, key, value)
    return name


def _name_of(transports: dict[str, str], cls: Any) -> str | None:
    """The name under which ``transports`` lists the class ``cls``."""
    for name, path in transports.items():
        if transport_class(path) is cls:
            return name
    return None
