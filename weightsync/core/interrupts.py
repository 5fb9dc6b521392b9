"""Steps that a Ctrl-C must not cut in two: bytes taken off a stream and recorded, a frame written whole."""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

__all__ = ["held_interrupts"]

_MAIN = threading.main_thread().ident


class held_interrupts:  # noqa: N801 - used as a context, like contextlib's lower-case ones
    """A block that a Ctrl-C does not cut in two: a ``SIGINT`` that comes while it runs is handled as it ends (its
    Python handler called then: ``KeyboardInterrupt``, by default), once.

    Python raises ``KeyboardInterrupt`` between any two steps of the main thread, right after a system call
    returned included: bytes read off a socket and not yet recorded are then lost, and the stream is out of step
    for good; a frame written in part leaves its reader waiting for the rest. Held here, the block ends first.
    Hold it only over steps whose length is bounded (a read of what is already there, a write with a deadline).

    Elsewhere than in the main thread (where Python raises no ``KeyboardInterrupt``), and where ``SIGINT`` has
    no Python handler, the block runs as it is.
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
        if threading.get_ident() == _MAIN:
            handler = signal.getsignal(signal.SIGINT)
            if isinstance(getattr(handler, "__self__", None), held_interrupts):  # (within another: it holds)
                return self
            if callable(handler):  # (not the default action, ignored, or a handler not set from Python)
                try:
                    signal.signal(signal.SIGINT, self._hold)
                except ValueError:  # not the main interpreter
                    return self
                self._handler = handler
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: TracebackType | None) -> None:
        handler, self._handler = self._handler, None
        if handler is None:
            return
        signal.signal(signal.SIGINT, handler)
        caught, self._caught = self._caught, None
        if caught is not None:
            handler(*caught)
