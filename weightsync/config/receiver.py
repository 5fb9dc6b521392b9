"""Receiver configs: plain data from which a worker builds its side of a scheme.

``scheme.receiver_config(worker_idx)`` returns a dict like::

    _target_: weightsync.config.make_receiver
    scheme: {_target_: weightsync.schemes.shared_mem.SharedMemWeightSyncScheme, timeout: 60.0, ...}
    model_id: policy
    worker_idx: 0
    connection: {address: "@weightsync-...", authkey_file: /run/user/0/weightsync-0/....key}

It holds no live object and no secret: the auth key stays in a file readable
only by its owner, named in ``authkey_file``, so the config can be logged or
saved with Hydra's outputs. A worker turns it into a receiver-ready scheme
with :func:`from_config` (no Hydra initialisation needed); a config written
to a file is read by it too, given as a :class:`pathlib.Path`
(``from_config(Path("worker0.yaml"))``), never through ``OmegaConf.load``,
which expands YAML aliases before anything can refuse them.

A receiver config may come from a file another host wrote, so
:func:`from_config` treats it as data and checks the whole tree before
anything in it is called (see the threat model in ``docs/security.md``):

1. it becomes a plain tree (:func:`~weightsync.config.plain.plain_tree`: strict
   YAML read from text or a file, no interpolation resolved, sizes bounded);
2. the tree must have exactly the shape ``receiver_config()`` emits: the root
   target is :func:`make_receiver`; ``scheme`` names a weightsync scheme class
   (or one under a prefix the *caller* allowed) and holds only that class's
   constructor options, each a plain value of the option's type; ``model_id``,
   ``worker_idx`` and ``connection`` are checked field by field, the
   connection by the scheme class itself (for the local schemes: an abstract
   socket address and the key file the sender at that address writes);
3. a scheme whose receiver unpickles what the peer named in ``connection``
   sends (``rpc``) is built only if the caller opts in
   (``allow_store_peers_to_run_code=True``):
   the config decides where a worker gets its weights, never whether it runs
   what arrives.

Only then is the scheme class constructed (its constructor checks values and
starts nothing). Nothing in a config can widen the allowlist: it is an
argument of the caller, or :func:`allow_targets` in the caller's code.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import checks
from ..core.scheme import WeightSyncScheme
from ..errors import ConfigurationError
from ..registry import available_backends, get_backend, schemes
from .plain import plain_tree

__all__ = [
    "ReceiverSpec",
    "allow_targets",
    "allowed_targets",
    "check_available",
    "check_receiver_config",
    "from_config",
    "make_receiver",
    "scheme_class",
    "scheme_fields",
]

#: The target of every receiver config.
RECEIVER_TARGET = "weightsync.config.make_receiver"
_RECEIVER_TARGETS = frozenset({RECEIVER_TARGET, "weightsync.config.receiver.make_receiver"})
_ROOT_FIELDS = ("_target_", "connection", "model_id", "scheme", "worker_idx")

#: Top-level packages a prefix may not open: the standard library and the packages weightsync runs on hold
#: no third-party scheme, and plenty of callables that run code or read files.
_CLOSED_PACKAGES = frozenset(sys.stdlib_module_names) | {
    "builtins",
    "cloudpickle",
    "dill",
    "hydra",
    "numpy",
    "omegaconf",
    "pytest",
    "ray",
    "tensordict",
    "torch",
    "weightsync",
    "xxhash",
    "yaml",
}
_DOTTED = checks.text(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", max_len=200, what="a dotted module path")

_ALLOWED: list[str] = []

WORKER_IDX = checks.integer(0, 2**31 - 1)


def _prefix(prefix: Any) -> str:
    """A target prefix as a whole dotted module path (``"mypkg.schemes."`` -> ``"mypkg.schemes"``), checked."""
    if type(prefix) is not str or not prefix.strip("."):
        raise ConfigurationError(f"a target prefix must name a package or module, got {prefix!r}")
    path = _DOTTED(prefix.rstrip("."), "target prefix")
    if path.split(".")[0] in _CLOSED_PACKAGES:
        raise ConfigurationError(
            f"target prefix {prefix!r} is too broad: {path.split('.')[0]!r} is the standard library, weightsync "
            "or a package it runs on, which hold no third-party scheme; name your own package's module"
        )
    return path


def allow_targets(*prefixes: str) -> None:
    """Also let receiver configs name scheme classes under these packages or modules (``"mypkg.schemes"``).

    A prefix matches whole module paths: ``"mypkg"`` allows ``mypkg.X`` and ``mypkg.sub.X``, never
    ``mypkgx.X``. The class a config names there must still be a :class:`WeightSyncScheme` subclass, given
    only its constructor's plain checks.

    Raises:
        ConfigurationError: an empty prefix, one that is not a dotted module path, or one that opens the
            standard library, weightsync itself or a package weightsync runs on.
    """
    checked = [_prefix(p) for p in prefixes]
    for prefix in checked:
        if prefix not in _ALLOWED:
            _ALLOWED.append(prefix)


def allowed_targets() -> list[str]:
    """The packages and modules, beyond weightsync's own schemes, whose scheme classes receiver configs may name."""
    return list(_ALLOWED)


