"""How weights are taken out of a model and put back: :class:`WeightStrategy`."""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import ConfigurationError, InvalidWeightsError, WeightMismatchError
from .copies import write_into

__all__ = ["EXTRACT_FORMATS", "WeightStrategy", "check_spec", "flatten_weights", "weights_spec"]

EXTRACT_FORMATS = ("tensordict", "state_dict")


def _module_tensors(module: nn.Module, extract_as: str) -> dict[str, torch.Tensor]:
    """What ``named_parameters()`` then ``named_buffers()`` give (same keys, order and de-duplication of tied
    tensors), read straight from each module's own dicts: receivers walk their model at every update, and
    the generic walk costs about 1 us per tensor more."""
    if extract_as == "state_dict":
        # state_dict semantics: persistent buffers only, tied parameters under every name.
        return dict(module.state_dict(keep_vars=True))
    modules = [(f"{prefix}." if prefix else "", m) for prefix, m in module.named_modules()]
    out: dict[str, torch.Tensor] = {}
    for table in ("_parameters", "_buffers"):
        seen: set[int] = set()
        for prefix, m in modules:
            for name, tensor in getattr(m, table).items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    out[prefix + name] = tensor
    return out


def _flatten_mapping(src: Mapping, prefix: str, out: dict[str, Any]) -> None:
    for key, value in src.items():
        if not isinstance(key, str):
            if not prefix and all(isinstance(k, int) for k in src):  # (TorchRL's per-worker form)
                raise InvalidWeightsError(
                    f"weights keyed by worker index ({sorted(src)}) are not one model's weights: send each worker "
                    "its own, send(weights, worker_ids=i) (update_policy_weights_(weights, worker_ids=i))"
                )
            raise InvalidWeightsError(f"weight keys must be strings, got {key!r} ({type(key).__name__})")
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and not isinstance(value, torch.Tensor):
            _flatten_mapping(value, name + ".", out)
        elif name in out:  # (a dotted key and a nested one: the one flat name for two values)
            raise InvalidWeightsError(f"two weights are named {name!r} once flattened (a dotted key and a nested one)")
        else:
            out[name] = value


def flatten_weights(source: Any, extract_as: str = "tensordict") -> dict[str, torch.Tensor]:
    """Return ``{dotted_key: tensor}`` for a module, TensorDict or (nested or flat) dict.

    The tensors are the source's own objects (no copy): parameters stay
    ``nn.Parameter``; callers that need detached data call ``.detach()``.

    Raises:
        InvalidWeightsError: a value is not a tensor, or the source is of an unsupported type.
    """
    if isinstance(source, nn.Module):
        return _module_tensors(source, extract_as)
    if _is_tensordict(source):
        flat = source.flatten_keys(".")
        out: dict[str, Any] = {}
        for key in flat.keys(include_nested=True, leaves_only=True):
            out[key if isinstance(key, str) else ".".join(key)] = flat.get(key)
    elif isinstance(source, Mapping):
        out = {}
        _flatten_mapping(source, "", out)
    else:
        raise InvalidWeightsError(
            f"weights must be an nn.Module, a TensorDict or a dict of tensors, got {type(source).__name__}"
        )
    bad = {k: type(v).__name__ for k, v in out.items() if not isinstance(v, torch.Tensor)}
    if bad:
        raise InvalidWeightsError(f"weights must be tensors; non-tensor values at {bad}")
    return out


def check_sendable(flat: Mapping[str, torch.Tensor], *, meta_ok: bool = False, **where: Any) -> bool:
    """Raise :class:`InvalidWeightsError` naming each tensor whose bytes cannot be sent: one that is not dense in
    memory (sparse or another layout, nested, quantized), or has no data (the meta device: unless ``meta_ok``, for
    a skeleton whose weights are given at each send). Return whether some tensor is on the meta device."""
    bad = {k: why for k, t in flat.items() if (why := _not_dense(t)) is not None}
    skeleton = any(why == META for why in bad.values())
    if meta_ok:
        bad = {k: why for k, why in bad.items() if why != META}
    if bad:
        raise InvalidWeightsError(f"only dense tensors that hold data can be sent; not these: {bad}", **where)
    return skeleton


def check_finite(flat: Mapping[str, torch.Tensor], **where: Any) -> None:
    """Raise :class:`InvalidWeightsError` naming each floating-point tensor that holds NaN or Inf."""
    bad = sorted(k for k, t in flat.items() if t.is_floating_point() and not bool(torch.isfinite(t.detach()).all()))
    if bad:
        raise InvalidWeightsError(f"weights hold NaN or Inf in {bad} (check_finite=True); nothing was sent", **where)


