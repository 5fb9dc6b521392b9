"""A version's load done while the engine generates, made current in the pause: vLLM's reload on a shadow model.

vLLM's layerwise reload (what :meth:`~weightsync.integrations.vllm.backend.WeightsyncEngine._load` runs) puts
each layer back in checkpoint form, loads the checkpoint's tensors into it, runs the processing vLLM runs after
loading a checkpoint (the CPU backend packs each linear weight for oneDNN, and computes with the packed copy),
then copies what that made into the layer's own tensors, which the engine's kernels (and CUDA graphs) point at.
The engine stands still for all of it; on CPU the processing is most of it.

:func:`prepare` runs the same steps, with vLLM's own functions, on a *shadow* of the model: for each layer a
copy of the module object (its configuration, its ``quant_method``) holding tensors of its own, in checkpoint
form, which the model's own ``load_weights`` fills (the same names, fusions and shards as a reload; each loader
runs once, where vLLM's reload runs it twice: :func:`_note_loads`). The live layers are not touched: the engine
goes on generating with them. :meth:`Prepared.commit`, in the pause, then does what the end of vLLM's reload does
for each processed layer: copies its processed tensors into the live layer's and hands the live layer what the
processing set on it besides tensors (the packed weights' kernels).

A layer shaped otherwise than this expects (deferred attention weights, a processed tensor that does not fit
the live one) makes :func:`prepare` return ``None``: the version is then loaded by vLLM's reload in the pause,
as before. The shadow holds one more copy of the model's weights (processed) between the two.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
from vllm.model_executor.layers.attention import is_deferred_attention_layer
from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _layerwise_process, get_layerwise_info
from vllm.model_executor.model_loader.reload.meta import (
    SKIP_LOAD_TENSORS,
    SKIP_TENSORS,
    materialize_layer,
    restore_layer_on_meta,
)
from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel
from vllm.model_executor.model_loader.reload.utils import get_layer_tensors
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

__all__ = ["Prepared", "prepare"]

log = logging.getLogger("weightsync.vllm")

#: A module's own bookkeeping, which a shadow gets fresh and never hands back.
_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


@dataclass
class _Shadow:
    """A live layer, its shadow (a copy of the module object), and the shadow's attributes as copied."""

    live: torch.nn.Module
    copy: torch.nn.Module
    before: dict[str, Any]

    @classmethod
    def of(cls, live: torch.nn.Module) -> _Shadow:
        shadow = copy.copy(live)
        return cls(live, shadow, dict(shadow.__dict__))

    def hand_attributes(self) -> None:
        """Give the live layer what the processing set on the shadow besides tensors (on CPU, ``cpu_linear``: the
        kernel holding the packed weight), and drop what it removed; nothing else (what the engine changed on the
        live layer since the copy stays)."""
        mine, theirs, before = self.live.__dict__, self.copy.__dict__, self.before
        for key, value in theirs.items():
            if key not in _MODULE_STATE and (key not in before or before[key] is not value):
                mine[key] = value
        for key in before.keys() - theirs.keys() - _MODULE_STATE:
            mine.pop(key, None)


@dataclass
class Prepared:
    """A version processed off to the side: ``layers``, each live layer the version changes with its shadow
    (processed); ``retied``, the live layers that compute with another layer's weight (a tied ``lm_head``) with a
    shadow processed from that weight's new value."""

    layers: list[_Shadow]
    retied: list[_Shadow]

    def commit(self) -> None:
        """Make the version current (the engine must not be computing: it is paused)."""
        for layer in self.layers:
            # (vLLM's reload copies the same way: the engine's kernels and CUDA graphs keep their tensors)
            for kind in ("_parameters", "_buffers"):
                theirs: dict[str, Any] = getattr(layer.copy, kind)
                for name, tensor in getattr(layer.live, kind).items():
                    if tensor is not None:
                        tensor.data.copy_(theirs[name])
            layer.hand_attributes()
        for layer in self.retied:
            layer.hand_attributes()


