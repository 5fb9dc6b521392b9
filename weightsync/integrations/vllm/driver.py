"""The driver of vLLM engines as weightsync workers: a trainer whose scheme's context is :class:`VLLMEngines`
gets its scheme's engine wrapped in a :class:`~.gate.Gate`, which makes each engine's calls around each version
(:mod:`.gate` says which, and in what order)::

    engines = VLLMEngines([llm], pause_mode="keep")
    scheme.init_on_sender(model=hf_model, context=engines)   # one worker per engine
    scheme.connect()   # each engine's weightsync backend joins and loads the trainer's weights
    scheme.send()      # returns when every engine serves the new version
"""

from __future__ import annotations

from typing import Any

from ...core.drivers import Driver
from ...core.engine import SenderEngine, Sink
from ...errors import ConfigurationError
from .engines import VLLMEngines
from .gate import Gate

__all__ = ["VLLMDriver"]


class VLLMDriver(Driver, name="vllm"):
    """vLLM engines as the core sees them: a trainer whose context is :class:`VLLMEngines`."""

    def drives(self, context: Any) -> bool:
        return isinstance(context, VLLMEngines)

    def num_workers(self, context: Any) -> int | None:
        return context.num_workers if isinstance(context, VLLMEngines) else None

    def sink(self, scheme: Any, sink: Sink) -> Sink:
        engines = scheme.context
        if not isinstance(engines, VLLMEngines):
            return sink
        if engines._gate is not None:
            raise ConfigurationError("these VLLMEngines already serve another scheme: give each scheme its own")
        gate = engines._gate = Gate(engines, scheme, sink)
        return gate

    def abandon(self, scheme: Any, sink: Sink) -> None:
        if isinstance(sink, Gate):  # (sink() bound it to the engines: they can serve another scheme)
            sink.engines._gate = None

    def around(self, scheme: Any, engine: SenderEngine) -> SenderEngine:
        gate = scheme.context._gate if isinstance(scheme.context, VLLMEngines) else None
        if not isinstance(gate, Gate):
            return engine
        gate.adopt(engine)
        return gate

    def check_receiver(self, scheme: Any, context: Any, *, knows_sender: bool) -> None:
        if isinstance(context, VLLMEngines):
            raise ConfigurationError(
                "VLLMEngines is the trainer's context (init_on_sender): an engine's receiver is built by weightsync's "
                "vLLM backend, from the receiver config the trainer sends it"
            )
