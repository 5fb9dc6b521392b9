"""The one place that knows every scheme, transport and public name of an engine, fed by the classes themselves.

A scheme registers as it is defined (``class MyScheme(WeightSyncScheme, name="mine")``), a transport's
settings likewise (``class MySettings(TransportSettings, name="mine", transport="pkg.mod:MyTransport")``),
and anything else an engine makes public with :func:`public`. From what is registered here come
:func:`get_backend`, the Hydra config groups (:mod:`weightsync.config`), the lazy public names of
``weightsync`` and the API reference.

Engines are found by importing their modules once, on the first question that needs them
(:func:`load`): weightsync's own (:data:`BUILTIN`), then every module or class named by an entry point of the
``weightsync.backends`` group in an installed package (``mine = "pkg.schemes"`` or
``"pkg.schemes:MyScheme"``). ``import weightsync`` loads none of them.

Integrations (the drivers of programs that drive a scheme themselves, :mod:`weightsync.core.drivers`) register
here likewise, as their driver classes are defined, and are found apart from engines: weightsync's own
(:data:`INTEGRATIONS`), then every module or class named by an entry point of the ``weightsync.integrations``
group, imported once, on the first question about a scheme's context (:func:`drivers`).
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from importlib.metadata import entry_points
from typing import Any, TypeVar

from .errors import ConfigurationError

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "INTEGRATIONS",
    "INTEGRATION_GROUP",
    "add_driver",
    "available_backends",
    "drivers",
    "get_backend",
    "load",
    "public",
    "public_names",
    "register_backend",
    "schemes",
    "transports",
]

log = logging.getLogger("weightsync.registry")

#: weightsync's own engines: each module defines (and so registers) its scheme classes and their transports.
BUILTIN = (
    "weightsync.schemes.multiprocess",
    "weightsync.schemes.shared_mem",
    "weightsync.schemes.no_sync",
    "weightsync.schemes.ray",
    "weightsync.schemes.rpc",
    "weightsync.schemes.distributed",
)
#: The entry-point group through which an installed package adds engines.
ENTRY_POINT_GROUP = "weightsync.backends"
#: weightsync's own integrations: each module defines (and so registers) a driver.
INTEGRATIONS = ("weightsync.integrations.torchrl", "weightsync.integrations.vllm.driver")
#: The entry-point group through which an installed package adds integrations.
INTEGRATION_GROUP = "weightsync.integrations"

T = TypeVar("T")

_lock = threading.RLock()
_schemes: dict[str, type | str] = {}  # a name -> the class ("module:Class" until imported)
_aliases: dict[str, str] = {}
_transports: dict[str, Any] = {}  # a transport's name -> its settings class
_public: dict[str, Any] = {}  # a public name -> the object ("module:Name" until imported)
_configs: dict[str, type] = {}  # a scheme's config name -> the scheme class
_loaded = False
_drivers: dict[str, Any] = {}  # a name -> the driver (an instance of a Driver subclass)
_integrations_loaded = False


def add_scheme(cls: type, name: str, aliases: tuple[str, ...] = (), config: str | None = None) -> None:
    """Register ``cls`` under ``name`` (and ``aliases``), its config under the name ``config``; called as a scheme
    class is defined. Another package's class loads the engines first (:func:`load`), so that it meets every
    name weightsync's own hold, whichever was imported first.

    Raises:
        ConfigurationError: ``name`` or an alias is another class's already, or the class's own name (a public
            name of ``weightsync``) or its config's name is.
    """
    with _lock:
        _load_before(cls)
        for key in (name, *aliases):
            taken = _schemes.get(_aliases.get(key, key))
            if taken is not None and not _same_class(taken, cls):
                raise ConfigurationError(f"backend {key!r} is already registered ({_describe(taken)})")
        _check_public(cls.__name__, cls)
        if config is not None:
            taken = _configs.get(config)
            if taken is not None and not _same_class(taken, cls):
                raise ConfigurationError(
                    f"{_describe(cls)}: config name {config!r} is {_describe(taken)}'s already: pass config= "
                    "another name"
                )
            _configs[config] = cls
        _schemes[name] = cls
        _aliases.update(dict.fromkeys(aliases, name))
        _public[cls.__name__] = cls


def add_transport(settings: type, name: str, transport: str | None) -> None:
    """Register a transport's settings class under ``name``, and its transport class (``"module:Class"``) as a
    public name; called as the settings class is defined (another package's loads the engines first, as
    :func:`add_scheme`).

    Raises:
        ConfigurationError: ``name``, or the public name of the settings or transport class, is another
            class's already.
    """
    with _lock:
        _load_before(settings)
        taken = _transports.get(name)
        if taken is not None and not _same_class(taken, settings):
            raise ConfigurationError(f"transport {name!r} is already registered ({_describe(taken)})")
        _check_public(settings.__name__, settings)
        if transport is not None:
            _check_public(transport.rpartition(":")[2], transport)
        _transports[name] = settings
        _public[settings.__name__] = settings
        if transport is not None:
            _public.setdefault(transport.rpartition(":")[2], transport)


def add_driver(driver: Any, name: str) -> None:
    """Register ``driver`` (an instance of a :class:`~weightsync.core.drivers.Driver` subclass) under ``name``;
    called as its class is defined.

    Raises:
        ConfigurationError: ``name`` is another class's driver already.
    """
    with _lock:
        taken = _drivers.get(name)
        if taken is not None and not _same_class(type(taken), type(driver)):
            raise ConfigurationError(f"integration {name!r} is already registered ({_describe(type(taken))})")
        _drivers[name] = driver


def drivers() -> dict[str, Any]:
    """Every registered driver by name, in the order registered; weightsync's own integrations and those of
    entry points are imported on the first call (a broken entry point is logged and skipped). An entry point
    names the module, or the class, that defines a driver class with ``name=``: defining it registers it."""
    global _integrations_loaded
    with _lock:
        if not _integrations_loaded:
            _integrations_loaded = True  # set first: the modules imported below register here
            for module in INTEGRATIONS:
                importlib.import_module(module)
            for ep in entry_points(group=INTEGRATION_GROUP):
                try:
                    ep.load()
                except Exception as exc:  # noqa: BLE001 - any error of another package's code
                    log.warning("weightsync: entry point %s = %r failed to load: %s", ep.name, ep.value, exc)
        return dict(_drivers)


def public(obj: T) -> T:
    """Make ``obj`` (a class or function an engine defines) a public name of ``weightsync``; returns it.

    Raises:
        ConfigurationError: the name is another object's already.
    """
    with _lock:
        _load_before(obj)
        _check_public(obj.__name__, obj)  # type: ignore[attr-defined]
        _public[obj.__name__] = obj  # type: ignore[attr-defined]
    return obj


def register_backend(name: str, scheme: type | str, *, replace: bool = False) -> None:
    """Register ``scheme`` (a class, or ``"module:Class"`` to import on first use) under ``name``.

    A scheme class defined with ``name=`` registers itself; this is for a class defined without one, or for
    another name.

    ``replace=True`` may take a built-in's name too: receiver configs naming the built-in class are then refused
    (it is no longer a scheme by that name).

    Raises:
        ConfigurationError: ``name`` is empty or taken and ``replace`` is false.
    """
    if not name or not isinstance(name, str):
        raise ConfigurationError(f"backend name must be a non-empty string, got {name!r}")
    load()
    with _lock:
        taken = _schemes.get(_aliases.get(name, name))
        if taken is not None and not replace:
            raise ConfigurationError(f"backend {name!r} is already registered (pass replace=True to override)")
        _aliases.pop(name, None)
        _schemes[name] = scheme


def load() -> None:
    """Import weightsync's own engines and those of entry points, once (a broken entry point is logged and
    skipped, and what its import registered before it broke is taken back: another package's error does not
    take weightsync down)."""
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True  # set first: the modules imported below register here, and may ask
        try:
            for module in BUILTIN:
                importlib.import_module(module)
        except BaseException:
            _loaded = False  # asked again, it tries again (nothing is left half-registered by name)
            raise
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if _importing(ep.module):  # its import asked for the engines: its classes register as defined
                if ep.attr:  # (and one defined without name= is found by the entry point's name, when asked)
                    _schemes.setdefault(ep.name, ep.value)
                continue
            before = tuple(dict(table) for table in _tables())
            try:
                loaded = ep.load()
            except Exception as exc:  # noqa: BLE001 - any error of another package's import
                _restore(before, ep.module.partition(".")[0])
                log.warning("weightsync: entry point %s = %r failed to load: %s", ep.name, ep.value, exc)
                continue
            if isinstance(loaded, type) and ep.name not in _schemes and ep.name not in _aliases:
                _schemes[ep.name] = loaded  # a class defined without name=: the entry point names it


def schemes() -> dict[str, type | str]:
    """Every registered scheme by name, in the order registered (a ``"module:Class"`` not imported yet)."""
    load()
    with _lock:
        return dict(_schemes)


def transports() -> dict[str, Any]:
    """Every registered transport's settings class by name, in the order registered."""
    load()
    with _lock:
        return dict(_transports)