def _under(target: str, prefixes: list[str]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def _known_targets() -> dict[str, str]:
    """Every spelling of a registered scheme's target a receiver config may hold -> its registered name
    (weightsync's own, an installed package's entry point, or a class its process registered). Nothing is
    imported: a ``"module:Class"`` registration is spelled from its path."""
    out = {}
    for name, cls in schemes().items():
        module, qualname = cls.partition(":")[::2] if isinstance(cls, str) else (cls.__module__, cls.__qualname__)
        out[f"{module}.{qualname}"] = name
        if module.startswith("weightsync."):  # weightsync's own also by their public names
            short = qualname.rpartition(".")[2]
            out[f"weightsync.schemes.{short}"] = out[f"weightsync.{short}"] = name
    return out


def _import(path: str, target: str) -> Any:
    module, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(
            f"{target} is not available in this version of weightsync ({exc}); available schemes: "
            f"{available_backends()}"
        ) from exc


def scheme_class(target: Any, allow: list[str], where: str = "scheme._target_") -> type[WeightSyncScheme]:
    """The scheme class ``target`` names: a weightsync scheme, or a class under an allowed prefix.

    Imports only weightsync's own scheme modules, or a module under a prefix the caller allowed.

    Raises:
        ConfigurationError: naming ``where`` and the target, for anything else.
    """
    if type(target) is not str:
        raise ConfigurationError(f"{where} must be a string, got {target!r:.80}")
    known = _known_targets().get(target)
    if known is not None:
        return get_backend(known)
    _DOTTED(target, where)
    if target.startswith("weightsync."):
        raise ConfigurationError(
            f"receiver config refuses _target_ {target!r} at {where}: it is not a scheme of this version of "
            f"weightsync (available: {available_backends()})"
        )
    if not _under(target, allow):
        raise ConfigurationError(
            f"receiver config refuses _target_ {target!r} at {where}: a receiver config builds weightsync "
            f"schemes only ({sorted(_known_targets())[:3]}...), or scheme classes under the prefixes its "
            f"caller allowed ({allow}; see weightsync.config.allow_targets)"
        )
    cls = _import(target, target)
    if not (isinstance(cls, type) and issubclass(cls, WeightSyncScheme)):
        raise ConfigurationError(f"receiver config refuses _target_ {target!r} at {where}: not a weightsync scheme")
    return cls


def scheme_fields(cls: type[WeightSyncScheme]) -> dict[str, checks.Check]:
    """The options a receiver config may give ``cls``: its declared options (each with its own check, which
    takes plain values only), and ``transport`` (the name of one of its transports)."""
    known = _FIELDS.get(cls)
    if known is not None:
        return known
    fields: dict[str, checks.Check] = {}
    for option in getattr(cls, "OPTIONS", ()):
        fields[option.name] = _plain(option.check)
    if "strategy" in fields:  # a name here; a WeightStrategy object is for code, not configs
        fields["strategy"] = checks.one_of("tensordict", "state_dict")
    if getattr(cls, "TRANSPORTS", None):
        fields["transport"] = checks.one_of(*(t.name for t in cls.TRANSPORTS))
    _FIELDS[cls] = fields  # whole, before any other thread reads it
    return fields


_FIELDS: dict[type, dict[str, checks.Check]] = {}  # each class's, made once


def _plain(check: checks.Check) -> checks.Check:
    """``check``, on a value that must be plain: a mapping or a list is refused before ``check`` sees it."""

    def plain(value: Any, where: str) -> Any:
        if type(value) in (dict, list):
            raise ConfigurationError(f"{where} must be a plain value, got a {type(value).__name__}")
        return check(value, where)

    return plain


@dataclass(frozen=True)
class ReceiverSpec:
    """A receiver config that passed every check: what :func:`from_config` builds, and from what."""

    scheme_class: type[WeightSyncScheme]
    scheme_options: dict[str, Any]
    model_id: str
    worker_idx: int
    connection: dict[str, Any]
    #: Why building it means unpickling what a peer sends (``None``: it does not).
    unpickles: str | None


def check_receiver_config(cfg: Any, *, allow: tuple[str, ...] = ()) -> ReceiverSpec:
    """Check ``cfg`` against the receiver-config schema, calling and resolving nothing in it.

    Args:
        cfg: a dict, a ``DictConfig``, YAML text, or a YAML file as a :class:`pathlib.Path` (read strictly,
            at most 64 KiB of it).
        allow: further packages or modules whose scheme classes the config may name (this call only).

    Returns:
        What the config asks for, checked.

    Raises:
        ConfigurationError: one message naming the first place in the tree that does not fit, and why.
    """
    prefixes = [*_ALLOWED, *(_prefix(p) for p in allow)]
    tree = plain_tree(cfg, "receiver config")
    if type(tree.get("_target_")) is not str or tree["_target_"] not in _RECEIVER_TARGETS:
        raise ConfigurationError(
            f"receiver config refuses _target_ {tree.get('_target_')!r:.120} at <root>: a receiver config's "
            f"target is {RECEIVER_TARGET}"
        )
    checks.fields(tree, dict.fromkeys(_ROOT_FIELDS, None), "receiver config", required=_ROOT_FIELDS)
    model_id = checks.model_id(tree["model_id"], "model_id")
    worker_idx = WORKER_IDX(tree["worker_idx"], "worker_idx")
    scheme = tree["scheme"]
    if type(scheme) is not dict:
        raise ConfigurationError(f"scheme must be a mapping, got {checks.shown(scheme)}")
    cls = scheme_class(scheme.get("_target_"), prefixes)
    given = {k: v for k, v in scheme.items() if k != "_target_"}
    checked = checks.fields(given, scheme_fields(cls), "scheme")
    connection = tree["connection"]
    if type(connection) is not dict:
        raise ConfigurationError(f"connection must be a mapping, got {checks.shown(connection)}")
    connection = cls.check_receiver_connection(connection, model_id)
    return ReceiverSpec(cls, checked, model_id, worker_idx, connection, cls.receiver_unpickles(connection))


def from_config(
    cfg: Any,
    *,
    allow: tuple[str, ...] = (),
    allow_pickle: bool = False,
    allow_store_peers_to_run_code: bool = False,
) -> WeightSyncScheme:
    """Build the receiver a receiver config describes, after checking the whole config as data.

    Args:
        cfg: what ``scheme.receiver_config(i)`` returned, possibly after a trip through YAML: a dict, a
            ``DictConfig``, YAML text, or the YAML file as a :class:`pathlib.Path`. Give a file that came from
            elsewhere as its path (``from_config(Path(path))``): it is read and parsed strictly here, while
            ``OmegaConf.load`` would expand a few hundred bytes of YAML aliases into gigabytes before
            any check runs.
        allow: further packages or modules whose scheme classes the config may name, for this call only
            (``("mypkg.schemes",)``); see :func:`allow_targets`.
        allow_pickle: the caller trusts the peers of a scheme whose engine unpickles what they send (``ray``).
            It is that receiver's ``allow_pickle`` whatever the config says: a config never opts a worker in.
        allow_store_peers_to_run_code: needed to build an ``rpc`` receiver that joins the world the config
            names: every process that can reach that world's store can run code in this worker (see
            :class:`~weightsync.RPCWeightSyncScheme`). It is that receiver's option of the same name whatever
            the config says.

    Returns:
        A scheme ready for ``init_on_receiver(model=...)`` and ``connect()``, with ``model_id`` and
        ``worker_idx`` set. Nothing was connected, read or started.

    Raises:
        ConfigurationError: the config is not a receiver config weightsync emits (the message names the
            place and the target), a scheme that is not installed, or a receiver whose engine unpickles what
            peers send without the caller's opt-in. Nothing in the config was called.
    """
    spec = check_receiver_config(cfg, allow=allow)
    fields = scheme_fields(spec.scheme_class)
    # The caller's word, never the config's: each scheme names the option it takes it as.
    opt_ins = {"allow_pickle": allow_pickle, "allow_store_peers_to_run_code": allow_store_peers_to_run_code}
    opt_in = spec.scheme_class.RECEIVER_OPT_IN
    if spec.unpickles is not None and not opt_ins.get(opt_in, False):
        raise ConfigurationError(
            f"this receiver config builds a {spec.scheme_class.__name__} receiver, which unpickles and runs what "
            f"{spec.unpickles} sends it (that is how its engine calls functions): pass "
            f"from_config(cfg, {opt_in}=True) if you trust every process that can reach it and whoever wrote "
            "the config",
            model_id=spec.model_id,
            worker_idx=spec.worker_idx,
        )
    kwargs = dict(spec.scheme_options)
    for name, given in opt_ins.items():
        if name in fields:
            kwargs[name] = bool(given)
    try:
        scheme = spec.scheme_class(**kwargs)
    except TypeError as exc:  # a third-party constructor that does not take what its signature says
        raise ConfigurationError(f"cannot build {spec.scheme_class.__qualname__} from this config: {exc}") from exc
    scheme._prepare_receiver(model_id=spec.model_id, worker_idx=spec.worker_idx, connection=spec.connection)
    return scheme


def check_available(target: str) -> None:
    """Fail with a clear message when a scheme target (a trainer's own config) names a runtime that is not
    installed."""
    known = _known_targets().get(target)
    if known is None:
        _import(target, target)


def make_receiver(scheme: WeightSyncScheme, model_id: str, worker_idx: int, connection: Mapping[str, Any]) -> Any:
    """The target of receiver configs: ``scheme`` made receiver-ready for ``worker_idx``.

    :func:`from_config` builds the scheme itself once the config passed; ``hydra.utils.instantiate`` also
    lands here, but calls whatever targets the config names on its way, so use it only on configs you wrote.
    The caller then runs ``scheme.init_on_receiver(model=...)`` and ``scheme.connect()``.

    Raises:
        ConfigurationError: ``scheme`` is not a scheme, ``connection`` not a mapping, or a field does not fit
            the receiver-config schema.
    """
    if not isinstance(scheme, WeightSyncScheme):
        raise ConfigurationError(f"receiver config 'scheme' must build a WeightSyncScheme, got {type(scheme).__name__}")
    from omegaconf import DictConfig, OmegaConf  # a DictConfig is what hydra.utils.instantiate passes

    given: Any = connection
    if isinstance(given, DictConfig):  # as data: reading its items would resolve interpolations
        given = OmegaConf.to_container(given, resolve=False, throw_on_missing=False)
    if not isinstance(given, Mapping):
        raise ConfigurationError(f"connection must be a mapping, got {checks.shown(given)}")
    plain = plain_tree({"connection": dict(given)}, "receiver config")["connection"]
    model_id = checks.model_id(model_id, "model_id")
    scheme._prepare_receiver(
        model_id=model_id,
        worker_idx=WORKER_IDX(worker_idx, "worker_idx"),
        connection=type(scheme).check_receiver_connection(plain, model_id),
    )
    return scheme