def prepare(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    tied: list[torch.nn.Module],
) -> Prepared | None:
    """Load and process ``tensors`` (checkpoint names) into a shadow of ``model``, leaving ``model`` as it is;
    ``None`` where a layer is not one this can prepare (the caller then reloads in place). ``tied``: the layers
    that compute with a weight another layer owns. Call it under vLLM's config (``set_current_vllm_config``)
    and ``torch.no_grad()``."""
    shadows: dict[int, torch.nn.Module] = {}
    pairs: list[_Shadow] = []
    root = _shadow_tree(model, shadows, pairs)
    loaded: set[int] = set()  # the shadows a loader wrote to
    for pair in pairs:
        live, shadow = pair.live, pair.copy
        info = LAYERWISE_INFO.get(live)
        if info is None:  # vLLM recorded no checkpoint form for it: it cannot be reloaded layer by layer
            _not_prepared(live, "vLLM recorded no checkpoint form of it")
            return None
        mine = get_layerwise_info(shadow)
        params, buffers = info.restore_metadata
        mine.restore_metadata = (
            {name: _copy_of(t, live, shadow, meta=True) for name, t in params.items()},
            {name: _copy_of(t, live, shadow, meta=True) for name, t in buffers.items()},
        )
        mine.restore_device = info.restore_device
        restore_layer_on_meta(shadow, mine)
        materialize_layer(shadow, mine)
        _note_loads(shadow, loaded)
    torchao = root.__dict__.get("_do_torchao_reload")
    root.__dict__["_do_torchao_reload"] = False  # (as vLLM's reload sets it: no second reload from within)
    try:
        load_weights: Any = root.load_weights
        load_weights(iter(tensors.items()))
    finally:
        if torchao is None:
            del root.__dict__["_do_torchao_reload"]
        else:
            root.__dict__["_do_torchao_reload"] = torchao

    changed: list[_Shadow] = []
    for pair in pairs:
        if id(pair.copy) in loaded:  # (a layer the version does not load keeps its weights, as in vLLM's reload)
            if is_deferred_attention_layer(pair.copy):
                _not_prepared(pair.live, "an attention layer whose weights vLLM loads after all others")
                return None
            _layerwise_process(pair.copy, get_layerwise_info(pair.copy))
            changed.append(pair)
        LAYERWISE_INFO.pop(pair.copy, None)
    for pair in changed:
        if not _fits(pair.live, pair.copy):
            _not_prepared(pair.live, "its processed tensors differ from its own, or it has buffers no checkpoint has")
            return None
    retied: list[_Shadow] = []
    owners: dict[int, tuple[torch.nn.Module, str]] = {}  # each parameter's first layer (its owner), its name there
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), (module, name))
    processed = {id(pair.live) for pair in changed}
    for live in tied:
        again = _retie(live, owners, shadows, processed)
        if again is None:
            _not_prepared(live, "the layer owning the weight it computes with was not found")
            return None
        if again.copy is not live:
            retied.append(again)
    return Prepared(changed, retied)


def _note_loads(shadow: torch.nn.Module, loaded: set[int]) -> None:
    """Have each loader of ``shadow``'s tensors note in ``loaded`` that it wrote to ``shadow``.

    vLLM's reload wraps each loader to count the elements each call writes (the call run once more, on meta
    tensors, under a dispatch mode): it buffers each layer's loads until the count says the layer is whole, so
    that only a layer at a time is held in checkpoint form. The shadow holds all of them anyway: its tensors are
    made first, the model's loaders write into them once, and each layer written to is processed after the
    whole version is loaded (a layer loaded in part, which vLLM's reload processes at its end, included).
    """
    for name, tensor in get_layer_tensors(shadow).items():
        if name not in SKIP_LOAD_TENSORS:  # (vLLM's loading loop falls back to its default loader, as here)
            loader = getattr(tensor, "weight_loader", default_weight_loader)
            tensor.weight_loader = _noting(loader, loaded, id(shadow))


def _noting(loader: Any, loaded: set[int], key: int) -> Any:
    def noting_loader(*args: Any, **kwargs: Any) -> Any:
        loaded.add(key)
        return loader(*args, **kwargs)

    return noting_loader


def _not_prepared(layer: torch.nn.Module, why: str) -> None:
    log.info("weightsync: a version is loaded in the pause, not before it: %s: %s", type(layer).__name__, why)