def public_names() -> dict[str, Any]:
    """Every public name engines define (scheme and transport classes, settings, what :func:`public` marked),
    each object or ``"module:Name"`` to import on first use."""
    load()
    with _lock:
        return dict(_public)


def available_backends() -> list[str]:
    """Sorted names of every registered backend (built-in, entry points and :func:`register_backend`)."""
    return sorted(schemes())


def get_backend(name: str) -> type:
    """The scheme class registered under ``name`` (aliases such as ``"mp"`` accepted).

    Raises:
        ConfigurationError: an unknown name (the message lists the known ones), or its module could not be
            imported (for example a missing optional engine).
    """
    table = schemes()
    key = _aliases.get(name, name)
    if key not in table:
        raise ConfigurationError(f"unknown weight-sync backend {name!r}; known: {sorted(table)}")
    target = table[key]
    if isinstance(target, str):
        try:
            target = resolve(target)
        except (ImportError, AttributeError) as exc:
            raise ConfigurationError(f"backend {name!r} ({table[key]}) is not available: {exc}") from exc
    return target


def resolve(path: str) -> Any:
    """The object at ``"module:Name"`` (its module imported on first use)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _same_class(taken: Any, obj: Any) -> bool:
    # A module imported twice (a test reloading it) defines a new class of the same place: it replaces the old.
    return _place(taken) == _place(obj)


def _place(obj: Any) -> str:
    return obj if isinstance(obj, str) else f"{obj.__module__}:{obj.__qualname__}"


def _describe(obj: Any) -> str:
    return obj if isinstance(obj, str) else f"{obj.__module__}.{obj.__qualname__}"


def _load_before(obj: Any) -> None:
    # weightsync's own classes register as their modules are imported (by load() or by a user's import);
    # another package's would otherwise take a name of an engine not imported yet.
    if not obj.__module__.startswith("weightsync."):
        load()


def _check_public(name: str, obj: Any) -> None:
    # A public name resolves receiver configs' and Hydra configs' targets (``weightsync.X``): another package's
    # class of the same name would silently stand in for weightsync's own there.
    taken = _public.get(name)
    if taken is not None and not _same_class(taken, obj):
        raise ConfigurationError(
            f"{_describe(obj)}: weightsync.{name} is {_describe(taken)} already: give the class another name"
        )


def _importing(module: str) -> bool:
    """Whether ``module`` is being imported now (its import asked for the engines)."""
    spec = getattr(sys.modules.get(module), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _tables() -> tuple[dict[str, Any], ...]:
    return (_schemes, _aliases, _transports, _public, _configs)


def _restore(saved: tuple[dict[str, Any], ...], package: str) -> None:
    """Take back what the modules of ``package`` registered since ``saved`` (another package its import
    imported on the way keeps what it registered: its module stays imported, and would not register again)."""
    for table, before in zip(_tables(), saved, strict=True):
        if table is _aliases:  # (an alias names a backend: it goes with it, below)
            continue
        for key in [k for k in table if table[k] is not before.get(k) and _in(table[k], package)]:
            if key in before:
                table[key] = before[key]
            else:
                del table[key]
    for alias in [a for a in _aliases if a not in saved[1] and _aliases[a] not in _schemes]:
        del _aliases[alias]


def _in(obj: Any, package: str) -> bool:
    return _place(obj).partition(":")[0].partition(".")[0] == package
