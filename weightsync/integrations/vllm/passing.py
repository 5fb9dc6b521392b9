"""Which vLLM engines a send passes by (the gate's part): one whose calls for a version still run when it was sent a
later one, and one whose client gave up on its calls while the engine may still run them, until it answers."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ... import errors
from ...core.engine import Sink
from ...core.timing import backed_off
from ...errors import WeightSyncError
from .engines import VLLMEngines

__all__ = ["PassesBy"]

#: The longest wait before an engine whose calls gave up is asked again (seconds; or the scheme's ``timeout``).
ASK_AT_MOST_EVERY_S = 30.0


@dataclass
class _GaveUp:
    """An engine's calls for ``version`` (the newest sent to it) gave up: they are made again at ``due``
    (``time.monotonic()``), a ``timeout`` after they ended, twice as long after each time they gave up again."""

    version: int
    due: float
    misses: int = 0


class PassesBy:
    """The :class:`~.gate.Gate`'s methods that say which engines a send passes by, and make the calls again for an
    engine whose client gave up on them (its state is the gate's)."""

    engines: VLLMEngines
    core: Sink
    _lock: threading.Lock
    _calls: dict[int, list[tuple[int, concurrent.futures.Future]]]
    #: worker -> its engine's calls that gave up at their bound while the engine may still run them: it is passed by
    #: until it answers (:meth:`passes_by`), and the calls are made again (:meth:`_ask_again`)
    _gave_up: dict[int, _GaveUp]

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
        receiver acks a version, or calls made again end): with its calls' end alone, it was sent versions again,
        and each pass-by set aside the slots of those, kept for it (a slot every other send)."""
        with self._lock:
            running = any(not future.done() for _, future in self._calls.get(worker, [])[:-1])
            return running or worker in self._gave_up

    def _ask_again(self, workers: list[int]) -> None:
        """Make the calls again for the version each of ``workers`` gave up on, once due (at a look for acks), where
        none runs: an engine stuck before its update began (its calls queued behind the engine's own) loads nothing
        once it goes on, and its receiver, holding the version, never acks it. Each time they give up again the
        next are made twice as long after (up to :data:`ASK_AT_MOST_EVERY_S`): each set left calls queued in a
        stuck engine (a start, a pause, their undoing), which it runs once it goes on."""
        now = time.monotonic()
        with self._lock:
            due = [
                (w, gave_up.version)
                for w, gave_up in self._gave_up.items()
                if w in workers and w not in self._calls and now >= gave_up.due
            ]
        for worker, version in due:
            if not self.core.is_dead(worker):
                self._call(worker, version, self._update_steps(worker, version))

    def _ack(self, worker: int, held: int) -> None:
        """Pass ``worker``'s ack of ``held`` on: an engine whose calls gave up answered (its receiver loaded a
        version since: a hung load went on), and the next send reaches it."""
        with self._lock:
            self._gave_up.pop(worker, None)
        self.core.acked(worker, held)

    def _report(self, worker: int, version: int, error: WeightSyncError, hangs: bool) -> None:
        """Tell the core that ``worker``'s calls, up to those for ``version``, failed with ``error``. Where calls that
        reached the engine gave up at their bound (``hangs``; a client that
        :attr:`~.clients.EngineClient.gives_up`), the engine may still run them and no answer came: the worker is
        late on ``version`` (passed by until it answers, :meth:`passes_by`), not done with it."""
        if version and hangs and self.engines.clients[worker].gives_up and isinstance(error, errors.SyncTimeoutError):
            timeout = self.core.timeout
            with self._lock:
                before = self._gave_up.get(worker)
                misses = before.misses + 1 if before is not None else 0
                wait = backed_off(timeout, misses, max(timeout, ASK_AT_MOST_EVERY_S))
                newest = max(version, before.version if before is not None else version)
                self._gave_up[worker] = _GaveUp(newest, time.monotonic() + wait, misses)
            self.core.unanswered(worker, error)
            return
        with self._lock:  # (its engine answered)
            self._gave_up.pop(worker, None)
        self.core.failed(worker, error)
