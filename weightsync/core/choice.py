"""Which transport a scheme runs over, and that transport's settings: by name, by settings, or by class
(:func:`choose_transport`), held by the scheme as a :class:`TransportChoice`."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

from ..errors import ConfigurationError
from .settings import TransportSettings

__all__ = ["TransportChoice", "choose_transport"]


class TransportChoice:
    """The transport a :class:`~weightsync.core.scheme.WeightSyncScheme` runs over, among those its class names
    (``TRANSPORTS``), and that transport's settings (``settings``), chosen once, in ``_choose_transport``."""

    #: The settings classes of the transports this scheme can run over; the first is its default.
    TRANSPORTS: ClassVar[tuple[type[TransportSettings], ...]] = ()

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The options that are its transport's settings (its ``settings`` holds them)."""
        return tuple(cls.TRANSPORTS[0].option_names()) if cls.TRANSPORTS else ()

    def _choose_transport(self, transport: Any, given: dict[str, Any]) -> None:
        """Hold the settings of the transport ``transport`` names, with the settings ``given`` to the scheme
        (:func:`choose_transport`, which raises what it refuses)."""
        #: The chosen transport's settings (``None``: the scheme has no transport to choose).
        self.settings = choose_transport(type(self), transport, given)
        self.transport_name = self.settings.name if self.settings is not None else None

    @property
    def wire_dtype(self) -> str | None:
        """The dtype floating weights travel as (a setting of some transports; ``None``: as they are)."""
        return getattr(self.settings, "wire_dtype", None)

    @property
    def transport_class(self) -> Any:
        """The class of this scheme's transport to one worker, as the older API builds it (``create_transport``)."""
        return self.settings.transport_class() if self.settings is not None else None


def choose_transport(scheme: type[TransportChoice], transport: Any, given: dict[str, Any]) -> TransportSettings | None:
    """The settings of the transport ``transport`` names among ``scheme.TRANSPORTS`` (``None``: the first), with
    the settings ``given`` to the scheme as keyword arguments.

    ``transport`` is a name, a settings object (what Hydra builds from a scheme's ``transport`` config), a
    settings class, or, as the older API spelled it, the transport class to one worker, bare or in a
    ``functools.partial`` binding settings.

    Raises:
        ConfigurationError: a transport the scheme does not run over, a setting the transport does not
            have (or a bad value), or a setting given both to the scheme and in ``transport`` with two values.
    """
    choices = scheme.TRANSPORTS
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
    named = getattr(transport, "name", None)  # (a settings class, as Hydra builds a transport's config: its name)
    shown = repr(named) if isinstance(transport, type) and isinstance(named, str) else repr(transport)
    target = transport.get("_target_") if isinstance(transport, Mapping) else None
    if isinstance(target, str) and target.rpartition(".")[2] in {cls.__name__ for cls in choices}:
        # (hydra's instantiate(..., _recursive_=False) hands the transport's config over as it is)
        raise ConfigurationError(
            f"{scheme.__name__} was given its transport's config uninstantiated ({shown}): instantiate the scheme's "
            "config without _recursive_=False, or give transport= the transport's name or settings"
        )
    raise ConfigurationError(f"{scheme.__name__} runs over the transports {sorted(names)}, got {shown}")


def _peer_class(cls: type[TransportSettings]) -> Any:
    try:
        return cls.transport_class()
    except ImportError:  # an optional engine that is not installed is not what the caller named
        return None
