"""Structured configs: one dataclass per scheme, transport and strategy, each with a ``_target_``.

They are made from the options each scheme and transport declares
(:mod:`weightsync.options`), so a field, its type, its default and its
documentation are written once, where the option is. A scheme's config holds
its own options and composes its transport's config under ``transport``,
whose target is the transport's settings class (the engine takes it whole)
and which holds its fields (slots, buckets, wire dtype, backend):
``scheme.transport.bucket_mb=4`` sets one, and choosing another transport of
the same engine (``scheme/transport=shared_mem``) takes effect.
``hydra.utils.instantiate(cfg)`` builds the object.

Every registered scheme and transport has its config here (see
:mod:`weightsync.registry`), named after its class (``MultiProcessWeightSyncScheme``
-> ``MultiProcessSchemeConfig``, ``DistributedSettings`` -> ``DistributedTransportConfig``).

They use only what omegaconf 2.3 supports: no ``Literal``, no unions of
dataclasses; choices are checked by the options themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from .. import registry
from ..core.scheme import WeightSyncScheme, config_name_for
from ..core.settings import TransportSettings
from ..errors import ConfigurationError
from ..options import Option

log = logging.getLogger("weightsync.config")

#: Each transport's config by its name, and each scheme's by its name (every registered one).
TRANSPORTS: dict[str, type] = {}
SCHEMES: dict[str, type] = {}


def _doc(summary: str, opts: tuple[Option, ...]) -> str:
    lines = [summary]
    if opts:
        lines += ["", "Attributes:"] + [f"    {o.name}: {o.doc}" for o in opts]
    return "\n".join(lines)


def _config(name: str, target: str, opts: tuple[Option, ...], summary: str, base: type | None, **extra: Any) -> type:
    """A dataclass named ``name`` with ``_target_`` and one field per option not already in ``base``."""
    inherited = {f.name for f in dataclasses.fields(base)} if base else set()
    fields: list[Any] = [("_target_", str, dataclasses.field(default=target))]
    fields += [(o.name, o.annotation, dataclasses.field(default=o.default)) for o in opts if o.name not in inherited]
    fields += [(key, annotation, value) for key, (annotation, value) in extra.items()]
    if name in globals():  # (a name of this module, or another class's config: it would stand in for it)
        raise ConfigurationError(f"config name {name!r} is taken in weightsync.config")
    cls = dataclasses.make_dataclass(name, fields, bases=(base,) if base else ())
    cls.__module__ = __name__
    cls.__doc__ = _doc(summary, tuple(o for o in opts if o.name not in inherited))
    globals()[name] = cls  # a module attribute, so that configs pickle
    return cls


def _summary(cls: type) -> str:
    return (cls.__doc__ or cls.__name__).strip().split("\n\n")[0].replace("\n", " ")


def _path(cls: type) -> str:
    """A class as a config's ``_target_`` names it: weightsync's own by their public name (``weightsync.X``),
    another package's by its module."""
    if cls.__module__.startswith("weightsync."):
        return f"weightsync.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _transport_config(settings: type[TransportSettings]) -> type:
    """The config of a transport: its settings' fields, and their class as ``_target_``."""
    parent = next((b for b in settings.__mro__[1:] if issubclass(b, TransportSettings) and b.name), None)
    base = TRANSPORTS[parent.name] if parent is not None else None
    name = settings.__name__.removesuffix("Settings") + "TransportConfig"
    return _config(name, _path(settings), settings.OPTIONS, _summary(settings), base)


def _scheme_config(scheme: type[WeightSyncScheme], name: str, registered: list[type[WeightSyncScheme]]) -> type:
    """The config of a scheme: its own options (its transport's settings are in its ``transport``), based on
    the config of its nearest base class that has one."""
    parent: Any = next((b for b in scheme.__mro__[1:] if b in _CONFIGS), None)
    base = _CONFIGS[parent] if parent is not None else None
    settings = set(scheme.setting_names())
    own = tuple(o for o in scheme.OPTIONS if o.name not in settings)
    extra = {}
    if scheme.TRANSPORTS and (parent is None or scheme.TRANSPORTS != parent.TRANSPORTS):
        default = TRANSPORTS[scheme.TRANSPORTS[0].name]
        extra["transport"] = (Any, dataclasses.field(default_factory=default))
    return _config(name, _path(_concrete(scheme, registered)), own, _summary(scheme), base, **extra)


