"""weightsync as a vLLM weight-transfer backend: the engine's side, in each vLLM worker process.

vLLM builds one :class:`WeightsyncEngine` per worker when its config says
``weight_transfer_config={"backend": "weightsync"}`` (the plugin :func:`~weightsync.integrations.vllm.register`
made the name known in every vLLM process). Then, on the trainer's calls through the engine's front end:

1. ``init_weight_transfer_engine({"receiver": <a weightsync receiver config>})`` — the config is checked as data
   (:func:`weightsync.config.from_config`), the receiver is given the engine's model as an
   :class:`~weightsync.ExternalModel` (the names, shapes and dtypes the engine loads, by the Hugging Face names of
   its checkpoint), joins the trainer and loads the version the trainer holds; from then on a stager thread
   takes each version off the transport as soon as the trainer publishes it, while the engine generates, checks
   it and, on a CPU engine with ``load_ahead``, has vLLM process it on a shadow of the model
   (:mod:`.prepared`: vLLM's own loader and its post-load packing of linear weights). On a CPU engine the
   receiver's threads (the transport's, the stager) run on the core vLLM keeps off its compute threads
   (:func:`_spare_cpus`);
2. ``start_weight_update()`` — nothing: the engine computes with its weights until the version is there;
3. ``update_weights({"version": v})`` — applies what the stager took until it holds version ``v`` (waiting at
   most the scheme's ``timeout``): makes a prepared version current (its processed tensors and kernels swapped
   in), or loads it through vLLM's own path for checkpoint weights (its layerwise reload, which re-runs the
   processing vLLM does after loading a checkpoint: the CPU backend's packing of linear weights, fusions), then
   acks it to the trainer;
4. ``finish_weight_update()`` — nothing left to do (the front end records the version the engine serves).

An update whose names, shapes or dtypes differ from the engine's is refused before vLLM sees any of it.

With the ``ray`` scheme there is no stager: each version is the trainer's call into the Ray actor that holds the
engine (its worker in the actor's process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), checked and loaded by that call,
between the actor's other calls; ``update_weights`` finds it loaded.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from ... import checks
from ...config import from_config
from ...core.external import ExternalModel
from ...core.timing import deadline_after, shown_seconds
from ...errors import ConfigurationError, LifecycleError, SyncTimeoutError
from ...tensors.strategy import WeightStrategy, flatten_weights
from .prepared import prepare
from .staging import Stager

__all__ = ["WeightsyncEngine", "WeightsyncInitInfo", "WeightsyncUpdateInfo", "checkpoint_spec"]

log = logging.getLogger("weightsync.vllm")

#: The longest the engine's shutdown waits for the thread that takes versions off the transport (seconds).
STOP_WAIT_S = 5.0


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``init_weight_transfer_engine``: the receiver config the trainer's scheme wrote for this
    engine (``scheme.receiver_config(i)``), as plain data."""

    receiver: dict[str, Any] = field(default_factory=dict)
    #: Process each version as it arrives, while the engine generates (``VLLMEngines(load_ahead=...)``).
    load_ahead: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.load_ahead, bool):
            raise ConfigurationError(f"init_info load_ahead must be True or False, got {checks.shown(self.load_ahead)}")


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``update_weights``: the version the engine must hold when the call returns."""

    version: int = -1
    #: ``False``: return at once, raising unless the engine holds the version already (the trainer asks so after
    #: an update it gave up on: the engine runs a call to its end, so that version may have been loaded since).
    wait: bool = True

    def __post_init__(self) -> None:
        if type(self.version) is not int or self.version < 0:
            raise ConfigurationError(f"update_info version must be an int >= 0, got {checks.shown(self.version)}")
        if not isinstance(self.wait, bool):
            raise ConfigurationError(f"update_info wait must be True or False, got {checks.shown(self.wait)}")


def checkpoint_spec(
    model_config: Any, extract_as: str
) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], frozenset[str]]:
    """What a trainer holding the engine's model as a Hugging Face model sends (``{name: (shape, dtype)}``), and the
    names of it the engine loads: those of its checkpoint (``state_dict()``). The rest (buffers a model computes
    itself, such as rotary frequencies) are checked like every tensor, and not loaded: the engine computes its own.
    Built on the meta device: no memory, no download.

    Raises:
        ConfigurationError: ``transformers`` has no model class for the engine's architecture.
    """
    import transformers

    try:
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(model_config.hf_config, dtype=model_config.dtype)
    except (ValueError, KeyError) as exc:
        raise ConfigurationError(
            f"the engine's model ({model_config.hf_config.model_type}) has no transformers class to say which "
            f"weights it loads: {exc}"
        ) from exc
    spec = {k: (tuple(v.shape), v.dtype) for k, v in flatten_weights(hf, extract_as).items()}
    return spec, frozenset(hf.state_dict())


class WeightsyncEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    """One vLLM worker's weightsync receiver (see the module's docstring for the call order)."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.scheme: Any = None
        self._stager: Stager | None = None
        #: Seconds each load took in this worker (vLLM's reload of one version, prepared while the engine
        #: generated or made in the pause), newest last: the engine's own part of an update.
        self.load_seconds: list[float] = []
        #: Of each, the seconds spent in the pause (the prepared version made current, or the whole reload).
        self.paused_load_seconds: list[float] = []
        #: Whether versions are prepared while the engine generates (:mod:`.prepared`): where the trainer asked
        #: (``load_ahead``), on CPU. On a GPU vLLM's processing of unquantized weights is next to nothing (the load
        #: is the copy), and a shadow of the model would take the KV cache's memory: a GPU engine reloads in the
        #: pause.
        self.prepares = False
        #: How many versions were made current from a preparation (the others were reloaded in the pause).
        self.prepared = 0
        self._loaded: frozenset[str] = frozenset()  # the names of an update that go into the engine
        self._cpu = torch.device(device).type == "cpu"
        self._tied = _tied_modules(model)

    # ------------------------------------------------------------ vLLM's calls
    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        # A config refused leaves the receiver the engine has serving; one that names a trainer it then cannot
        # join (or whose weights do not fit) ends it: the old one went first, the two never serve at once.
        scheme = from_config(init_info.receiver)
        if getattr(scheme, "background_thread", False):
            raise ConfigurationError(
                "weightsync: an engine loads each version in update_weights, in the pause: its receiver config must "
                "not have background_thread on (its thread would load each version as it arrives, while the engine "
                "generates)"
            )
        strategy = scheme.strategy
        assert isinstance(strategy, WeightStrategy)
        spec, loaded = checkpoint_spec(self.model_config, strategy.extract_as)
        if self.scheme is not None:  # a new trainer (or the same one, restarted): the old receiver goes first
            self.shutdown()
        self.prepares, self._loaded = init_info.load_ahead and self._cpu, loaded
        prepare = self._prepare if self.prepares else None  # (None: the receiver hands the version to _load alone)
        # (buffers the engine computes itself: a copy of the trainer's in the engine's dtype has them in another)
        ignored = frozenset(spec) - self._loaded
        model = ExternalModel(spec, self._load, device=torch.device(self.device), prepare=prepare, ignored=ignored)
        spread = self._cpu and hasattr(os, "sched_getaffinity")  # (Linux's: where vLLM binds its compute threads)
        with _threads_started_on(_spare_cpus(_numa_nodes(), os.sched_getaffinity(0)) if spread else None):
            scheme.init_on_receiver(model=model)
            try:
                if scheme.applied_on_arrival and not _in_ray_actor():
                    raise ConfigurationError(
                        f"weightsync: the {type(scheme).__name__}'s updates are calls into the Ray actor that holds "
                        "the engine, and this vLLM worker runs in a process of its own: start the engine in the actor "
                        "with VLLM_ENABLE_V1_MULTIPROCESSING=0 in its environment (vLLM then runs its worker in the "
                        "actor's process), or use another transport (docs/vllm.md)"
                    )
                scheme.connect()  # joins the trainer and loads the version it holds (Ray's: it arrives as a call)
            except BaseException:
                scheme.shutdown()
                raise
            self.scheme = scheme
            if not scheme.applied_on_arrival:  # each version is taken while the engine generates, applied later
                self._stager = Stager(scheme, f"weightsync-vllm-{scheme.model_id}-stager")

    def start_weight_update(self) -> None:
        if self.scheme is None:
            raise LifecycleError("weightsync: start_weight_update before init_weight_transfer_engine")

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        scheme = self.scheme
        if scheme is None:
            raise LifecycleError("weightsync: update_weights before init_weight_transfer_engine")
        timeout = float(scheme.timeout)
        deadline = deadline_after(timeout)
        if not update_info.wait and (scheme.version is None or scheme.version < update_info.version):
            raise LifecycleError(
                f"weightsync: the engine holds version {scheme.version}, not {update_info.version}",
                model_id=scheme.model_id,
                worker_idx=scheme.worker_idx,
            )
        if self._stager is None and (scheme.version is None or scheme.version < update_info.version):
            # Ray's updates are the trainer's calls into this actor, which runs its calls in the order they were
            # made: the one applying this version ran before this one, and failed (the trainer was told why).
            raise LifecycleError(
                f"weightsync: version {update_info.version} was not applied in this actor (the engine holds "
                f"{scheme.version}): the trainer's call that brought it failed",
                model_id=scheme.model_id,
                worker_idx=scheme.worker_idx,
            )
        while scheme.version is None or scheme.version < update_info.version:
            assert self._stager is not None
            if not self._stager.apply_next(deadline):
                raise SyncTimeoutError(
                    f"weightsync: version {update_info.version} did not arrive within {shown_seconds(timeout)} "
                    f"(the engine holds {scheme.version})",
                    model_id=scheme.model_id,
                    worker_idx=scheme.worker_idx,
                )

    def finish_weight_update(self) -> None:
        return None

    def shutdown(self) -> None:
        scheme, self.scheme = self.scheme, None
        stager, self._stager = self._stager, None
        if stager is not None:  # (its takes poll every 50 ms: a stager that does not end in a few seconds is stuck,
            # and vLLM gives the whole worker a bounded time to exit before it kills it, leaking its shared memory)
            stager.stop(min(float(scheme.timeout), STOP_WAIT_S) if scheme is not None else STOP_WAIT_S)
        if scheme is not None:
            scheme.shutdown()

    # ------------------------------------------------------------ the load
    def _prepare(self, tensors: dict[str, torch.Tensor]) -> Callable[[], None] | None:
        """(In the stager's thread, while the engine generates) vLLM's reload of one version done on a shadow of
        the model (:mod:`.prepared`); the call that makes it current in the pause, or ``None`` (reloaded there)."""
        started = time.perf_counter()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            prepared = prepare(self.model, {k: v for k, v in tensors.items() if k in self._loaded}, self._tied)
        if prepared is None:
            return None
        took = time.perf_counter() - started

        def commit() -> None:
            started = time.perf_counter()
            with torch.no_grad():
                prepared.commit()
            self.prepared += 1
            self._timed(took + time.perf_counter() - started, time.perf_counter() - started)

        return commit

    def _timed(self, load: float, paused: float) -> None:
        self.load_seconds = [*self.load_seconds[-999:], load]
        self.paused_load_seconds = [*self.paused_load_seconds[-999:], paused]

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load one version's tensors (the sender's names: the checkpoint's) the way vLLM reloads a checkpoint.

        vLLM's layerwise reload puts each layer back in checkpoint form, buffers what is loaded into it and runs
        the processing it runs after loading a checkpoint once the layer is whole (on CPU, the packing of linear
        weights the forward pass uses); layers not loaded keep their weights. A plain ``load_weights`` would
        change the parameters and not what the engine computes."""
        started = time.perf_counter()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(self.model)
            try:
                self.model.load_weights((k, v) for k, v in tensors.items() if k in self._loaded)
            finally:
                finalize_layerwise_reload(self.model, self.model_config)
            # vLLM's reload processes a weight shared by two layers for the first only ("tied parameters only
            # reflect processing from one of the parent layers"): on CPU a tied lm_head would keep computing with
            # the weights it packed at startup. Its post-load processing runs again, from the shared weight.
            for module in self._tied:
                quant_method: Any = module.quant_method
                quant_method.process_weights_after_loading(module)
        took = time.perf_counter() - started
        self._timed(took, took)


def _tied_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers that hold a weight another layer (met first) owns, and process it after loading (a tied
    ``lm_head``), unless their own copy of it was removed at processing."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(module)
    return [
        m
        for layers in owners.values()
        for m in layers[1:]
        if hasattr(getattr(m, "quant_method", None), "process_weights_after_loading")
        and all(p.numel() for p in m.parameters(recurse=False))
    ]


def _numa_nodes() -> list[list[int]]:
    """The physical cores of each NUMA node, as vLLM's CPU platform reads them (``[]`` where it cannot)."""
    from vllm.platforms import current_platform

    discover = getattr(current_platform, "discover_numa_topology", None)
    return discover() if discover is not None else []