def _shadow_tree(
    module: torch.nn.Module,
    shadows: dict[int, torch.nn.Module],
    pairs: list[_Shadow],
) -> torch.nn.Module:
    """A copy of ``module``'s tree of objects (a module met twice is copied once): each copy shares its original's
    attributes but holds its parameters, buffers and children in containers of its own; the layers that hold
    tensors are added to ``pairs``, with copies of the tensors vLLM keeps out of its checkpoint form (``bias``)."""
    if id(module) in shadows:
        return shadows[id(module)]
    pair = _Shadow.of(module)
    shadow = shadows[id(module)] = pair.copy
    shadow._parameters, shadow._buffers = {}, {}
    shadow._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    shadow._modules = {n: None if c is None else _shadow_tree(c, shadows, pairs) for n, c in module._modules.items()}
    if any(t is not None for t in (*module._parameters.values(), *module._buffers.values())):
        pairs.append(pair)
        for name, param in module._parameters.items():
            if param is not None and name in SKIP_TENSORS:
                shadow._parameters[name] = _copy_of(param, module, shadow, meta=False)  # type: ignore[assignment]
        for name, buffer in module._buffers.items():
            if buffer is not None and name in SKIP_TENSORS:
                shadow._buffers[name] = _copy_of(buffer, module, shadow, meta=False)
    return shadow


def _copy_of(tensor: torch.Tensor, live: torch.nn.Module, shadow: torch.nn.Module, meta: bool) -> torch.Tensor:
    """A copy of ``live``'s ``tensor`` for ``shadow`` (on the meta device if ``meta``, else a copy of its values):
    its class and attributes, its weight loader vLLM's own (not a reload's wrapper) and bound to ``shadow``. vLLM
    keeps the checkpoint form's tensors and wraps their loaders in place when it reloads: the shadow's must not
    share any of that."""
    clone = tensor.data.to("meta") if meta else tensor.data.clone()
    clone.__class__ = tensor.__class__
    attributes = tensor.__dict__.copy()
    for key, value in attributes.items():
        while getattr(value, "__name__", None) == "online_process_loader":  # (vLLM's parameters keep their
            value = value.__wrapped__  # loader as ``_weight_loader`` behind a property, others as ``weight_loader``)
        if isinstance(value, MethodType) and (value.__self__ is live or value.__self__ is layer_ref_sentinel):
            value = value.__func__.__get__(shadow)
        attributes[key] = value
    clone.__dict__ = attributes
    return clone


def _fits(live: torch.nn.Module, shadow: torch.nn.Module) -> bool:
    """Each tensor of ``live`` has a processed counterpart in ``shadow`` of its shape, dtype and device, and none
    is a buffer left out of the checkpoint (vLLM's reload keeps such a buffer's value unless it was loaded,
    which the shadow does not tell)."""
    if live._non_persistent_buffers_set:
        return False
    for kind in ("_parameters", "_buffers"):
        mine, theirs = getattr(live, kind), getattr(shadow, kind)
        for name, tensor in mine.items():
            new = theirs.get(name)
            if tensor is not None and (
                new is None or new.shape != tensor.shape or new.dtype != tensor.dtype or new.device != tensor.device
            ):
                return False
    return True


def _retie(
    live: torch.nn.Module,
    owners: dict[int, tuple[torch.nn.Module, str]],
    shadows: dict[int, torch.nn.Module],
    processed: set[int],
) -> _Shadow | None:
    """A shadow of the tied layer ``live`` holding the new values of the weights it shares (its owners' shadows',
    processed), processed as ``live`` processes them; one whose copy is ``live`` itself if none of its owners
    changed (nothing to do), ``None`` if one is not found. ``owners``: each parameter's first layer and name
    there."""
    pair = _Shadow.of(live)
    pair.copy._parameters = params = {}
    changed = False
    for name, param in live._parameters.items():
        if param is None:
            continue
        owner, name_there = owners.get(id(param), (live, name))
        if owner is live:
            return None
        changed |= id(owner) in processed
        params[name] = shadows[id(owner)]._parameters[name_there]
    if not changed:
        return _Shadow(live, live, {})
    quant_method: Any = live.quant_method
    quant_method.process_weights_after_loading(pair.copy)
    return pair
