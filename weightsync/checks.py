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

import ipaddress
import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .errors import ConfigurationError

__all__ = [
    "MAX_HOST_NAME",
    "MAX_TEXT",
    "MAX_WAIT_S",
    "Check",
    "boolean",
    "fields",
    "host",
    "integer",
    "model_id",
    "no_extra",
    "number",
    "one_of",
    "optional",
    "port",
    "seconds",
    "shown",
    "text",
]

#: The longest wait any option may ask for, in seconds: one hour. A receiver config carries its sender's
#: options, so whoever wrote it chooses how long a worker may wait; an hour covers the slowest start-up of a
#: cluster job and an update of hundreds of GB over a 1 Gb/s link, and past it a wait is a hang, which a
#: worker should report rather than sit through (the bound was 11.6 days once: nobody wants that).
MAX_WAIT_S = 3600.0
#: The longest string an option may hold.
MAX_TEXT = 1024

Check = Callable[[Any, str], Any]


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for a message; never raises.

    An int of over 64 bits is described, not written out: ``repr`` refuses ints of more than 4,300 digits
    (``ValueError``), and a long one would only fill the message.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        text = f"an integer of {value.bit_length()} bits"
    else:
        try:
            text = repr(value)
        except Exception:  # a container holding a huge int, an object whose __repr__ fails
            text = f"a {type(value).__name__} that cannot be shown"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _refuse(where: str, wanted: str, value: Any) -> ConfigurationError:
    return ConfigurationError(f"{where} must be {wanted}, got {shown(value)}")


def _finite_real(value: Any) -> bool:
    """Whether ``value`` is a real number (not a bool), and finite. An int of any size is finite
    (``math.isfinite`` would raise ``OverflowError`` on one too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    if isinstance(value, numbers.Integral):
        return True
    try:
        return math.isfinite(value)
    except (OverflowError, TypeError, ValueError):
        return False


def boolean(value: Any, where: str) -> bool:
    """``True`` or ``False``, nothing else (no ``0``, no ``"yes"``)."""
    if not isinstance(value, bool):
        raise _refuse(where, "true or false", value)
    return value


def integer(lo: int, hi: int, what: str | None = None) -> Check:
    """An int (not a bool) in ``[lo, hi]`` (``what``: how the message says it)."""
    wanted = what or f"an integer in [{lo}, {hi}]"

    def check(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= int(value) <= hi:
            raise _refuse(where, wanted, value)
        return int(value)

    return check


def number(lo: float, hi: float, *, above: bool = False, what: str | None = None) -> Check:
    """A finite int or float in ``[lo, hi]`` (``(lo, hi]`` with ``above``), held as a float."""
    low = "(" if above else "["
    wanted = what or f"a finite number in {low}{lo:g}, {hi:g}]"

    def check(value: Any, where: str) -> float:
        if not _finite_real(value):
            raise _refuse(where, wanted, value)
        if value < lo or (above and value == lo) or value > hi:
            raise _refuse(where, wanted, value)
        return float(value)

    return check


def seconds(value: Any, where: str) -> float:
    """A wait bound: a positive, finite number of seconds, at most :data:`MAX_WAIT_S` (one hour)."""
    if not _finite_real(value) or not 0 < value <= MAX_WAIT_S:
        raise _refuse(where, f"a positive number of seconds, finite and at most {MAX_WAIT_S:g}", value)
    return float(value)


def within(value: Any, default: float, where: str) -> float:
    """A call's own wait bound: ``default`` for ``None``; else from 0 (look, do not wait) to :data:`MAX_WAIT_S`."""
    if value is None:
        return float(default)
    if not _finite_real(value) or not 0 <= value <= MAX_WAIT_S:
        raise _refuse(where, f"None or a number of seconds from 0 to {MAX_WAIT_S:g}", value)
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
_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
#: The longest host name: 253 characters (RFC 1035's 255 octets on the wire, less the length octets).
MAX_HOST_NAME = 253


def host(value: Any, where: str) -> str:
    """A host name or IP address (``"10.0.0.1"``, ``"node-3.cluster"``, ``"::1"``, ``"fe80::1%eth0"``).

    An IPv4 or IPv6 literal, or a name that encodes to IDNA (``"bücher.example"`` is ``xn--bcher-kva.example``)
    with labels of 1 to 63 letters, digits, ``_`` or ``-`` (not at either end) and at most 253 characters in
    all (RFC 1035), a final dot allowed. Checked here so that a name the resolver would refuse later
    (``UnicodeError`` for a label of 64 characters) is a :class:`ConfigurationError` naming ``where``.
    """
    wanted = "a host name or IP address (labels of at most 63 letters, digits, - or _, at most 253 in all)"
    if not isinstance(value, str) or not 0 < len(value) <= MAX_HOST_NAME or not value.isprintable():
        raise _refuse(where, wanted, value)
    try:
        ipaddress.ip_address(value)
        return str(value)
    except ValueError:
        pass
    name = value[:-1] if value.endswith(".") else value
    try:
        ascii_name = name.encode("idna").decode("ascii")
    except UnicodeError:  # an empty label, one over 63 characters, a character IDNA refuses
        raise _refuse(where, wanted, value) from None
    labels = ascii_name.split(".")
    if len(ascii_name) > MAX_HOST_NAME or not all(_LABEL.fullmatch(label) for label in labels):
        raise _refuse(where, wanted, value)
    return str(value)


#: A TCP port.
port = integer(1, 65535)


def no_extra(given: Iterable[str], takes: Iterable[str], where: str) -> None:
    """Refuse the keyword arguments in ``given`` that ``where`` does not take (``takes``).

    Raises:
        ConfigurationError: naming every such argument.
    """
    extra = sorted(set(given) - set(takes))
    if extra:
        raise ConfigurationError(f"{where} got unexpected arguments: {extra}")


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
    out: dict[str, Any] = {}
    for k, v in given.items():
        check = checks[k]
        out[k] = v if check is None else check(v, f"{where}.{k}")
    return out
