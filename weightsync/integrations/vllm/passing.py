"""Which vLLM engines a send passes by (the gate's part): one whose calls for a version still run when it was sent a
later one, and one whose client gave up on its calls while the engine may still run them, until it answers."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import TYPE_CHECKING, Any

from ... import errors
from ...core.engine import Sink
from ...errors import WeightSyncError
from .engines import VLLMEngines

__all__ = ["PassesBy"]


class PassesBy:
    """The :class:`~.gate.Gate`'s methods that say which engines a send passes by, and make the calls again for an
    engine whose client gave up on them (its state is the gate's)."""

    engines: VLLMEngines
    core: Sink
    _lock: threading.Lock
    _calls: dict[int, list[tuple[int, concurrent.futures.Future]]]
    #: worker -> (the newest version whose calls gave up at their bound while its engine may still run them,
    #: when they ended): it is passed by until it answers (:meth:`passes_by`, :meth:`_ask_again`)
    _gave_up: dict[int, tuple[int, float]]

    if TYPE_CHECKING:  # (the gate's)

        def _call(self, worker: int, version: int, steps: Any) -> concurrent.futures.Future: ...
        def _update_steps(self, worker: int, version: int) -> Any: ...

    def passes_by(self, worker: int) -> bool:
        """An engine late on a version is sent the next, whose calls wait their turn behind the earlier's (its
        undoing: resume, the session ended): a load that outlasts one ``timeout`` is served by the next send. One
        whose calls for a version still run when it was sent a later one already (hung, or loading slower than two
        sends) is passed by until they end: sent each version, it held a slot or staging buffer of every one, and
        from the fourth send on the other engines were sent none (``shared_mem``). The newest version's calls alone
        running, it is merely slow: the next send serves it. An engine whose client gave up on its calls at their
        bound (:attr:`~.clients.EngineClient.gives_up`), which it may still run, is passed by until it answers (its
        receiver acks their version, or calls made again end): with its calls' end alone, it was sent versions
        again, and each pass-by set aside the slots of those, kept for it (a slot every other send)."""
        with self._lock:
            running = any(not future.done() for _, future in self._calls.get(worker, [])[:-1])
            return running or worker in self._gave_up

    def _ask_again(self, workers: list[int]) -> None:
        """Make the calls again for the version that each of ``workers`` gave up on, one ``timeout`` after they ended
        (the next look after it), where none runs: an engine stuck before its update began (its calls queued behind
        the engine's own) loads nothing once it goes on, and its receiver, holding the version, never acks it."""
        now = time.monotonic()
        with self._lock:
            due = [
                (w, version)
                for w, (version, ended) in self._gave_up.items()
                if w in workers and w not in self._calls and now - ended >= self.core.timeout
            ]
        for worker, version in due:
            if not self.core.is_dead(worker):
                self._call(worker, version, self._update_steps(worker, version))

    def _ack(self, worker: int, held: int) -> None:
        """Pass ``worker``'s ack of ``held`` on: an engine whose calls gave up answered, if it holds their version."""
        with self._lock:
            if self._gave_up.get(worker, (held, 0.0))[0] <= held:
                self._gave_up.pop(worker, None)
        self.core.acked(worker, held)

    def _report(self, worker: int, version: int, error: WeightSyncError, answered: bool) -> None:
        """Tell the core that ``worker``'s calls for ``version`` failed with ``error``. Where they gave up at their
        bound while the engine may still run them (:attr:`~.clients.EngineClient.gives_up`), and its receiver did
        not ack that version (``answered``), no answer came: the worker is late on that version (passed by until it
        answers, :meth:`passes_by`), not done with it."""
        gives_up = self.engines.clients[worker].gives_up
        if version and isinstance(error, errors.SyncTimeoutError) and gives_up and not answered:
            with self._lock:
                newest = max(version, self._gave_up.get(worker, (version, 0.0))[0])
                self._gave_up[worker] = (newest, time.monotonic())
            self.core.unanswered(worker, error)
            return
        with self._lock:  # (its engine answered)
            self._gave_up.pop(worker, None)
        self.core.failed(worker, error)
