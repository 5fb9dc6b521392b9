"""Finding a model inside a context object by a path such as ``"env.transform[0].module"``, and the weights a
caller means."""

from __future__ import annotations

import re
from typing import Any

from .errors import ConfigurationError, InvalidWeightsError

__all__ = ["resolve_model", "resolve_weights"]

_TOKEN = re.compile(r"\s*(?:\.?([A-Za-z_][A-Za-z_0-9]*)|\[\s*(-?\d+|'[^']*'|\"[^\"]*\")\s*\])")


def _tokens(path: str) -> list[str | int]:
    out: list[str | int] = []
    pos = 0
    while pos < len(path):
        m = _TOKEN.match(path, pos)
        if not m or m.end() == pos:
            raise ConfigurationError(f"cannot parse model path {path!r} at position {pos}")
        name, index = m.groups()
        if name is not None:
            out.append(name)
        elif index[0] in "'\"":
            out.append(index[1:-1])
        else:
            out.append(int(index))
        pos = m.end()
    if not out:
        raise ConfigurationError("empty model path")
    return out


def _step(obj: Any, token: str | int) -> Any:
    if isinstance(token, int):
        return obj[token]
    if hasattr(obj, token):
        return getattr(obj, token)
    # Containers (dict, nn.ModuleDict, TensorDict) are addressed by key with the same dotted syntax.
    try:
        return obj[token]
    except (KeyError, TypeError, IndexError, NotImplementedError):  # (the last: a torch Dataset's)
        raise AttributeError(token) from None


def resolve_model(context: Any, model_id: str) -> Any:
    """Return the object that ``model_id`` names in ``context``.

    ``context.get_model(model_id)`` is used when the context provides it; otherwise,
    or where it cannot find the path (TorchRL's raises what its walk met), the path
    is walked: attribute names separated by dots, ``[i]`` to index a sequence
    (``nn.Sequential``, list) and ``["key"]`` or ``.key`` for mappings.

    Raises:
        ConfigurationError: the path does not exist; the message names the first
            segment that could not be found and what was there instead (and what
            ``get_model`` said).
    """
    getter = getattr(context, "get_model", None)
    said = ""
    if callable(getter):
        try:
            model = getter(model_id)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
            said = f" ({type(context).__name__}.get_model said {type(exc).__name__}: {exc})"
        else:
            if model is None:
                raise ConfigurationError(f"context.get_model({model_id!r}) returned None", model_id=model_id)
            return model
    obj = context
    walked = ""
    for token in _tokens(model_id):
        try:
            obj = _step(obj, token)
        except (AttributeError, IndexError, KeyError, TypeError, NotImplementedError) as exc:
            seg = f"[{token}]" if isinstance(token, int) else token
            raise ConfigurationError(
                f"model path {model_id!r}: {type(obj).__name__} at {walked or '<context>'!r} has no {seg!r}{said}",
                model_id=model_id,
            ) from exc
        walked += f"[{token}]" if isinstance(token, int) else (f".{token}" if walked else token)
    if obj is None:  # (a program given a factory of its model, and no model, may hold None there)
        raise ConfigurationError(f"model path {model_id!r} names None in {type(context).__name__}", model_id=model_id)
    return obj


def resolve_weights(weights: Any, context: Any, model_id: str | None) -> Any:
    """What ``weights`` stands for: itself (a module, a TensorDict or a dict), the model ``model_id`` names in
    ``context`` (``None``), or the model a path names in ``context`` (a string).

    Raises:
        InvalidWeightsError: nothing to read the weights from.
        ConfigurationError: the path does not exist in ``context``.
    """
    if weights is None:
        if context is None or model_id is None:
            raise InvalidWeightsError("no weights given and no model registered to read them from", model_id=model_id)
        return resolve_model(context, model_id)
    if isinstance(weights, str):
        if context is None:
            raise InvalidWeightsError(f"weights given as path {weights!r} but no context to resolve it")
        return resolve_model(context, weights)
    return weights
