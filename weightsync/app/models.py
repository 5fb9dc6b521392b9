"""The main job's synthetic models: how one is built from its spec, and the checksum every worker reports.

The trainer and every worker, a process or a Ray actor, build the same model from
the same spec and hash what they hold the same way, so a report compares as is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch import nn

from ..errors import ConfigurationError
from ..tensors.strategy import WeightStrategy

__all__ = ["ModelSpec", "build_model", "checksum", "model_specs"]


@dataclass
class ModelSpec:
    """A synthetic float32 model: ``size_mb`` megabytes split into ``tensors`` tensors."""

    size_mb: float = 8.0
    tensors: int = 4


def model_specs(models: Any) -> dict[str, dict[str, Any]]:
    """Each model's spec (``size_mb``, ``tensors``) from the job's ``models`` config (name: its fields; a field left
    out takes :class:`ModelSpec`'s default). Its values are untyped, so that a model can be added from the command
    line (``'+models.critic={size_mb:1}'``: omegaconf 2.3 cannot assign a mapping to a dataclass-typed value); they
    are checked here, against :class:`ModelSpec`.

    Raises:
        ConfigurationError: a model that is not a mapping, an unknown field, or a value of the wrong type, named
            (``models.critic.size_mb: ...``).
    """
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    out = {}
    for name in models:
        try:  # (resolved where it is: a value may name another key of the config, `${models.policy.size_mb}`)
            node = models[name]
            given = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else None
        except OmegaConfBaseException as exc:
            raise ConfigurationError(f"models.{name}: {str(exc).splitlines()[0]}") from None
        if given is None:
            raise ConfigurationError(f"models.{name} must be a mapping of size_mb and tensors, got {node!r}")
        try:
            spec = OmegaConf.merge(OmegaConf.structured(ModelSpec), given)
            out[str(name)] = {"size_mb": float(spec.size_mb), "tensors": int(spec.tensors)}
        except ConfigKeyError as exc:
            fields = sorted(f.name for f in dataclasses.fields(ModelSpec))
            raise ConfigurationError(f"models.{name} has no field {exc.key!r}; a model takes {fields}") from None
        except OmegaConfBaseException as exc:
            key = f".{exc.key}" if getattr(exc, "key", None) is not None else ""
            raise ConfigurationError(f"models.{name}{key}: {str(exc).splitlines()[0]}") from None
    return out


def build_model(spec: dict[str, Any]) -> nn.Module:
    """A float32 model of ``spec["size_mb"]`` megabytes split into ``spec["tensors"]`` parameters."""
    size_mb, tensors = float(spec["size_mb"]), int(spec["tensors"])
    if size_mb <= 0 or tensors < 1:
        raise ConfigurationError(f"a model needs size_mb > 0 and tensors >= 1, got {size_mb} and {tensors}")
    numel = int(size_mb * 1e6 / 4 / tensors)
    if numel < 1:  # (one value each would make the model larger than asked)
        raise ConfigurationError(
            f"a model of {size_mb:g} MB holds {int(size_mb * 1e6 / 4)} float32 values: it cannot be split into "
            f"{tensors} tensors (tensors: at most that many)"
        )
    return nn.ParameterList([nn.Parameter(torch.zeros(numel)) for _ in range(tensors)])


def checksum(model: nn.Module, wire_dtype: torch.dtype | None = None) -> str:
    """A digest of the model's weights; with ``wire_dtype``, of what a worker holds after they crossed the wire
    in that dtype (each floating tensor rounded to it and cast back), which is what the scheme promises."""
    digest = xxhash.xxh3_128()  # at memory speed: every worker hashes every version it applies
    for key, tensor in sorted(WeightStrategy().flat(model).items()):
        if wire_dtype is not None and tensor.dtype.is_floating_point:
            tensor = tensor.to(wire_dtype).to(tensor.dtype)
        digest.update(key.encode())
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()
