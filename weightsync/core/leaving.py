"""Senders still open when their process exits are shut down first, before multiprocessing joins the process's
children: a worker that waits for its sender's next version never ends on its own, and a trainer that raised (or
was interrupted) with its workers started as non-daemon processes, as the README's are, hung at its exit for good
(a user's audit). Shut down, each sender says goodbye to its workers, which end."""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from typing import Any

__all__ = ["shut_down_at_exit"]

_open: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_hooked = False


def shut_down_at_exit(scheme: Any) -> None:
    """Shut ``scheme`` (a sender) down as this process exits, if it is still open then (bounded as its
    ``shutdown()`` is). Holds no strong reference to it."""
    global _hooked
    with _lock:
        if not _hooked:
            # Its exit hook, which joins the children, registered first: atexit runs ours before it.
            import multiprocessing.util  # noqa: F401

            atexit.register(_shut_down_open)
            _hooked = True
        _open.add(scheme)


def _shut_down_open() -> None:
    for scheme in list(_open):
        with contextlib.suppress(Exception):  # (one that fails leaves the others to shut down)
            scheme.shutdown()
