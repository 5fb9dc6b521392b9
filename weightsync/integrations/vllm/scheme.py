"""``VLLMWeightSyncScheme``: TorchRL's name for a scheme that serves vLLM engines, over any weightsync scheme."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from ... import registry
from ...core.scheme import WeightSyncScheme
from ...errors import ConfigurationError
from .engines import VLLMEngines, check_options

__all__ = ["VLLMWeightSyncScheme"]


class VLLMWeightSyncScheme:
    """A weightsync scheme serving vLLM engines (TorchRL's name; see ``docs/vllm.md``).

    Everything but ``init_on_sender`` is the wrapped scheme's (``connect``, ``send``, ``shutdown``, ``version``,
    its options, ...). In a Hydra config::

        vllm_sync:
          _target_: weightsync.integrations.vllm.VLLMWeightSyncScheme
          pause_mode: keep
          load_ahead: false
          scheme: ${weightsync.scheme}     # the scheme group's choice, instantiated with it

    Args:
        scheme: the scheme that moves the bytes (an instance, or a registered name such as ``"shared_mem"``,
            ``"multiprocess"`` or ``"distributed"``, built with ``options``).
        pause_mode: what requests in flight do while an engine loads a version (``VLLMEngines``).
        load_ahead: a CPU engine processes each version while it generates, the pause only making it current
            (``VLLMEngines``; default: vLLM's whole reload in the pause).
        **options: the options of the scheme ``scheme`` names.

    Raises:
        ConfigurationError: an unknown scheme or pause mode, or options given with a scheme instance.
    """

    def __init__(
        self, scheme: Any = "shared_mem", *, pause_mode: str = "keep", load_ahead: bool = False, **options: Any
    ) -> None:
        if isinstance(scheme, str):
            scheme = registry.get_backend(scheme)(**options)
        elif options:
            raise ConfigurationError(
                f"options {sorted(options)} are for a scheme named by its name: give them to the scheme instance"
            )
        if not isinstance(scheme, WeightSyncScheme):
            raise ConfigurationError(f"scheme must be a weightsync scheme or its name, got {type(scheme).__name__}")
        check_options(pause_mode, load_ahead)
        self.scheme = scheme
        self.pause_mode, self.load_ahead = pause_mode, load_ahead
        self.engines: VLLMEngines | None = None

    def init_on_sender(
        self,
        model_id: str = "policy",
        *,
        engines: Sequence[Any] | VLLMEngines | None = None,
        context: VLLMEngines | None = None,
        model: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
        **kwargs: Any,
    ) -> None:
        """Serve ``engines`` (one worker each: a list, as :class:`VLLMEngines` takes it with ``loop``; or a
        ``VLLMEngines``, given as ``engines=`` or as ``context=``, as every scheme takes it) with ``model``, the
        trainer's ``transformers`` model (``kwargs``: the wrapped scheme's own, such as ``weights=``). The engines
        are served with this scheme's ``pause_mode`` and ``load_ahead``, the options its config sets.

        Raises:
            ConfigurationError: no engines, both ``engines=`` and ``context=``, or ``loop=`` with a ``VLLMEngines``
                (it has its own).
        """
        if engines is not None and context is not None:
            raise ConfigurationError("give the engines once: engines=[...] or context=VLLMEngines([...])")
        given = engines if context is None else context
        if given is None:
            raise ConfigurationError(
                "VLLMWeightSyncScheme.init_on_sender needs the engines: engines=[...] or context=VLLMEngines([...])"
            )
        if not isinstance(given, VLLMEngines):
            given = VLLMEngines(given, pause_mode=self.pause_mode, loop=loop, load_ahead=self.load_ahead)
        elif loop is not None:
            raise ConfigurationError("loop= is for a list of engines: a VLLMEngines has its own (its loop=)")
        before = given.pause_mode, given.load_ahead
        given.serve_with(self.pause_mode, self.load_ahead)
        try:
            self.scheme.init_on_sender(model_id, context=given, model=model, **kwargs)
        except BaseException:  # (the engines as they were given)
            given.pause_mode, given.load_ahead = before
            raise
        self.engines = given

    def __getattr__(self, name: str) -> Any:
        scheme = self.__dict__.get("scheme")
        if scheme is None:
            raise AttributeError(name)
        return getattr(scheme, name)

    def __repr__(self) -> str:
        return f"VLLMWeightSyncScheme({self.scheme!r}, pause_mode={self.pause_mode!r}, load_ahead={self.load_ahead!r})"
