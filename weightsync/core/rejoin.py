"""Taking restarted workers back: a thread of the sender's own, once the rendez-vous is over."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Admitter", "stop_thread"]

log = logging.getLogger("weightsync.core")

#: Seconds the admitter waits for the sender's lock before it looks again whether it must stop.
LOCK_POLL_S = 0.1


def stop_thread(thread: threading.Thread | None, stop: threading.Event, timeout: float, what: str) -> None:
    """Ask ``thread`` to stop and wait for it, at most ``timeout`` (logged if it did not stop in time)."""
    if thread is None:
        return
    stop.set()
    if timeout > 0 and thread is not threading.current_thread():
        thread.join(timeout)
    if thread.is_alive() and timeout > 0:
        log.error("the %s thread did not stop within %.1fs", what, timeout)


class Admitter:
    """Admits restarted workers from a thread of its own.

    ``poll()`` waits a little (about 0.1 s) for a worker asking to rejoin and returns it, or ``None``; it
    raises ``EOFError`` when there is nothing more to wait on. ``admit(candidate)`` runs under ``lock`` (the
    sender's, so never during a send); ``discard(candidate)`` turns it away at shutdown.

    Both read what a connecting process sent, so neither may end the thread: any other exception is logged
    and the thread goes on with the next peer (after :data:`LOCK_POLL_S`, should ``poll`` keep failing at
    once). It stops within :data:`LOCK_POLL_S` plus one ``poll`` once asked, unless an admission is under way.
    """

    def __init__(
        self,
        name: str,
        lock: threading.RLock,
        poll: Callable[[], Any],
        admit: Callable[[Any], None],
        discard: Callable[[Any], None],
    ) -> None:
        self._lock, self._poll, self._admit, self._discard = lock, poll, admit, discard
        self.stop_event = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _locked(self) -> bool:
        # The trainer may hold the lock for a whole send, or be shutting down (and joining this thread).
        while not self._lock.acquire(timeout=LOCK_POLL_S):
            if self.stop_event.is_set():
                return False
        if self.stop_event.is_set():
            self._lock.release()
            return False
        return True

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                candidate = self._poll()
            except EOFError:
                return
            except Exception:  # a peer's bytes broke a check: that peer is lost, the next may come
                log.exception("the rejoin thread failed to read a connecting process; it goes on")
                self.stop_event.wait(LOCK_POLL_S)
                continue
            if candidate is None:
                continue
            if not self._locked():
                self._quietly(self._discard, candidate)
                return
            try:
                self._quietly(self._admit, candidate)
            finally:
                self._lock.release()

    @staticmethod
    def _quietly(step: Callable[[Any], None], candidate: Any) -> None:
        try:
            step(candidate)
        except Exception:
            log.exception("the rejoin thread failed to take in a connecting process; it goes on")

    def stop(self, timeout: float) -> None:
        """End the thread (it gives up the lock within :data:`LOCK_POLL_S`); wait at most ``timeout``."""
        stop_thread(self._thread, self.stop_event, timeout, "rejoin")
