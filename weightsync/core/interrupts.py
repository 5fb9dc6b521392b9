"""Steps that a Ctrl-C must not cut in two: bytes taken off a stream and recorded, a frame written whole."""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

try:  # (the module under :mod:`signal`, whose wrappers turn each handler into an enum: 3.5 us a call, not 0.5)
    import _signal as _raw  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - not CPython
    _raw = signal

__all__ = ["held_interrupts"]

_SIGINT = int(signal.SIGINT)


class _Hold:
    """The main thread's hold: how many blocks are in it, the handler it stands in for, the ``SIGINT`` it caught."""

    depth = 0
    handler: Any = None
    caught: tuple[int, FrameType | None] | None = None
    frame: FrameType | None = None  # where the outermost block runs


def _gate(signum: int, frame: FrameType | None) -> None:
    """The handler while a hold is in force: the first ``SIGINT`` waits for the hold's end. Where no block is in
    force (its start or end was cut short by another signal's handler: the interrupted frame does not run in the
    outermost block's), it is handled now, and the handler put back."""
    if _Hold.depth and _running_in(frame, _Hold.frame):
        if _Hold.caught is None:
            _Hold.caught = (signum, frame)
        return
    _Hold.depth, _Hold.frame = 0, None
    _put_back()
    _Hold.handler(signum, frame)


def _running_in(frame: FrameType | None, outer: FrameType | None) -> bool:
    while frame is not None:
        if frame is outer:
            return True
        frame = frame.f_back
    return False


def _put_back() -> BaseException | None:
    """Put the handler the hold stands in for back, whatever another signal's handler raises meanwhile (a
    watchdog's alarm); what it raised, if it did."""
    raised: BaseException | None = None
    while True:
        try:
            if _raw.getsignal(_SIGINT) is not _gate:
                return raised
            _raw.signal(_SIGINT, _Hold.handler)
        except BaseException as error:  # noqa: BLE001 - the caller raises it, once the handler is back
            raised = raised or error


class held_interrupts:  # noqa: N801 - used as a context, like contextlib's lower-case ones
    """A block that a Ctrl-C does not cut in two: a ``SIGINT`` that comes while it runs is handled as it ends (its
    Python handler called then: ``KeyboardInterrupt``, by default), once.

    Python raises ``KeyboardInterrupt`` between any two steps of the main thread, right after a system call
    returned included: bytes read off a socket and not yet recorded are then lost, and the stream is out of step
    for good; a frame written in part leaves its reader waiting for the rest. Held here, the block ends first.
    Hold it only over steps whose length is bounded (a read of what is already there, a write with a deadline).

    Elsewhere than in the main thread (where Python raises no ``KeyboardInterrupt``), and where ``SIGINT`` has no
    Python handler, the block runs as it is. A block within another joins its hold; the outermost swaps the handler
    in and out (under a microsecond each). The handler is put back whatever another signal's handler raises
    meanwhile (a watchdog's alarm); where that cut a block's end short (it may, at the end's first step), the next
    ``SIGINT`` that comes outside the block is handled at once, and the handler put back.
    """

    __slots__ = ()

    def __enter__(self) -> held_interrupts:
        if threading.current_thread() is not threading.main_thread():
            return self
        if _Hold.depth:
            _Hold.depth += 1
            return self
        current = _raw.getsignal(_SIGINT)
        if current is not _gate:  # (the gate itself: left in by an end cut short, which this hold's end mends)
            if current is None or not callable(current):  # (not set from Python, the default action, ignored)
                return self
            _Hold.handler = current
        _Hold.depth, _Hold.frame = 1, sys._getframe(1)
        try:
            _raw.signal(_SIGINT, _gate)
        except BaseException:  # another signal's handler raised (before the swap or after it), or a subinterpreter
            _Hold.depth = 0
            _put_back()
            raise
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: TracebackType | None) -> None:
        if _Hold.depth == 0 or threading.current_thread() is not threading.main_thread():
            return
        _Hold.depth -= 1
        if _Hold.depth:
            return
        _Hold.frame = None
        raised = _put_back()
        handler, caught, _Hold.caught = _Hold.handler, _Hold.caught, None
        if raised is not None:
            raise raised
        if caught is not None:
            handler(*caught)
