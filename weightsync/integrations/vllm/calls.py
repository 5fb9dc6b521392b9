"""How the vLLM driver runs an engine's calls: each in a thread of its own, the calls around a load (the pause,
and the engine put back to generating where they fail), and what failed as a weightsync error naming the engine
and the version."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ... import errors
from ...core.timing import shown_seconds
from ...errors import WeightSyncError

if TYPE_CHECKING:
    from .clients import EngineClient

__all__ = ["around_load", "cause", "engine_error", "gave_up", "in_thread", "turn_of"]


def in_thread(call: Any, name: str) -> concurrent.futures.Future:
    """``call()`` in a daemon thread of its own, its outcome in the future returned. (Not a pool's: a pool's
    threads are joined at interpreter exit, and an engine's call that hangs would keep the trainer from exiting.
    Calls are few, one an engine a version, each of milliseconds at least.)"""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            result = call()
        except BaseException as exc:  # noqa: BLE001 - the future carries it to whoever waits
            future.set_exception(exc)
        else:
            future.set_result(result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


@contextlib.contextmanager
def turn_of(turn: threading.Lock, name: str, timeout: float) -> Iterator[float]:
    """Hold ``turn`` (an engine's calls are made one at a time) for calls of the engine ``name`` that share
    ``timeout`` from now, waiting at most that long for it: yields their deadline (``time.monotonic()``).

    Raises:
        SyncTimeoutError: the engine's earlier calls did not return within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    if not turn.acquire(timeout=timeout):
        error = errors.SyncTimeoutError(f"{name}: its previous calls did not return within {shown_seconds(timeout)}")
        error.made = False  # type: ignore[attr-defined]  # (none reached the engine, which runs none: gave_up)
        raise error
    try:
        yield deadline
    finally:
        turn.release()


def gave_up(error: BaseException) -> bool:
    """Whether ``error`` ended an engine's calls at their bound while the engine may still run them (a client that
    :attr:`~.clients.EngineClient.gives_up` raises it so), rather than before they reached the engine."""
    return isinstance(error, errors.SyncTimeoutError) and getattr(error, "made", True)


def cause(error: BaseException | None) -> str:
    return f"{type(error).__name__}: {error}"


def engine_error(worker: int, version: int, error: BaseException, model_id: str | None) -> WeightSyncError:
    if isinstance(error, (errors.SyncTimeoutError, errors.WorkerDiedError)) and error.worker_idx is None:
        # A client's, which names the engine alone: a call that ends past the send it was for is reported by the
        # next one, and says which version it was for.
        return type(error)(error.detail, model_id=model_id, worker_idx=worker, version=version)
    if isinstance(error, WeightSyncError):
        return error
    return errors.ReceiverError(
        type(error).__name__,
        f"vLLM engine {worker} failed to serve version {version}: {error}",
        model_id=model_id,
        worker_idx=worker,
        version=version,
    )


#: What vLLM's worker answers a start while an update session is open (``_start_weight_update``, in
#: ``vllm/v1/worker/gpu_worker.py``): it refuses every start until the session is ended.
OPEN_SESSION = "already active"


def _started(start: Any, client: EngineClient, left: Any) -> None:
    """``start()``, made once more after ending the update session the engine says is open: one that a trainer
    left there (it died in an update, and this trainer's init took the engine over), or a start of this trainer's
    that timed out and began later."""
    try:
        start()
    except Exception as exc:
        if OPEN_SESSION not in str(exc):
            raise
        client.finish(None, left())
        start()


def around_load(
    client: EngineClient,
    left: Any,
    body: Any,
    mode: str,
    timeout: float,
    before: Any = None,
    start: bool = False,
    undone: Any = None,
) -> float | None:
    """``before()``, then ``body()`` with the engine paused in ``mode`` (if it pauses, and ``mode`` is not
    ``"none"``), then the prefix cache reset; with ``start``, ``start_weight_update`` first (with the pause, where
    the engine takes both at once). The calls share the time ``left()``; a resume, and the undoing of a failed
    update, have ``timeout`` each (an engine must not stay paused because its update took all the time).
    ``undone()``, where given, runs once a failed update was ended (before the resume); where it says the engine
    serves the version all the same, the calls did not fail.

    Returns:
        The seconds from the pause (or ``body()``) to its end; ``None`` where ``undone()`` said the engine serves
        the version.

    Raises:
        Exception: the first call that failed, once the engine generates again with no update open (best effort).
    """
    pause = client.pauses and mode != "none"
    together = start and pause and client.starts_with_pause
    begun = paused = False  # set before each call: one that raised (timed out) may have taken effect
    started = time.perf_counter()
    try:
        if start and not together:
            begun = True
            _started(lambda: client.start(left()), client, left)
        if before is not None:
            before()
        started = time.perf_counter()
        if together:
            begun = paused = True
            _started(lambda: client.start_and_pause(mode, left()), client, left)
        elif pause:
            paused = True
            client.pause(mode, left())
        body()  # (an update's ends with finish_weight_update: the session it began is over)
        begun = False
    except BaseException:
        # The engine back to generating with no update open, best effort (the failure raised is the first): an
        # open session refuses every later start, and a pause left on stops generation for good. Each call waits
        # behind the engine's own call in progress, if one still is (one that timed out here).
        served = False
        if begun:
            with contextlib.suppress(Exception):
                client.finish(None, timeout)
            if undone is not None:
                with contextlib.suppress(Exception):
                    served = undone()
        if paused:
            with contextlib.suppress(Exception):
                client.resume(timeout)
        elif begun:  # a load that failed here may have changed the weights in the engine all the same
            with contextlib.suppress(Exception):
                client.reset_prefix_cache(timeout)
        if not served:
            raise
        return None
    if paused:
        client.resume(timeout)
    else:  # pausing cleared it; an engine not paused has nothing in flight to keep its cache for
        client.reset_prefix_cache(left())
    return time.perf_counter() - started
