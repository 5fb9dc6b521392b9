"""Deadlines: every wait in weightsync is bounded, and measured against one clock."""

from __future__ import annotations

import time

__all__ = ["deadline_after", "remaining"]


def deadline_after(timeout: float) -> float:
    """The ``time.monotonic()`` reading ``timeout`` seconds from now."""
    return time.monotonic() + timeout


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (never negative)."""
    return max(0.0, deadline - time.monotonic())
