"""The main job's synthetic models: how one is built from its spec, and the checksum every worker reports.

The trainer and every worker, a process or a Ray actor, build the same model from
the same spec and hash what they hold the same way, so a report compares as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch import nn

from ..errors import ConfigurationError
from ..tensors.strategy import WeightStrategy

__all__ = ["ModelSpec", "build_model", "checksum"]


@dataclass
class ModelSpec:
    """A synthetic float32 model: ``size_mb`` megabytes split into ``tensors`` tensors."""

    size_mb: float = 8.0
    tensors: int = 4


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
