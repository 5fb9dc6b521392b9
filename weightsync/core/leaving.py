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

__all__ = ["shut_down_at_exit"]

log = logging.getLogger("weightsync")

#: Where the hook runs among multiprocessing's exit finalizers (higher first; its queues' own are 10 and below).
EXIT_PRIORITY = 50

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
    shutdowns, not their sum (a trainer of a policy and a value net, its workers hung: two timeouts in turn). Each
    is bounded as ``shutdown()`` is; where no thread can start (Python 3.12 starts none in an ``atexit`` hook, which
    the main process's exit runs this in), the rest are shut down in turn, here."""
    schemes = [s for s in list(_open) if not s._runtime.holds_nothing]
    if len(schemes) == 1:  # (no thread: a process forked from a threaded one starts none it can do without)
        _shut_down(schemes[0])
        return
    threads: list[threading.Thread] = []
    for scheme in schemes:
        thread = threading.Thread(target=_shut_down, args=(scheme,), name="weightsync-exit", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown"
            _shut_down(scheme)
            continue
        threads.append(thread)
    for thread in threads:
        thread.join()  # (bounded by its shutdown's own bounds)


def _shut_down(scheme: Any) -> None:
    try:
        scheme.shutdown()
    except Exception as exc:  # noqa: BLE001 - one that fails leaves the others to shut down, said
        log.warning("model %r: its shutdown at the process's exit failed: %s", scheme.model_id, exc)
