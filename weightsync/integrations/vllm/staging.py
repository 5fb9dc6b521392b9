"""Taking each version off the transport while an engine generates, and applying it when the engine loads it.

An inference engine stops generating to load a version; the bytes' trip need not stop it. A :class:`Stager`
takes each version as soon as the trainer publishes it (``scheme.take``), in a thread of its own; the engine's
``update_weights`` then applies it (:meth:`Stager.apply_next`: checks, loads, acks). weightsync's vLLM backend
uses it; it needs no vLLM.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ...core.pending import PendingUpdate
from ...core.timing import remaining
from ...errors import SyncTimeoutError

__all__ = ["STAGER_POLL_S", "Stager"]

#: How long the stager waits for a version before it looks again whether it must stop (seconds).
STAGER_POLL_S = 0.05

log = logging.getLogger("weightsync.vllm")


class Stager:
    """Takes each version off ``scheme`` (a connected receiver) as soon as the trainer publishes it, in a thread
    named ``name``, while the engine goes on generating; :meth:`apply_next` applies it (checks, loads, acks). The
    engine is paused for the load, not for the bytes' trip (a ``distributed`` broadcast: it happens here). The
    receiver hands out the next version only once the one taken was applied: one at a time."""

    def __init__(self, scheme: Any, name: str) -> None:
        self.scheme = scheme
        self._cond = threading.Condition()
        self._staged: PendingUpdate | None = None
        self._error: BaseException | None = None  # what ended the taking
        self._missed: SyncTimeoutError | None = None  # a take that met a silence, since apply_next began to wait
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def cpus(self) -> frozenset[int]:
        """The CPUs the stager's thread runs on (``frozenset()`` once it ended, or where the system does not say)."""
        native = self._thread.native_id
        if not hasattr(os, "sched_getaffinity"):  # (Linux's)
            return frozenset()
        try:
            return frozenset(os.sched_getaffinity(native)) if native and self._thread.is_alive() else frozenset()
        except OSError:  # (it ended in between)
            return frozenset()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                if not self._cond.wait_for(lambda: self._staged is None or self._stop.is_set(), STAGER_POLL_S):
                    continue
            if self._stop.is_set():
                return
            try:
                pending = self.scheme.take(STAGER_POLL_S)
            except SyncTimeoutError as exc:  # a silence (a trainer stopped, then resumed): taken again, as receive()
                log.warning("%s: %s; taking again", self._thread.name, exc)
                with self._cond:
                    self._missed = exc
                self._stop.wait(STAGER_POLL_S)  # (a pause: one that comes at once again is not a busy loop)
                continue
            except BaseException as exc:  # noqa: BLE001 - the sender is gone: update_weights says so
                self._hand(None, exc)
                return
            if pending is not None:
                self._hand(pending, None)

    def _hand(self, pending: PendingUpdate | None, error: BaseException | None) -> None:
        """Hand ``apply_next`` a version taken, or the error that ended the taking."""
        with self._cond:
            self._staged, self._error = pending, error
            self._cond.notify_all()

    def apply_next(self, deadline: float) -> bool:
        """Apply the next version taken (waiting until ``deadline`` for it); ``False`` if none came in time.

        Raises:
            WeightSyncError: the receiver refused it (acked so), or the sender is gone.
            SyncTimeoutError: none came, and the transport was silent meanwhile (the stager takes on).
        """
        with self._cond:
            self._missed = None
            self._cond.wait_for(lambda: self._staged is not None or self._error is not None, remaining(deadline))
            pending, error = self._staged, self._error or self._missed
        if pending is None:
            if error is not None:
                raise error
            return False
        try:
            pending.apply()
        finally:
            with self._cond:
                self._staged = None
                self._cond.notify_all()
        return True

    def stop(self, timeout: float) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout)
