"""Which transport a scheme runs over, and that transport's settings: by name, by settings, or by class."""

from __future__ import annotations

import functools
from typing import Any

from ..errors import ConfigurationError
from .settings import TransportSettings

__all__ = ["choose_transport"]


def choose_transport(scheme: type, transport: Any, given: dict[str, Any]) -> TransportSettings | None:
    """The settings of the transport ``transport`` names among ``scheme.TRANSPORTS`` (``None``: the first), with
    the settings ``given`` to the scheme as keyword arguments.

    ``transport`` is a name, a settings object (what Hydra builds from a scheme's ``transport`` config), a
    settings class, or, as the older API spelled it, the transport class to one worker, bare or in a
    ``functools.partial`` binding settings.

    Raises:
        ConfigurationError: a transport the scheme does not run over, a setting the transport does not
            have (or a bad value), or a setting given both to the scheme and in ``transport`` with two values.
    """
    choices: tuple[type[TransportSettings], ...] = scheme.TRANSPORTS  # type: ignore[attr-defined]
    if not choices:
        if transport is not None:
            raise ConfigurationError(f"{scheme.__name__} has no transport to choose, got {transport!r}")
        return None
    bound: dict[str, Any] = {}
    if isinstance(transport, functools.partial):
        bound, transport = dict(transport.keywords), transport.func
    if isinstance(transport, TransportSettings):
        bound, transport = {**transport.option_values(), **bound}, type(transport)
    cls = _settings_class(scheme, choices, transport)
    for key, value in given.items():
        if key in bound and cls.option(key).check(bound[key], f"transport.{key}") != cls.option(key).check(value, key):
            raise ConfigurationError(
                f"{key} given twice with different values: {value!r}, and {bound[key]!r} in the transport"
            )
    unknown = sorted(set(bound) - set(cls.option_names()))
    if unknown:
        raise ConfigurationError(f"transport {cls.name!r} has no setting {unknown[0]!r}; it has {cls.option_names()}")
    return cls(**{**bound, **given})


def _settings_class(scheme: type, choices: tuple[type[TransportSettings], ...], transport: Any) -> Any:
    if transport is None:
        return choices[0]
    for cls in choices:
        if transport in (cls, cls.name) or (cls.transport is not None and transport is _peer_class(cls)):
            return cls
    names = [cls.name for cls in choices]
    raise ConfigurationError(f"{scheme.__name__} runs over the transports {sorted(names)}, got {transport!r}")


def _peer_class(cls: type[TransportSettings]) -> Any:
    try:
        return cls.transport_class()
    except ImportError:  # an optional engine that is not installed is not what the caller named
        return None
