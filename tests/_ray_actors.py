"""A Ray actor in the shape of a remote collector: it holds a model and joins a scheme."""

from __future__ import annotations

import ray

import weightsync as ws
from tests._workers import _scramble, build, checksum


@ray.remote(num_cpus=0)
class Collector:
    def __init__(self, kind: str = "tiny") -> None:
        self.model = build(kind)
        _scramble(self.model)
        self.scheme = None

    def join(self, scheme, worker_idx: int) -> None:
        """``scheme``: a scheme object (pickled by Ray) or a receiver config (plain data)."""
        self.scheme = ws.from_config(scheme) if isinstance(scheme, dict) else scheme
        self.scheme.init_on_receiver(model_id="policy", model=self.model, worker_idx=worker_idx)
        self.scheme.connect()

    def pid(self) -> int:
        import os

        return os.getpid()

    def state(self) -> tuple:
        return self.scheme.version, checksum(self.model, self.scheme.strategy.extract_as)

    def receive(self):
        return None if self.scheme.receive() is None else self.scheme.version

    def break_model(self) -> None:
        import torch.nn as nn

        self.model.body[3] = nn.Linear(8, 3)


def make_value():
    """A module with a forward, built inside the hosting actor."""
    return build("value")
