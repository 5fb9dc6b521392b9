"""Senders still open when their process exits are shut down first, before multiprocessing joins the process's
children: a worker that waits for its sender's next version never ends on its own, and a trainer that raised (or
was interrupted) with its workers started as non-daemon processes, as the README's are, hung at its exit for good
(a user's audit). Shut down, each sender says goodbye to its workers, which end.

The hook is a multiprocessing finalizer of positive priority: multiprocessing's own exit runs those before it
joins the children, in the main process (at its atexit) and in a process it started (as its target returns, where
no atexit hook runs), and a forked child starts with none of its parent's.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from multiprocessing import util
from typing import Any

from .timing import deadline_after, remaining

__all__ = ["shut_down_at_exit"]

log = logging.getLogger("weightsync")

#: Where the hook runs among multiprocessing's exit finalizers (higher first; its queues' own are 10 and below).
EXIT_PRIORITY = 50
#: How many of the longest ``timeout`` of the open senders the exit waits for their shutdowns, at most (a shutdown
#: is bounded by its ``timeout`` once per step that waits: a goodbye, then a thread's end).
JOIN_TIMEOUTS = 2.0

_open: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_hooked_in: int | None = None  # the process the hook is registered in (a forked child has to register its own)


def shut_down_at_exit(scheme: Any) -> None:
    """Shut ``scheme`` (a sender) down as this process exits, if it is still open then (bounded as its
    ``shutdown()`` is: the open senders side by side). Holds no strong reference to it."""
    global _hooked_in
    with _lock:
        if _hooked_in != os.getpid():
            util.Finalize(None, _shut_down_open, exitpriority=EXIT_PRIORITY)
            _hooked_in = os.getpid()
        _open.add(scheme)


def _shut_down_open() -> None:
    """Shut the open senders down side by side, each in a thread of its own: the exit takes the longest of their
    bounds, not their sum (a trainer of a policy and a value net, its workers hung: two timeouts in turn)."""
    schemes = list(_open)
    threads = [threading.Thread(target=_shut_down, args=(s,), name="weightsync-exit", daemon=True) for s in schemes]
    for thread in threads:
        thread.start()
    deadline = deadline_after(max((float(s.timeout) for s in schemes), default=0.0) * JOIN_TIMEOUTS)
    for scheme, thread in zip(schemes, threads):
        thread.join(remaining(deadline))
        if thread.is_alive():
            log.warning("model %r: its shutdown at the process's exit did not end in time; left", scheme.model_id)


def _shut_down(scheme: Any) -> None:
    try:
        scheme.shutdown()
    except Exception as exc:  # noqa: BLE001 - one that fails leaves the others to shut down, said
        log.warning("model %r: its shutdown at the process's exit failed: %s", scheme.model_id, exc)