META = "on the meta device (no data)"


def _not_dense(tensor: torch.Tensor) -> str | None:
    if tensor.is_nested:
        return "nested"
    if tensor.layout is not torch.strided:
        return str(tensor.layout).removeprefix("torch.")
    if tensor.is_quantized:
        return "quantized"
    return META if tensor.is_meta else None


def _is_tensordict(source: Any) -> bool:
    # tensordict costs seconds to import: a process that never imported it holds no TensorDict.
    if "tensordict" not in sys.modules:
        return False
    from tensordict import TensorDictBase

    return isinstance(source, TensorDictBase)


def weights_spec(flat: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{key: (shape, dtype)}`` of a flat weights dict."""
    return {k: (v.shape, v.dtype) for k, v in flat.items()}  # torch.Size compares equal to a tuple


def _fmt(spec: tuple[tuple[int, ...], torch.dtype]) -> str:
    shape, dtype = spec
    return f"{list(shape)} {str(dtype).replace('torch.', '')}"


def check_spec(
    update: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    target: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    **where: Any,
) -> None:
    """Raise :class:`WeightMismatchError` unless ``update`` and ``target`` have the same keys, shapes and dtypes."""
    if update == target:  # the common case, compared in C; the details below only for the error
        return
    missing = target.keys() - update.keys()
    extra = update.keys() - target.keys()
    mismatched = {
        k: (_fmt(update[k]), _fmt(target[k])) for k in update.keys() & target.keys() if update[k] != target[k]
    }
    if missing or extra or mismatched:
        raise WeightMismatchError(missing=missing, extra=extra, mismatched=mismatched, **where)


def check_fits(
    update: Mapping[str, tuple[tuple[int, ...], torch.dtype]], dst: Mapping[str, torch.Tensor], **where: Any
) -> None:
    """:func:`check_spec` of an update against the tensors ``dst`` it is written into, and that none is an inference
    tensor, before any is written: the copy stopped at the first such tensor, those before it written, the
    version left as it was (a user's audit: a rollout loop had replaced a buffer under ``torch.inference_mode``).

    Raises:
        WeightMismatchError: keys, shapes or dtypes differ.
        ConfigurationError: inference tensors (made under ``torch.inference_mode``, which alone may write them),
            named, where this is not inside it.
    """
    check_spec(update, weights_spec(dst), **where)
    if torch.is_inference_mode_enabled():
        return
    stuck = sorted(k for k, t in dst.items() if t.is_inference())
    if stuck:
        raise ConfigurationError(
            f"{stuck} of this worker's model are inference tensors (made under torch.inference_mode, which alone "
            "may write them): an update cannot be written into them. Change the model's tensors in place under "
            "inference_mode (tensor.copy_(...)), or make new ones outside it",
            **where,
        )


def check_sent(
    flat: Mapping[str, torch.Tensor], target: Mapping[str, tuple[tuple[int, ...], torch.dtype]], **where: Any
) -> None:
    """:func:`check_spec` of weights a caller gives against what the scheme sends; where the extra keys are other
    names of tensors given under a registered key (tied weights, as a ``state_dict()`` names them), the error says
    so, and what to send instead.

    Raises:
        WeightMismatchError: the weights do not match ``target``.
    """
    try:
        check_spec(weights_spec(flat), target, **where)
    except WeightMismatchError as exc:
        first = {(t.data_ptr(), t.shape, t.dtype): k for k, t in reversed(list(flat.items())) if k in target}
        said = {first.get((flat[k].data_ptr(), flat[k].shape, flat[k].dtype)) for k in exc.extra}
        tied = sorted(k for k in said if k is not None)
        if (
            not exc.extra
            or None in said
            or exc.missing
            or exc.mismatched
            or not all(flat[k].data_ptr() for k in exc.extra)
        ):
            raise
        raise WeightMismatchError(
            extra=exc.extra,
            why=f"they are tied to {tied} (one tensor under several names, as state_dict() "
            "gives it), and strategy 'tensordict' names such a tensor once, as named_parameters() does: send "
            "those weights, or use strategy 'state_dict', which names it under each",
            **where,
        ) from None


class WeightStrategy:
    """Extracts weights from a model and applies them back.

    Args:
        extract_as: ``"tensordict"`` (default) extracts a nested ``TensorDict`` of
            every parameter and buffer, non-persistent buffers included;
            ``"state_dict"`` extracts a flat ``dict`` with the keys of
            ``module.state_dict()`` (persistent buffers only).

    Both formats are accepted as input whatever ``extract_as`` says: an
    ``nn.Module``, a ``TensorDict`` or a dict with flat dotted keys or nested.
    """

    def __init__(self, extract_as: str = "tensordict") -> None:
        if extract_as not in EXTRACT_FORMATS:
            raise ConfigurationError(f"extract_as must be one of {EXTRACT_FORMATS}, got {extract_as!r}")
        self.extract_as = extract_as

    def __repr__(self) -> str:
        return f"WeightStrategy(extract_as={self.extract_as!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WeightStrategy) and other.extract_as == self.extract_as

    def __hash__(self) -> int:
        return hash(self.extract_as)

    def flat(self, source: Any) -> dict[str, torch.Tensor]:
        """Flat ``{dotted_key: detached tensor}`` view of ``source`` (no copy).

        Tensors that require grad are detached (non-leaf ones included), so the
        result never drags an autograd graph along.
        """
        return {k: v.detach() for k, v in flatten_weights(source, self.extract_as).items()}

    def warm(self) -> None:
        """Import what :meth:`format` needs now (tensordict costs seconds): a worker's first ``receive()`` paid
        it after its ack, and its next ack came that much later (a sender with a short ``timeout`` dropped it)."""
        if self.extract_as == "tensordict":
            import tensordict  # noqa: F401

    def format(self, flat: Mapping[str, torch.Tensor]) -> Any:
        """Pack a flat dict into this strategy's output format (no copy): a ``TensorDict`` or a ``dict``."""
        if self.extract_as == "state_dict":
            return OrderedDict(flat)
        from tensordict import TensorDict  # (imported on first use: it costs seconds)

        nested = _nested(flat)
        if nested is None:  # a key that is both a tensor and a prefix, or an empty part: tensordict decides
            return TensorDict(dict(flat), batch_size=[]).unflatten_keys(".")
        # The same TensorDict as unflattening the flat one (keys in the same order), a quarter of the cost: 0.25
        # against 1 ms for 120 tensors, which a worker pays at every receive() (on a GPU, between two sends).
        return TensorDict(nested, batch_size=[])

    def extract_weights(self, source: Any) -> Any:
        """Weights of ``source`` in this strategy's format, sharing memory with it (no copy).

        Raises:
            InvalidWeightsError: ``source`` holds non-tensor values or is of an unsupported type.
        """
        return self.format(self.flat(source))

    def check(self, weights: Any, destination: Any, **where: Any) -> None:
        """Raise :class:`WeightMismatchError` unless ``weights`` fits ``destination`` exactly."""
        check_spec(weights_spec(self.flat(weights)), weights_spec(self.flat(destination)), **where)

    def apply_weights(self, destination: Any, weights: Any, *, share: bool = False, **where: Any) -> None:
        """Write ``weights`` into ``destination`` (a module, TensorDict or dict), whole or not at all.

        Every key, shape and dtype is checked before anything is written; on a
        mismatch the destination is untouched. Parameters stay the same
        ``nn.Parameter`` objects (so optimizers and hooks keep working) and keep
        their ``requires_grad``; buffers stay buffers.

        Args:
            share: instead of copying, make each destination tensor use the
                storage of the matching source tensor (``tensor.data = src``).
                Only for CPU destinations; others are copied.

        Raises:
            WeightMismatchError: missing, extra or mismatched keys (nothing written).
            InvalidWeightsError: non-tensor values.
        """
        src = self.flat(weights)
        dst = flatten_weights(destination, self.extract_as)
        check_spec(weights_spec(src), weights_spec(dst), **where)
        write_into(dst, src, share=share)


def _nested(flat: Mapping[str, torch.Tensor]) -> dict[str, Any] | None:
    """``flat``'s dotted keys as nested dicts, in the order ``TensorDict.unflatten_keys(".")`` gives them (the keys
    without a dot first, then the others as they come); ``None`` where a key is also the prefix of another, or has
    an empty part."""
    root: dict[str, Any] = {key: value for key, value in flat.items() if "." not in key}
    for key, value in flat.items():
        if "." not in key:
            continue
        *path, leaf = key.split(".")
        node = root
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict) or not part:
                return None
        if not leaf or leaf in node:
            return None
        node[leaf] = value
    return root
