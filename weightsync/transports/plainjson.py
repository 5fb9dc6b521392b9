"""JSON from outside, read as bounded plain data: the one parse of every message a peer or a store hands us.

Whoever reaches a store or a socket chooses these bytes, so :func:`loads_object` bounds everything the parse
could be made to spend or raise: the length (checked before parsing), the nesting depth (CPython's decoder
recurses once per level), the digits of an integer (``int()`` refuses more than 4,300 with a ``ValueError``,
and fewer still cost quadratic time), and the constants ``NaN`` and ``Infinity`` (not JSON) and numbers too large
for a float (``1e999``). Whatever goes
wrong ends in a :class:`~weightsync.errors.TransportError` naming what was read; nothing else escapes.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import TransportError

__all__ = ["MAX_DEPTH", "MAX_INT_DIGITS", "loads_object"]

#: The deepest nesting accepted (a layout or a verdict is 4 deep).
MAX_DEPTH = 16
#: The most digits an integer may have (a 64-bit value has 20).
MAX_INT_DIGITS = 24


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} characters (at most {MAX_INT_DIGITS} digits)")
    return int(text)


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e999: JSON syntax, but no finite number
        raise ValueError(f"{text[:24]} is out of range")
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    level = [value]
    for _ in range(limit):
        level = [
            child
            for node in level
            if isinstance(node, (dict, list))
            for child in (node.values() if isinstance(node, dict) else node)
        ]
        if not level:
            return False
    return any(isinstance(node, (dict, list)) for node in level)


def loads_object(data: bytes | str, what: str, *, max_bytes: int) -> dict[str, Any]:
    """``data`` as a JSON object of at most ``max_bytes`` bytes and :data:`MAX_DEPTH` levels.

    Args:
        data: the raw bytes (or text) as they arrived.
        what: names the source in the error (``"store key 'layout'"``, ``"a message from worker 0"``).
        max_bytes: the longest value accepted, checked before anything is parsed.

    Raises:
        TransportError: too long, not UTF-8, not JSON, nested too deep, an integer too long, ``NaN`` or
            ``Infinity``, or not a JSON object.
    """
    if len(data) > max_bytes:
        raise TransportError(f"{what} holds {len(data)} bytes, over {max_bytes}; refusing it")
    try:
        value = json.loads(data, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise TransportError(f"{what} nests deeper than {MAX_DEPTH} levels; refusing it") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors too
        raise TransportError(f"{what} is not plain JSON ({str(exc)[:120]}); refusing it") from None
    if not isinstance(value, dict):
        raise TransportError(f"{what} does not hold a JSON object; refusing it")
    if _deeper_than(value, MAX_DEPTH):
        raise TransportError(f"{what} nests deeper than {MAX_DEPTH} levels; refusing it")
    return value