def _spare_cpus(nodes: list[list[int]], compute: set[int]) -> frozenset[int] | None:
    """Where the threads of a CPU engine's receiver run: the last core of each NUMA node this worker computes on,
    unless it computes on that core too; ``None`` (where the worker's main thread runs) if none is left.
    ``nodes``: the physical cores of each node; ``compute``: the cores the worker's compute threads are bound to
    (its main thread's).

    vLLM's CPU backend binds each compute thread (OpenMP) of a worker to a core of its own, and keeps the last
    core of each node off them (for its engine core's scheduler, and for its own KV-transfer thread, which it
    moves there). A forward pass waits for its slowest thread: a thread of the receiver that shared a compute
    thread's core (a thread the worker starts inherits its main thread's core) would slow all of generation
    while it receives, checks or processes a version."""
    spare = {max(node) for node in nodes if node and compute.intersection(node)} - compute
    return frozenset(spare) or None


@contextmanager
def _threads_started_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """The threads this thread starts meanwhile (a transport's, the stager) run on ``cpus`` (they inherit its
    CPUs); then this thread runs where it ran before. ``None``, or CPUs this process may not use: where it runs."""
    before = os.sched_getaffinity(0) if cpus else None
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)  # (0: this thread)
        except OSError as exc:  # (its cgroup's CPUs, say)
            log.info("weightsync: the receiver's threads stay on the worker's CPUs, not %s: %s", sorted(cpus), exc)
            before = None
    try:
        yield
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)


def _in_ray_actor() -> bool:
    """This process is a Ray actor's (calls into the actor run here)."""
    import sys

    ray = sys.modules.get("ray")  # (an actor's process imported Ray: a process that did not is none)
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
