"""A stand-in for a vLLM engine: vLLM's trainer-side calls, with what weightsync's vLLM backend does behind them (a
receiver built from the config it is sent, loading into an ``ExternalModel``), in the process that holds it."""

from __future__ import annotations

import time

import torch

import weightsync as ws
from weightsync.integrations.vllm.staging import Stager
from weightsync.tensors.strategy import flatten_weights


class Engine:
    """vLLM's trainer-side calls, with weightsync's backend behind them (in this process)."""

    def __init__(self, spec: dict, fail_update_at: int | None = None, fail_init: bool = False) -> None:
        self.spec, self.fail_update_at, self.fail_init = spec, fail_update_at, fail_init
        self.scheme = None
        self.held: dict[str, torch.Tensor] = {}
        self.version = "checkpoint"
        self.calls: list[str] = []
        self.active = False
        self.stager: Stager | None = None

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        self.held = {k: v.clone() for k, v in tensors.items()}

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append("init")
        if self.fail_init:
            raise RuntimeError("Weight transfer not configured")
        self._stop()
        scheme = ws.from_config(init_info["receiver"])
        scheme.init_on_receiver(model=ws.ExternalModel(self.spec, self._load))
        scheme.connect()
        self.scheme = scheme
        if not scheme.applied_on_arrival:  # as the backend: a thread takes each version while it generates
            self.stager = Stager(scheme, "test-engine-stager")

    def start_weight_update(self) -> None:
        assert not self.active, "a second start before finish"
        self.calls.append("start")
        self.active = True

    def update_weights(self, update_info: dict) -> None:
        self.calls.append(f"update {update_info['version']}")
        if update_info["version"] == self.fail_update_at:
            self.active = False
            raise RuntimeError("the engine could not load these weights")
        if not update_info.get("wait", True) and self.scheme.version < update_info["version"]:
            self.active = False
            raise RuntimeError(f"the engine holds version {self.scheme.version}, not {update_info['version']}")
        deadline = time.monotonic() + 10
        while self.scheme.version < update_info["version"]:
            assert self.stager is not None, f"version {update_info['version']} was not applied on arrival"
            assert self.stager.apply_next(deadline), f"version {update_info['version']} did not come in 10 s"

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish {weight_version}")
        if not self.active:  # (vLLM's worker: an update that raised ended the session)
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.active = False
        if weight_version is not None:
            self.version = weight_version

    def update_weight_version(self, version: str) -> None:
        self.version = version

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append("reset")
        return True

    def shutdown_weight_transfer_engine(self) -> None:
        self.calls.append("shutdown")
        self._stop()

    def _stop(self) -> None:
        if self.stager is not None:
            self.stager.stop(10)
            self.stager = None
        if self.scheme is not None:
            self.scheme.shutdown()
            self.scheme = None


def engine_spec(model) -> dict:
    """The names, shapes and dtypes of ``model``'s weights, as an engine's model holds them."""
    return {k: (tuple(v.shape), v.dtype) for k, v in flatten_weights(model, "tensordict").items()}
