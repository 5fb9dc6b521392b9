"""Deadlines: every wait in weightsync is bounded, and measured against one clock; and logs anyone may cause,
said at most once a period."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..errors import context

__all__ = [
    "WAIT_TICK_S",
    "Progress",
    "Throttled",
    "as_timedelta",
    "backed_off",
    "deadline_after",
    "remaining",
    "shown_seconds",
    "wait_until",
]


def as_timedelta(seconds: float) -> timedelta:
    """``seconds`` as torch.distributed wants a timeout (never zero, which some of its waits read as "none")."""
    return timedelta(seconds=max(float(seconds), 0.001))


def shown_seconds(seconds: float) -> str:
    """``seconds`` as a message names a bound: ``"30s"``, ``"1.5s"``, ``"3599s"``, ``"0.04s"`` (a bound under a
    second to three significant digits, so that a short one is not shown as ``"0.0s"``; others to 0.01 s)."""
    if 0 < abs(seconds) < 1:
        return f"{seconds:.3g}s"
    return f"{seconds:.2f}".rstrip("0").rstrip(".") + "s"


def deadline_after(timeout: float) -> float:
    """The ``time.monotonic()`` reading ``timeout`` seconds from now."""
    return time.monotonic() + timeout


def backed_off(first: float, misses: int, at_most: float) -> float:
    """The wait after ``misses`` tries in a row that came to nothing: ``first``, doubled at each, at most ``at_most``
    (the doubling stops once past it: a float cannot hold 2 to the 1024th, and a long stop counts that many)."""
    return min(first * 2 ** min(misses, 64), at_most)


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (never negative)."""
    return max(0.0, deadline - time.monotonic())


def wait_until(
    done: Callable[[], bool], deadline: float, pause: float, meanwhile: Callable[[], None] | None = None
) -> bool:
    """Look at ``done()`` every ``pause`` seconds until it holds (``True``) or ``deadline`` passed (``False``),
    calling ``meanwhile()`` between two looks (a progress line, a check that raises)."""
    while not done():
        if remaining(deadline) <= 0:
            return False
        if meanwhile is not None:
            meanwhile()
        time.sleep(min(pause, remaining(deadline)))
    return True


#: How often a rendez-vous that blocks looks up from its wait (to see whether a worker process exited).
WAIT_TICK_S = 0.25
#: The longest a wait stays silent between two of its progress lines.
PROGRESS_EVERY_S = 10.0


class Progress:
    """What a long wait waits for, said at INFO: once when it has lasted a moment, then at intervals (every
    :data:`PROGRESS_EVERY_S`, or a quarter of a shorter timeout), so a user sees what is missing.

    Args:
        log: the logger to say it with.
        what: what is waited for ("the TCP store at 10.0.0.1:29500", "2 workers to connect").
        timeout: how long the wait may last.
        where: the model, worker: the context of the lines.
    """

    def __init__(self, log: Any, what: str, timeout: float, **where: Any) -> None:
        self.log, self.what, self.timeout = log, what, timeout
        self.prefix = context(**where)
        self.began = time.monotonic()
        self.every = min(PROGRESS_EVERY_S, max(timeout / 4, 0.25))
        self.next = self.began + min(1.0, self.every)

    def tick(self, status: str | Callable[[], str]) -> None:
        """Say ``status`` (a string, or a function making it, called only when due) if a line is due."""
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + self.every
        text = status() if callable(status) else status
        waited = now - self.began
        self.log.info("%swaiting for %s: %s (%.0fs of %.0fs)", self.prefix, self.what, text, waited, self.timeout)


class Throttled:
    """Warnings said at most once every ``period`` seconds for each ``key`` (whose: a user's id, say), the times
    left unsaid counted in the next one said, or by :meth:`flush`: what anyone on the host may cause (connections
    to a listener) must not grow a log without bound (a review's flood wrote 100,000 lines in 12 s), nor hide what
    others cause (a flood by one user, the refusal of another's worker)."""

    def __init__(self, log: logging.Logger, period: float = 10.0) -> None:
        self._log, self._period = log, period
        self._said: dict[Any, float] = {}
        self.unsaid: dict[Any, int] = {}

    def warning(self, msg: str, *args: Any, key: Any = None) -> None:
        now = time.monotonic()
        said = self._said.get(key, -math.inf)
        if now - said < self._period:
            self.unsaid[key] = self.unsaid.get(key, 0) + 1
            return
        unsaid = self.unsaid.pop(key, 0)
        if unsaid:
            msg = f"{msg} (and {unsaid} more like it in the {shown_seconds(now - said)} before)"
        self._log.warning(msg, *args)
        self._said[key] = now

    def flush(self, what: str) -> None:
        """Say what is left unsaid (``what``: a warning's kind, in the plural), at the end."""
        for key, unsaid in sorted(self.unsaid.items(), key=str):
            self._log.warning("%d more %s%s, unsaid", unsaid, what, "" if key is None else f" of {key}")
        self.unsaid.clear()
