"""A worker's hello: what it says of itself as it connects (built by the worker), whether the sender can take it
(checked by the sender: bounded JSON from a holder of the key, every field type-checked), and the sender's answer
when it cannot."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

from ...errors import WeightSyncError
from ...tensors import cuda

__all__ = ["gpu_uuid", "hello_of", "hello_problem", "refuse"]

log = logging.getLogger("weightsync.transports.local")


def gpu_uuid(device: str | None) -> str | None:
    """The UUID of the GPU ``device`` names (``"cuda:1"``), or ``None`` (not one GPU, or no CUDA here)."""
    if device is None or not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return cuda.device_uuid(torch.device(device))


def hello_of(worker_idx: int, model_id: str | None, device: str | None) -> dict[str, Any]:
    """The hello of worker ``worker_idx`` of ``model_id``, whose model is on ``device``."""
    return {
        "worker_idx": worker_idx,
        "pid": os.getpid(),
        "model_id": model_id,
        "device": device,
        # The GPU of the model, by UUID: the sender hands device slots only to a worker on its very GPU, and an
        # index means another GPU in a process with another CUDA_VISIBLE_DEVICES.
        "gpu": gpu_uuid(device),
    }


def hello_problem(hello: dict[str, Any], num_workers: int, model_id: str | None) -> str | None:
    """Why ``hello`` cannot be taken by the sender of ``model_id`` to ``num_workers`` workers, if it cannot."""
    w = hello.get("worker_idx")
    if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < num_workers:
        return f"worker_idx {str(w)[:40]!r} is not in 0..{num_workers - 1}"
    pid, texts = hello.get("pid"), {k: hello.get(k) for k in ("model_id", "device")}
    if isinstance(pid, bool) or not isinstance(pid, int):
        return f"its hello's pid is a {type(pid).__name__}, not an integer"
    for key, value in texts.items():
        if value is not None and not isinstance(value, str):
            return f"its hello's {key} is a {type(value).__name__}, not a string"
    if hello.get("model_id") != model_id:
        return f"model_id {str(hello.get('model_id'))[:80]!r} does not match {model_id!r}"
    return None


def refuse(channel: Any, problem: str, model_id: str | None) -> None:
    """Tell the process at the other end of ``channel`` (a :class:`~.channel.Channel`) why the sender of
    ``model_id`` turns it away, and close the channel."""
    log.warning("model %r: refused %s: %s", model_id, channel.peer, problem)
    with contextlib.suppress(WeightSyncError):
        channel.send({"op": "refused", "reason": problem})
    channel.close()
