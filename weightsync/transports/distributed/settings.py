"""The ``distributed`` transport's settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ... import checks
from ...core.settings import TransportSettings
from ...options import MAX_BUFFERS, WIRE_DTYPE, Option, option

if TYPE_CHECKING:
    import torch

__all__ = ["BACKEND", "BUCKET_MB", "DistributedSettings"]

BACKEND = Option(
    "backend", "gloo", str, '``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA, GPU to GPU).', checks.one_of("gloo", "nccl")
)
BUCKET_MB = Option(
    "bucket_mb",
    None,
    Optional[float],  # noqa: UP045 - omegaconf 2.3 reads no `float | None`
    "Send the weights in buckets of at most this many MB, each copied while the previous one is on the wire "
    "(``None``: one message).",
    checks.optional(checks.number(0.0, 1e9, above=True, what="a positive number of megabytes or None")),
)


class DistributedSettings(
    TransportSettings, name="distributed", transport="weightsync.transports.distributed.transport:DistributedTransport"
):
    """Point-to-point sends over a torch.distributed group of the scheme's own, signalled through its store."""

    backend: str = option(BACKEND)
    wire_dtype: str | None = option(WIRE_DTYPE)
    bucket_mb: float | None = option(BUCKET_MB)
    max_buffers: int = option(MAX_BUFFERS)

    @property
    def bucket_bytes(self) -> int | None:
        """``bucket_mb`` in bytes (``None``: one message)."""
        return None if self.bucket_mb is None else max(1, int(self.bucket_mb * 1e6))

    @property
    def device(self) -> torch.device:
        """Where the messages' buffers live: this process's current GPU with ``nccl``, else the CPU."""
        import torch  # here: the settings, which configs name, are read without torch

        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
