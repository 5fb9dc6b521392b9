"""vLLM engines as weightsync workers (``docs/vllm.md``).

In the trainer, any weightsync scheme serves running vLLM engines given as its context
(:class:`~weightsync.integrations.vllm.engines.VLLMEngines`); in each vLLM worker process, weightsync is a
weight-transfer backend (``weight_transfer_config={"backend": "weightsync"}``), which vLLM finds through the
plugin :func:`register` (the ``vllm.general_plugins`` entry point ``weightsync``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKEND", "VLLMEngines", "VLLMWeightSyncScheme", "engine_client", "register"]

#: The backend's name in ``weight_transfer_config``.
BACKEND = "weightsync"


def register() -> None:
    """vLLM's plugin hook (run in every vLLM process): make ``"weightsync"`` a weight-transfer backend. Idempotent;
    the backend's module (and weightsync's engines) load only when an engine is built with it."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "weightsync.integrations.vllm.backend", "WeightsyncEngine")


def __getattr__(name: str) -> Any:
    if name == "VLLMEngines":
        from .engines import VLLMEngines

        return VLLMEngines
    if name == "VLLMWeightSyncScheme":
        from .scheme import VLLMWeightSyncScheme

        return VLLMWeightSyncScheme
    if name == "engine_client":
        from .engines import engine_client

        return engine_client
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
