"""Receiver configs: plain data from which a worker builds its side of a scheme.

``scheme.receiver_config(worker_idx)`` returns a dict like::

    _target_: weightsync.config.make_receiver
    scheme: {_target_: weightsync.SharedMemWeightSyncScheme, timeout: 60.0, ...}
    model_id: policy
    worker_idx: 0
    connection: {address: "@weightsync-...", authkey_file: /run/user/0/weightsync/....key}

It holds no live object and no secret: the auth key stays in a file readable
only by its owner, named in ``authkey_file``, so the config can be logged or
saved with Hydra's outputs. A worker turns it into a receiver-ready scheme
with :func:`from_config` (no Hydra initialisation needed), which refuses any
``_target_`` outside ``weightsync.`` unless the user allowed it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigurationError
from ..schemes.base import WeightSyncScheme
from ..schemes.registry import available_backends

__all__ = ["allow_targets", "allowed_targets", "check_available", "from_config", "make_receiver"]

_ALLOWED: list[str] = ["weightsync."]


def allow_targets(*prefixes: str) -> None:
    """Also let receiver configs instantiate targets starting with these prefixes (``"mypkg.schemes."``)."""
    for prefix in prefixes:
        if not isinstance(prefix, str) or not prefix:
            raise ConfigurationError(f"target prefixes must be non-empty strings, got {prefix!r}")
        if prefix not in _ALLOWED:
            _ALLOWED.append(prefix)


def allowed_targets() -> list[str]:
    """The prefixes receiver configs may instantiate."""
    return list(_ALLOWED)


def _check_targets(node: Any, path: str, allowed: list[str]) -> None:
    if isinstance(node, Mapping):
        target = node.get("_target_")
        if target is not None and not (isinstance(target, str) and any(target.startswith(p) for p in allowed)):
            raise ConfigurationError(
                f"receiver config refuses _target_ {target!r} at {path or '<root>'}: only targets under "
                f"{allowed} may be instantiated in a worker (extend with weightsync.config.allow_targets(...))"
            )
        for key, value in node.items():
            _check_targets(value, f"{path}.{key}" if path else str(key), allowed)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _check_targets(value, f"{path}[{i}]", allowed)


def from_config(cfg: Any, *, allow: tuple[str, ...] = ()) -> Any:
    """Instantiate a receiver config (a dict, a DictConfig, or YAML text) after checking its targets.

    Args:
        cfg: what ``scheme.receiver_config(i)`` returned, possibly after a trip through YAML.
        allow: extra target prefixes allowed for this call only.

    Returns:
        What the config's ``_target_`` builds: for a receiver config, a scheme
        ready for ``init_on_receiver(model=...)`` and ``connect()``.

    Raises:
        ConfigurationError: a ``_target_`` outside the allowlist, or a backend that is not available.
    """
    from hydra.utils import instantiate
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, str):
        cfg = OmegaConf.create(cfg)
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    if not isinstance(plain, Mapping):
        raise ConfigurationError(f"a receiver config is a mapping, got {type(plain).__name__}")
    _check_targets(plain, "", [*_ALLOWED, *allow])
    check_available(plain)
    return instantiate(plain, _convert_="all")


def check_available(node: Mapping) -> None:
    """Fail with a clear message when a target names a scheme whose runtime is not installed."""
    import importlib

    stack = [node]
    while stack:
        item = stack.pop()
        target = item.get("_target_")
        if isinstance(target, str):
            module, _, attr = target.rpartition(".")
            try:
                getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise ConfigurationError(
                    f"{target} is not available in this version of weightsync ({exc}); "
                    f"available schemes: {available_backends()}"
                ) from exc
        stack.extend(v for v in item.values() if isinstance(v, Mapping))


def make_receiver(scheme: WeightSyncScheme, model_id: str, worker_idx: int, connection: Mapping[str, Any]) -> Any:
    """The target of receiver configs: ``scheme`` made receiver-ready for ``worker_idx``.

    The caller then runs ``scheme.init_on_receiver(model=...)`` and ``scheme.connect()``;
    ``model_id`` and ``worker_idx`` are already set.
    """
    if not isinstance(scheme, WeightSyncScheme):
        raise ConfigurationError(f"receiver config 'scheme' must build a WeightSyncScheme, got {type(scheme).__name__}")
    scheme._prepare_receiver(model_id=model_id, worker_idx=worker_idx, connection=dict(connection))
    return scheme
