"""A Ray actor in the shape of a remote collector: it holds a model and joins a scheme."""

from __future__ import annotations

import contextlib

import ray

import weightsync as ws
from tests._vllm_engine import Engine
from tests._workers import _scramble, build, checksum


@ray.remote(num_cpus=0)
class Collector:
    def __init__(self, kind: str = "tiny") -> None:
        self.model = build(kind)
        _scramble(self.model)
        self.scheme = None

    def join(self, scheme, worker_idx: int, allow_pickle: bool = False) -> None:
        """``scheme``: a scheme object (pickled by Ray) or a receiver config (plain data; ``allow_pickle``: this
        actor opts in to a Ray cluster with nodes on other hosts)."""
        self.scheme = ws.from_config(scheme, allow_pickle=allow_pickle) if isinstance(scheme, dict) else scheme
        self.scheme.init_on_receiver(model_id="policy", model=self.model, worker_idx=worker_idx)
        self.scheme.connect()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def record_updates(self) -> None:
        """From now on, record the version of each update that reaches this actor (:meth:`updates`)."""
        from weightsync.transports.ray.receiver import RayReceiver

        self.pushed: list[int] = []
        real = RayReceiver.push

        def push(receiver, version, *args, **kwargs):
            self.pushed.append(version)
            return real(receiver, version, *args, **kwargs)

        RayReceiver.push = push  # type: ignore[method-assign]

    def updates(self) -> list[int]:
        return self.pushed

    def busy(self, seconds: float) -> None:
        """Hold the actor (a rollout, say): calls after this one wait."""
        import time

        time.sleep(seconds)

    def pid(self) -> int:
        import os

        return os.getpid()

    def state(self) -> tuple:
        return self.scheme.version, checksum(self.model, self.scheme.strategy.extract_as)

    def receive(self):
        return None if self.scheme.receive() is None else self.scheme.version

    def placement(self) -> tuple[dict, dict, list]:
        """Each tensor's address less the lowest one's, each address, and the Parameter objects' ids."""
        flat = self.scheme.strategy.flat(self.model)
        base = min(t.data_ptr() for t in flat.values())
        return (
            {k: t.data_ptr() - base for k, t in flat.items()},
            {k: t.data_ptr() for k, t in flat.items()},
            [id(p) for p in self.model.parameters()],
        )

    def count_writes(self) -> None:
        """From now on, count the tensor-by-tensor writes of an update and the bindings of the model."""
        import weightsync.core.receiver
        import weightsync.tensors.bound

        self.writes = {"tensor_by_tensor": 0, "bind": 0}
        for module, name, what in (
            (weightsync.core.receiver, "write_into", "tensor_by_tensor"),
            (weightsync.tensors.bound, "point_at", "bind"),
        ):
            real = getattr(module, name)

            def counted(dst, src, _real=real, _what=what, **kw):
                self.writes[_what] += 1
                return _real(dst, src, **kw)

            setattr(module, name, counted)

    def written(self) -> dict:
        return dict(self.writes)

    def move_tensor(self) -> None:
        """Move one tensor off the memory it had, as user code may."""
        import torch

        weight = self.model.body[0].weight
        weight.data = torch.zeros_like(weight)

    def break_model(self) -> None:
        import torch.nn as nn

        self.model.body[3] = nn.Linear(8, 3)


@ray.remote(num_cpus=0, max_restarts=2, max_task_retries=0)
class JoinsAtStart:
    """A collector that joins its scheme as it starts, the pattern of many: restarted by Ray, its new process
    joins again, behind the same handle, and the sender is not told."""

    def __init__(self, scheme, worker_idx: int) -> None:
        self.model = build("tiny")
        _scramble(self.model)
        self.scheme = scheme
        scheme.init_on_receiver(model_id="policy", model=self.model, worker_idx=worker_idx)
        scheme.connect()

    def pid(self) -> int:
        import os

        return os.getpid()

    def state(self) -> tuple:
        return self.scheme.version, checksum(self.model, self.scheme.strategy.extract_as)


class ReturnsNothing(ws.ModuleActor):
    """A module's actor whose own update method forgets to return what apply_in_actor returns."""

    def update_weights_tensordict(self, model_id, version, payload, layout) -> None:
        ws.transports.ray.apply_in_actor(self, model_id, version, payload, layout)


def make_value():
    """A module with a forward, built inside the hosting actor."""
    return build("value")


class _EngineInActor(Engine):
    """A ``vllm.LLM``'s calls in a Ray actor, with a weightsync receiver behind them in the actor's process (as
    vLLM's, with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): it notes its loads among its calls, refuses the
    ``refuse_load``-th, and ``generate`` says what it computes with (the sum of its weights) under which name."""

    def __init__(self, spec: dict, refuse_load: int | None = None) -> None:
        super().__init__(spec)
        self.refuse_load, self.loads = refuse_load, 0
        with contextlib.suppress(ImportError):  # (an engine's actor has it, the requests it is sent are vLLM's:
            import vllm.distributed.weight_transfer.base  # noqa: F401 - imported by the first, it took the connect's time)

    def _load(self, tensors: dict) -> None:
        self.calls.append("load")
        self.loads += 1
        if self.loads == self.refuse_load:
            raise RuntimeError("bad weights for this engine")
        super()._load(tensors)

    def init_weight_transfer_engine(self, request) -> None:  # (vLLM's requests, as an LLM takes them)
        super().init_weight_transfer_engine(request["init_info"] if isinstance(request, dict) else request.init_info)

    def update_weights(self, request) -> None:
        super().update_weights(request["update_info"] if isinstance(request, dict) else request.update_info)

    def generate(self) -> tuple[float | None, str]:
        return (weights_sum(self.held) if self.held else None), self.version

    def log(self) -> list[str]:
        return self.calls


EngineInActor = ray.remote(num_cpus=0)(_EngineInActor)


def weights_sum(tensors: dict) -> float:
    """Every value of ``tensors`` (by name) summed, in one order whatever the dict's."""
    return float(sum(tensors[k].detach().double().sum() for k in sorted(tensors)))
