"""A worker's model that came without its weights (on the meta device, as TorchRL's collectors send a policy): it is
given memory by its first update, or refused at once where no update would fill it."""

from __future__ import annotations

import weakref
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
        ConfigurationError: such a module also holds tensors with data, which ``to_empty`` would lose, or shares
            one (tied), which it would untie; or the model is not a module. Nothing is changed then.
    """
    device = pieces[0][1].device if pieces else torch.device("cpu")
    meta = {key: t for key, t in dst.items() if t.is_meta}
    # Weakly referenced tensors torch cannot swap: their modules are given memory whole, once every one of them
    # was checked (nothing is changed before).
    stuck = {id(t): key for key, t in meta.items() if weakref.getweakrefs(t)}
    why = (
        f"{sorted(stuck.values())} of this worker's model are on the meta device and cannot be given memory in place "
        "(weak references to them)"
    )
    if stuck and not isinstance(model, nn.Module):
        raise ConfigurationError(f"{why}: give the worker its model with data", **where)
    owners = [
        (module, [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None])
        for module in (model.modules() if stuck else ())
    ]
    owners = [(module, own) for module, own in owners if any(id(t) in stuck for t in own)]
    for module, own in owners:
        tied = len({id(t) for t in own}) < len(own) or any(
            any(t is u for t in own for u in other) for m, other in owners if m is not module
        )
        if tied or not all(t.is_meta for t in own):
            raise ConfigurationError(
                f"{why}, and their module {type(module).__name__} "
                + ("shares one of them (tied)" if tied else "holds weights with data too")
                + ": give the worker its model with data",
                **where,
            )
    for tensor in meta.values():
        if id(tensor) in stuck:
            continue
        real = torch.empty_like(tensor, device=device)
        if isinstance(tensor, nn.Parameter):
            real = nn.Parameter(real, requires_grad=tensor.requires_grad)
        torch.utils.swap_tensors(tensor, real)  # the same tensor object (a Parameter stays one), now real
    if not stuck:
        return dst
    for module, _ in owners:
        module.to_empty(device=device, recurse=False)  # (nn.RNNBase lets go of its weak references first)
    fresh = flatten_weights(model, extract_as)
    assert list(fresh) == list(dst) and not any(t.is_meta for t in fresh.values())  # (as checked above)
    return fresh