def _concrete(scheme: type[WeightSyncScheme], registered: list[type[WeightSyncScheme]]) -> type:
    """What a config of ``scheme`` builds: itself, or for a base class its first registered subclass."""
    if scheme is WeightSyncScheme:
        return registry.get_backend("no_sync")
    if scheme.backend_name or scheme in registered:
        return scheme
    return next(s for s in registered if issubclass(s, scheme))


def _registered() -> dict[str, type[WeightSyncScheme]]:
    """Every registered scheme class by name; one whose module does not import (a ``"module:Class"``
    registration of an engine not installed here) is left out, and said so in the log."""
    out = {}
    for name in registry.schemes():
        try:
            out[name] = registry.get_backend(name)
        except Exception as exc:  # noqa: BLE001 - any error of another package's import
            log.warning("weightsync.config: no config for backend %r: %s", name, exc)
    return out


_CONFIGS: dict[type, type] = {}


def _build() -> None:
    """Every registered transport's and scheme's config, weightsync's own first (registered first). Another
    package's class whose config cannot be made (its name is taken, or its transport has none) is left out, and
    said so in the log: weightsync's own and the others' still have theirs."""
    for name, settings in registry.transports().items():
        with _or_left_out(settings):
            TRANSPORTS[name] = _transport_config(settings)
    registered = _registered()
    classes: list[type[WeightSyncScheme]] = list(dict.fromkeys(registered.values()))
    every: list[type] = [WeightSyncScheme, *classes]
    for scheme in every:
        for cls in reversed(scheme.__mro__):
            if cls in _CONFIGS or not (isinstance(cls, type) and issubclass(cls, WeightSyncScheme)):
                continue
            # A class registered without name= (by an entry point or register_backend) is named as one with it.
            config = cls.config_name or (config_name_for(cls) if cls in classes else None)
            if config is not None:
                with _or_left_out(cls):
                    _CONFIGS[cls] = _scheme_config(cls, config, classes)
    for name, scheme in registered.items():
        if scheme in _CONFIGS:
            SCHEMES[name] = _CONFIGS[scheme]


@contextlib.contextmanager
def _or_left_out(cls: type) -> Iterator[None]:
    try:
        yield
    except (ConfigurationError, KeyError) as exc:
        if cls.__module__.startswith("weightsync."):
            raise
        log.warning("weightsync.config: no config for %s.%s: %s", cls.__module__, cls.__qualname__, exc)


# ----------------------------------------------------------------- strategy
@dataclasses.dataclass
class WeightStrategyConfig:
    """How weights are extracted: ``"tensordict"`` (all parameters and buffers) or ``"state_dict"``."""

    _target_: str = "weightsync.WeightStrategy"
    extract_as: str = "tensordict"


# -------------------------------------------------------------- vLLM engines
@dataclasses.dataclass
class VLLMWeightSyncSchemeConfig:
    """A scheme serving vLLM engines (:class:`~weightsync.integrations.vllm.VLLMWeightSyncScheme`, TorchRL's name).

    Attributes:
        scheme: the scheme that moves the bytes: a scheme's config (the group ``weightsync/scheme`` composes one
            here: ``weightsync/scheme@weightsync.scheme.scheme=distributed``), or a scheme's name.
        pause_mode: what requests in flight do while an engine loads a version: ``keep``, ``wait``, ``abort`` or
            ``none``.
        load_ahead: a CPU engine processes each version while it generates, and the pause only makes it
            current (``VLLMEngines``); ``false`` (default): vLLM's whole reload in the pause.
    """

    _target_: str = "weightsync.integrations.vllm.VLLMWeightSyncScheme"
    scheme: Any = "shared_mem"
    pause_mode: str = "keep"
    load_ahead: bool = False


_build()

__all__ = sorted(
    [
        "SCHEMES",
        "TRANSPORTS",
        "VLLMWeightSyncSchemeConfig",
        "WeightStrategyConfig",
        *(c.__name__ for c in [*TRANSPORTS.values(), *_CONFIGS.values()]),
    ]
)
