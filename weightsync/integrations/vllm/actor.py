"""What runs inside the Ray actor that holds a vLLM engine, for each update the Ray scheme sends it.

The Ray scheme's update is a call into the actor, which the actor runs between its other calls. Were the engine's
control calls (``start_weight_update`` ... ``finish_weight_update``) calls of their own, made after that one, a
``generate`` queued between them would compute with the new weights under the old version's name (and under async
sends, with version v+1 under v's). So the whole update is one call of the actor's: the engine begins it, loads
the version, names it, and forgets its cached prefixes, and no other call of the actor's runs in between.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ...errors import ConfigurationError
from ...transports.ray.transport import apply_in_actor
from .engines import engine_client

__all__ = ["update_in_actor"]


def update_in_actor(engine: Any, model_id: str, version: int, payload: tuple, layout: dict | None) -> int:
    """Runs inside the actor holding ``engine`` (a ``vllm.LLM``, its worker in the actor's process), in place of
    :func:`~weightsync.transports.ray.transport.apply_in_actor`: ``start_weight_update``, the load of ``version``
    (by the weightsync backend's receiver in this process), ``update_weights``, ``finish_weight_update`` naming
    the version the engine then holds, the reset of its prefix cache. Returns that version.

    Raises:
        ConfigurationError: ``engine``'s calls are coroutines (an ``AsyncLLM``, whose worker is never in the
            actor's process: another scheme serves it).
        WeightSyncError: the load failed (the update begun is finished unnamed: the engine keeps its version).
    """
    if asyncio.iscoroutinefunction(getattr(engine, "start_weight_update", None)):
        raise ConfigurationError(
            f"weightsync: the Ray scheme's updates load in the actor's process, and this actor holds an "
            f"{type(engine).__name__}, whose worker runs in a process of its own: serve it with another scheme "
            "(docs/vllm.md)"
        )
    client = engine_client(engine, "the vLLM engine in this actor")
    client.start(0)  # (the timeouts are the trainer's: it waits for this call as a whole)
    try:
        held = apply_in_actor(engine, model_id, version, payload, layout)
        client.update({"version": held}, 0)
    except BaseException:
        with contextlib.suppress(Exception):
            client.finish(None, 0)
        raise
    client.finish(str(held), 0)
    client.reset_prefix_cache(0)
    return held
