"""Checksums of the bytes a send moves: computed by the sender, checked by each receiver before it applies.

xxHash's XXH3 (64-bit) runs at memory speed (about 6 ms per 100 MB on a 2-core VM, against 22 ms for
zlib's CRC-32). It detects corruption and truncation, not tampering: channels are authenticated for that.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import xxhash

from .errors import ConfigurationError, IntegrityError

__all__ = ["check_digest", "digest", "digest_device_check"]


def digest(buffers: Iterable[torch.Tensor]) -> str:
    """The XXH3-64 of the bytes of ``buffers``, in order (CPU tensors, each contiguous or made so)."""
    state = xxhash.xxh3_64()
    for buffer in buffers:
        data = buffer.detach()
        if not data.is_contiguous():
            data = data.contiguous()
        if data.numel():
            state.update(data.reshape(-1).view(torch.uint8).numpy().data)
    return state.hexdigest()


def check_digest(buffers: Iterable[torch.Tensor], expected: str | None, **where: Any) -> None:
    """Raise :class:`IntegrityError` unless ``buffers`` hash to ``expected`` (``None``: nothing to check)."""
    if expected is None:
        return
    got = digest(buffers)
    if got != expected:
        raise IntegrityError(
            f"the payload failed its checksum (got {got}, the sender's is {expected}): corrupted or truncated "
            "in transit; not applied, the model keeps its previous weights",
            **where,
        )


def digest_device_check(checksum: bool, device: torch.device, **where: Any) -> None:
    """Checksums are computed on the CPU: refuse them for payloads that stay on a GPU."""
    if checksum and device.type != "cpu":
        raise ConfigurationError(
            f"checksum=True needs the payload in CPU memory, and this scheme keeps it on {device}", **where
        )
