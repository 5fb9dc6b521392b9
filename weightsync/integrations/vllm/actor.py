"""What runs inside the Ray actor that holds a vLLM engine, for each update the Ray scheme sends it.

The Ray scheme's update is a call into the actor, which the actor runs between its other calls. Were the engine's
control calls (``start_weight_update`` ... ``finish_weight_update``) calls of their own, made after that one, a
``generate`` queued between them would compute with the new weights under the old version's name (and under async
sends, with version v+1 under v's). So the whole update is one call of the actor's: the engine begins it, loads
the version, names it, and forgets its cached prefixes, and no other call of the actor's runs in between (the
actor must run its calls one at a time: :func:`update_in_actor` refuses one that does not).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ...errors import ConfigurationError
from ...transports.ray.transport import apply_in_actor
from .clients import EngineClient, transfer_request

__all__ = ["update_in_actor"]


def update_in_actor(engine: Any, model_id: str, version: int, payload: tuple, layout: dict | None) -> int:
    """Runs inside the actor holding ``engine`` (a ``vllm.LLM``, or an object with its calls, its worker in the
    actor's process), in place of :func:`~weightsync.transports.ray.transport.apply_in_actor`:
    ``start_weight_update``, the load of ``version`` (by the weightsync backend's receiver in this process),
    ``update_weights``, ``finish_weight_update`` naming the version the engine then holds, the reset of its
    prefix cache. Returns that version.

    Raises:
        ConfigurationError: the actor runs calls side by side (threaded or async), or ``engine``'s calls are
            coroutines (an ``AsyncLLM``, whose worker is never in the actor's process).
        WeightSyncError: the load failed. The update begun is finished unnamed and the prefix cache reset
            (a load that failed inside vLLM may have changed weights already).
    """
    _one_call_at_a_time(engine)
    cache = EngineClient(engine, "the vLLM engine in this actor")  # (its reset: the one every engine gets)
    engine.start_weight_update()
    try:
        held = apply_in_actor(engine, model_id, version, payload, layout)
        engine.update_weights(transfer_request("update", {"version": held}))
    except BaseException:
        with contextlib.suppress(Exception):
            engine.finish_weight_update(weight_version=None)
        with contextlib.suppress(Exception):
            cache.reset_prefix_cache(0)
        raise
    engine.finish_weight_update(weight_version=str(held))
    cache.reset_prefix_cache(0)
    return held


def _one_call_at_a_time(engine: Any) -> None:
    """Refuse an actor that may run another call (a ``generate``) while an update loads, or an engine whose calls
    are coroutines.

    Raises:
        ConfigurationError: naming what to start the actor with instead.
    """
    if asyncio.iscoroutinefunction(getattr(engine, "start_weight_update", None)):
        raise ConfigurationError(
            f"weightsync: the Ray scheme's updates load in the actor's process, and this actor holds an "
            f"{type(engine).__name__}, whose worker runs in a process of its own: serve it with another scheme "
            "(docs/vllm.md)"
        )
    import ray

    core: Any = getattr(ray._private.worker.global_worker, "core_worker", None)
    try:
        is_async, concurrency = core.current_actor_is_asyncio(), core.current_actor_max_concurrency()
    except AttributeError:  # (not in an actor, or a Ray without these: nothing to check by)
        return
    if is_async or concurrency > 1:
        how = "async" if is_async else f"max_concurrency={concurrency}"
        raise ConfigurationError(
            f"weightsync: this actor runs calls side by side ({how}): a generate would run while an update loads, "
            "and compute with its weights under the old version's name; start the engine's actor with "
            "max_concurrency=1 and no async methods, or serve it with another scheme (docs/vllm.md)"
        )
