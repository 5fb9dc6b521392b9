"""How the vLLM driver runs an engine's calls: each in a thread of its own, and what failed as a weightsync error
naming the engine and the version."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

from ... import errors
from ...errors import WeightSyncError

__all__ = ["cause", "engine_error", "in_thread"]


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
