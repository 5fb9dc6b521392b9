"""Checks of plain values: what an option, a receiver config or a peer may hold.

A check takes a value and the place it came from (``"scheme.timeout"``) and
returns the value as the option holds it, as a built-in ``bool``, ``int``,
``float`` or ``str``, or raises :class:`~weightsync.errors.ConfigurationError`
naming that place. ``True`` is not an int here, and no float is infinite or
NaN. (Input from outside is made plain data first, by
:func:`weightsync.config.plain.plain_tree`; the checks themselves also take
numeric and string subclasses, as a constructor's caller may pass them.)
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .errors import ConfigurationError

__all__ = [
    "MAX_TEXT",
    "MAX_WAIT_S",
    "Check",
    "boolean",
    "fields",
    "host",
    "integer",
    "model_id",
    "number",
    "one_of",
    "optional",
    "port",
    "seconds",
    "text",
]

#: The longest wait any option may ask for, in seconds (11.6 days). Longer ones are almost surely a
#: mistake, and ``poll(2)`` counts milliseconds in a C int.
MAX_WAIT_S = 1_000_000.0
#: The longest string an option may hold.
MAX_TEXT = 1024

Check = Callable[[Any, str], Any]


def _refuse(where: str, wanted: str, value: Any) -> ConfigurationError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ConfigurationError(f"{where} must be {wanted}, got {shown}")


def boolean(value: Any, where: str) -> bool:
    """``True`` or ``False``, nothing else (no ``0``, no ``"yes"``)."""
    if not isinstance(value, bool):
        raise _refuse(where, "true or false", value)
    return value


def integer(lo: int, hi: int, what: str | None = None) -> Check:
    """An int (not a bool) in ``[lo, hi]`` (``what``: how the message says it)."""
    wanted = what or f"an integer in [{lo}, {hi}]"

    def check(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= value <= hi:
            raise _refuse(where, wanted, value)
        return int(value)

    return check


def number(lo: float, hi: float, *, above: bool = False, what: str | None = None) -> Check:
    """A finite int or float in ``[lo, hi]`` (``(lo, hi]`` with ``above``), held as a float."""
    low = "(" if above else "["
    wanted = what or f"a finite number in {low}{lo:g}, {hi:g}]"

    def check(value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise _refuse(where, wanted, value)
        if value < lo or (above and value == lo) or value > hi:
            raise _refuse(where, wanted, value)
        return float(value)

    return check


def seconds(value: Any, where: str) -> float:
    """A wait bound: a positive, finite number of seconds, at most :data:`MAX_WAIT_S`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not 0 < value <= MAX_WAIT_S
    ):
        raise _refuse(where, f"a positive number of seconds, finite and at most {MAX_WAIT_S:g}", value)
    return float(value)


def text(pattern: str | None = None, max_len: int = MAX_TEXT, what: str = "a string") -> Check:
    """A string of at most ``max_len`` characters, printable, matching ``pattern`` (whole) if given."""
    compiled = re.compile(pattern) if pattern is not None else None

    def check(value: Any, where: str) -> str:
        if not isinstance(value, str) or len(value) > max_len or not value.isprintable():
            raise _refuse(where, f"{what} of at most {max_len} printable characters", value)
        if compiled is not None and not compiled.fullmatch(value):
            raise _refuse(where, what, value)
        return str(value)

    return check


def one_of(*choices: Any) -> Check:
    """One of ``choices`` (compared by type and value)."""
    shown = [repr(c) for c in choices]
    wanted = " or ".join(shown) if len(shown) == 2 else "one of " + ", ".join(shown)

    def check(value: Any, where: str) -> Any:
        if not any(type(value) is type(c) and value == c for c in choices):
            raise _refuse(where, wanted, value)
        return value

    return check


def optional(inner: Check) -> Check:
    """``None``, or what ``inner`` accepts."""

    def check(value: Any, where: str) -> Any:
        return None if value is None else inner(value, where)

    return check


#: A model's name or path inside a context (``"policy"``, ``"env.transform[0].module"``).
model_id = text(
    r"[A-Za-z0-9_.\[\]\-/:@+]{1,200}", max_len=200, what="a model name or path (letters, digits and . _ - / : @ + [ ])"
)
#: A host name or IP address (``"10.0.0.1"``, ``"node-3.cluster"``, ``"::1"``).
host = text(r"[A-Za-z0-9_.\-:%\[\]]{1,253}", max_len=253, what="a host name or IP address")
#: A TCP port.
port = integer(1, 65535)


def fields(
    given: Mapping[str, Any], checks: Mapping[str, Check | None], where: str, required: Iterable[str] = ()
) -> dict[str, Any]:
    """``given`` checked field by field against ``checks`` (``None``: taken as it is).

    Raises:
        ConfigurationError: a field ``checks`` does not name (all of them listed, with what ``where`` takes),
            a ``required`` one missing, or the first value its check refuses.
    """
    unknown = sorted(str(k) for k in given if k not in checks)
    if unknown:
        raise ConfigurationError(f"{where} has unknown fields {unknown}; it takes {sorted(checks)}")
    missing = [k for k in required if k not in given]
    if missing:
        raise ConfigurationError(f"{where} lacks fields {missing}")
    return {k: v if checks[k] is None else checks[k](v, f"{where}.{k}") for k, v in given.items()}
