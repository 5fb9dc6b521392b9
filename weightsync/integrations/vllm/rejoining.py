"""How a restarted vLLM engine takes a worker's place (:meth:`VLLMEngines.replace`): the gate's part."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import TYPE_CHECKING, Any

from ... import errors
from ...core.engine import SenderEngine, Sink
from ...core.timing import shown_seconds
from .calls import cause, engine_error
from .engines import VLLMEngines

__all__ = ["Rejoins"]


class Rejoins:
    """The :class:`~.gate.Gate`'s methods that put a new engine in a worker's place (its state is the gate's)."""

    engines: VLLMEngines
    scheme: Any
    core: Sink
    inner: SenderEngine | None
    _lock: threading.Lock
    _calls: dict[int, list[tuple[int, concurrent.futures.Future]]]
    _held: dict[int, int]
    _failures: dict[int, errors.WeightSyncError]
    _told: dict[int, int]
    _turns: list[threading.Lock]
    _running: dict[int, set[concurrent.futures.Future]]
    _served: dict[int, int]
    _joining: dict[int, bool]
    _abandoned: set[int]

    if TYPE_CHECKING:  # (the gate's)

        def _call(self, worker: int, version: int, steps: Any) -> concurrent.futures.Future: ...
        def _forget(self, worker: int) -> list[tuple[dict[int, Any], Any]]: ...
        def _init_steps(self, worker: int, initial: bool) -> Any: ...
        def acked(self, worker: int, held: int) -> None: ...
        def failed(self, worker: int, error: errors.WeightSyncError) -> None: ...

    @property
    def takes_back(self) -> bool:
        """A worker whose engine was replaced can join again: the scheme's engine takes workers back, or its
        updates are calls into the engine's actor (Ray's), which the scheme makes to the new one."""
        inner = self.inner
        return inner is not None and (inner.rejoins or (inner.pushes and hasattr(self.scheme, "rejoin")))

    def rejoin(self, worker: int, timeout: float) -> None:
        """``worker``'s (new) engine joins and loads the newest version, within ``timeout``. Where it cannot, the
        engine it was to replace is served as before (:meth:`_served_again`), unless the worker is dropped: it was
        (the failure named it gone), or the scheme's engine took the new engine back before its failure (the bytes
        go to the new engine from then on): then it is dropped, named."""
        assert self.inner is not None
        kept = self._forget(worker)  # (the calls of the engine it replaces, if any are left)
        with self._lock:
            self._abandoned.discard(worker)
            served = self._served.pop(worker, None)  # a new engine: named by its own updates from now on
            # Its own turn, and its own calls under way: a call of the engine it replaces that hangs holds the old.
            turn, self._turns[worker] = self._turns[worker], threading.Lock()
            running, self._running[worker] = self._running.get(worker, set()), set()
            self._joining[worker] = False
        init: concurrent.futures.Future | None = None
        try:
            init = self._call(worker, 0, self._init_steps(worker, initial=False))
            self._join(worker, init, timeout)
        except BaseException as exc:
            with self._lock:
                taken_back = self._joining.pop(worker)
                if init and not (taken_back or init.done() or self.core.is_dead(worker)):  # (the old one put back)
                    self._abandoned.add(worker)  # until the new one's init returns: its receiver joins late, or never
                    init.add_done_callback(lambda _: self._abandoned.discard(worker))
            with self.scheme._runtime.lock:  # (as the rejoin thread takes it to admit a worker)
                if taken_back and not self.core.is_dead(worker):
                    self.core.died(
                        worker, f"vLLM engine {worker} joined in place of another, then failed: {cause(exc)}"
                    )
            self._served_again(worker, kept, (turn, running), served)
            raise
        with self._lock:
            self._joining.pop(worker)
            held = self._held.pop(worker, None)
            failure = self._failures.pop(worker, None)  # (its receiver's, held while the init call ran)
        if failure is not None:
            self.core.failed(worker, failure)
        elif held is not None and not self.inner.pushes:  # its receiver's ack of the version it was taken back with
            # (Ray's: the scheme's rejoin passed it on)
            self.core.acked(worker, held)

    def _join(self, worker: int, future: concurrent.futures.Future, timeout: float) -> None:
        assert self.inner is not None
        try:
            if self.inner.pushes:  # Ray's: the scheme calls into the new actor, after the init call queued there
                self.scheme.rejoin(worker, actor=self.engines.clients[worker].target, timeout=timeout)
            future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise errors.WorkerDiedError(
                f"vLLM engine {worker} did not join within {shown_seconds(timeout)}",
                model_id=self.core.model_id,
                worker_idx=worker,
            ) from None
        except Exception as exc:
            raise engine_error(worker, 0, exc, self.core.model_id) from exc
        finally:
            with self._lock:
                self._calls.pop(worker, None)

    def _served_again(self, worker: int, kept: list[tuple[dict[int, Any], Any]], turn: Any, served: Any) -> None:
        """The engine whose new one could not join is served as before: its calls, what they are to pass on, its
        turn and its calls under way (``turn``: a call of it that hangs holds it), the version it is named after;
        and what its receiver said while the new one tried. (One that the failure dropped is gone: its calls are
        moot.)"""
        if self.core.is_dead(worker):
            return
        with self._lock:
            held, failure = self._held.pop(worker, None), self._failures.pop(worker, None)
            told = self._told.get(worker, -1)
            self._turns[worker], self._running[worker] = turn
            for where, what in kept:
                where[worker] = what
            # (its call that hung may have named a version meanwhile, or the core been told of one: the newer holds)
            self._told.update({worker: max(told, self._told[worker])} if worker in self._told else {})
            named = [v for v in (served, self._served.get(worker)) if v is not None]
            self._served.update({worker: max(named)} if named else {})
        if held is not None:
            self.acked(worker, held)
        if failure is not None:
            self.failed(worker, failure)
