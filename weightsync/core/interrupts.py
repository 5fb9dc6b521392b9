"""Steps that a Ctrl-C must not cut in two: bytes taken off a stream and recorded, a frame written whole."""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

try:  # (the module under :mod:`signal`, whose wrappers turn each handler into an enum: 3.5 us a call, not 0.5)
    import _signal as _raw  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - not CPython
    _raw = signal

__all__ = ["held_interrupts"]

_SIGINT = int(signal.SIGINT)

_MAIN = threading.main_thread().ident
#: A hold is in force in the main thread: one entered meanwhile joins it (and costs nothing).
_holding = False


class held_interrupts:  # noqa: N801 - used as a context, like contextlib's lower-case ones
    """A block that a Ctrl-C does not cut in two: a ``SIGINT`` that comes while it runs is handled as it ends (its
    Python handler called then: ``KeyboardInterrupt``, by default), once.

    Python raises ``KeyboardInterrupt`` between any two steps of the main thread, right after a system call
    returned included: bytes read off a socket and not yet recorded are then lost, and the stream is out of step
    for good; a frame written in part leaves its reader waiting for the rest. Held here, the block ends first.
    Hold it only over steps whose length is bounded (a read of what is already there, a write with a deadline).

    Elsewhere than in the main thread (where Python raises no ``KeyboardInterrupt``), and where ``SIGINT`` has
    no Python handler, the block runs as it is. A hold swaps the handler twice (under a microsecond each).
    """

    def __init__(self) -> None:
        self._handler: Any = None
        self._caught: tuple[int, FrameType | None] | None = None

    @property
    def pending(self) -> bool:
        """A Ctrl-C came while the block ran (it is handled as the block ends)."""
        return self._caught is not None

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        if self._caught is None:
            self._caught = (signum, frame)

    def __enter__(self) -> held_interrupts:
        global _holding
        if _holding or threading.get_ident() != _MAIN or _raw.getsignal(_SIGINT) is None:
            return self  # (None: a handler not set from Python, which could not be put back)
        try:
            previous = _raw.signal(_SIGINT, self._hold)
        except ValueError:  # not the main interpreter
            return self
        if callable(previous):
            self._handler, _holding = previous, True
        else:  # the default action, or ignored: no KeyboardInterrupt to hold
            _raw.signal(_SIGINT, previous)
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: TracebackType | None) -> None:
        global _holding
        handler, self._handler = self._handler, None
        if handler is None:
            return
        _holding = False
        _raw.signal(_SIGINT, handler)
        caught, self._caught = self._caught, None
        if caught is not None:
            handler(*caught)
