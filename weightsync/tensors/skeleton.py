"""A worker's model that came without its weights (on the meta device, as TorchRL's collectors send a policy): it is
given memory by its first update, or refused at once where no update would fill it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigurationError, WeightMismatchError
from .strategy import flatten_weights

__all__ = ["filled", "materialize"]


def filled(model: Any, extract_as: str, **where: Any) -> dict[str, torch.Tensor]:
    """``model``'s tensors in the ``extract_as`` format, which updates fill; a skeleton model (on the meta device)
    is refused where they would leave part of it without data (``state_dict`` leaves non-persistent buffers out),
    for its first forward pass would fail far from here.

    Raises:
        WeightMismatchError: naming the tensors no update fills.
    """
    flat = flatten_weights(model, extract_as)
    if not isinstance(model, nn.Module) or extract_as == "tensordict":  # (it carries every parameter and buffer)
        return flat
    carried = {id(t) for t in flat.values()}
    left = sorted(k for k, t in flatten_weights(model, "tensordict").items() if t.is_meta and id(t) not in carried)
    if left:
        raise WeightMismatchError(
            missing=left,
            why=f"this worker's model has them on the meta device (no data), and strategy {extract_as!r} does not "
            "carry them (non-persistent buffers): use strategy 'tensordict', which carries every buffer, or give "
            "the worker a model that holds them (TorchRL: the collector's policy_factory=)",
            **where,
        )
    return flat


def materialize(
    model: Any, dst: dict[str, torch.Tensor], pieces: list[tuple[int, torch.Tensor]], extract_as: str, **where: Any
) -> dict[str, torch.Tensor]:
    """Give every tensor of ``dst`` (``model``'s, in the ``extract_as`` format) on the meta device real memory where
    the update's bytes are (its ``pieces``: ``(offset, bytes)``), for the update to be placed into; return ``dst``,
    read anew where a tensor object had to be replaced.

    A tensor is swapped for a real one in place: the same object, so what holds it (an optimizer, TorchRL's
    collector) sees the memory. Where torch refuses (a weak reference to it: ``nn.LSTM`` and ``nn.GRU`` keep them to
    their weights), its module is given memory by torch's own ``to_empty``, which new tensor objects take.

    Raises:
        ConfigurationError: such a module also holds tensors with data, which ``to_empty`` would lose; or the model
            is not a module.
    """
    device = pieces[0][1].device if pieces else torch.device("cpu")
    stuck: dict[int, str] = {}
    for key, tensor in dst.items():
        if tensor.is_meta:
            real = torch.empty_like(tensor, device=device)
            if isinstance(tensor, nn.Parameter):
                real = nn.Parameter(real, requires_grad=tensor.requires_grad)
            try:
                torch.utils.swap_tensors(tensor, real)  # the same tensor object (a Parameter stays one), now real
            except RuntimeError:  # (weak references to it)
                stuck[id(tensor)] = key
    if not stuck:
        return dst
    owners = [
        (module, [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None])
        for module in (model.modules() if isinstance(model, nn.Module) else ())
    ]
    owners = [(module, own) for module, own in owners if any(id(t) in stuck for t in own)]
    for module, own in owners:  # (all checked before any is changed)
        tied = [t for t in own if sum(any(t is u for u in other) for _, other in owners) > 1]
        if tied or not all(t.is_meta for t in own):
            raise ConfigurationError(
                f"{sorted(stuck.values())} of this worker's model are on the meta device and cannot be given memory "
                f"in place (weak references to them), and their module {type(module).__name__} "
                + ("shares them with another (tied)" if tied else "holds weights with data too")
                + ": give the worker its model with data",
                **where,
            )
    for module, _ in owners:
        module.to_empty(device=device, recurse=False)  # (nn.RNNBase lets go of its weak references first)
    fresh = flatten_weights(model, extract_as)
    left = sorted(k for k, t in fresh.items() if t.is_meta)
    if left:  # (not a module: nothing to give them memory through)
        raise ConfigurationError(
            f"{left} of this worker's model are on the meta device and cannot be given memory in place (weak "
            "references to them): give the worker its model with data",
            **where,
        )
    return fresh
