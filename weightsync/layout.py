"""Where each tensor lives inside one contiguous weights buffer.

A :class:`FlatLayout` is computed once from the sender's weights, sent to every
receiver at connect as plain data, and checked there against the receiver's
own model before any byte moves. Tensors are grouped by dtype and each one
starts on a 64-byte boundary, so any dtype view of the buffer is aligned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConfigurationError

__all__ = ["FlatLayout", "TensorSlot"]

ALIGN = 64


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigurationError(f"unknown dtype {name!r} in layout")
    return dtype


@dataclass(frozen=True)
class TensorSlot:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


class FlatLayout:
    """The placement of every weight tensor in one flat byte buffer.

    Args:
        spec: ``{dotted_key: (shape, dtype)}`` in the order the tensors are extracted.
    """

    def __init__(self, spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        by_dtype: dict[torch.dtype, list[str]] = {}
        for key, (_, dtype) in spec.items():
            by_dtype.setdefault(dtype, []).append(key)
        slots: list[TensorSlot] = []
        offset = 0
        for dtype, keys in by_dtype.items():
            itemsize = torch.empty((), dtype=dtype).element_size()
            for key in keys:
                shape = tuple(int(s) for s in spec[key][0])
                numel = 1
                for s in shape:
                    numel *= s
                slots.append(TensorSlot(key, shape, dtype, offset, numel * itemsize))
                offset += -(-numel * itemsize // ALIGN) * ALIGN
        self.slots = slots
        self.nbytes = max(offset, ALIGN)
        self._spec = {s.key: (s.shape, s.dtype) for s in slots}

    @classmethod
    def from_weights(cls, flat: Mapping[str, torch.Tensor]) -> FlatLayout:
        return cls({k: (tuple(v.shape), v.dtype) for k, v in flat.items()})

    @property
    def spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._spec)

    @property
    def weights_nbytes(self) -> int:
        """Bytes of weight data, padding excluded."""
        return sum(s.nbytes for s in self.slots)

    def to_plain(self) -> dict[str, Any]:
        """JSON-able description, the form in which it crosses a process boundary."""
        return {"entries": [[s.key, list(s.shape), dtype_name(s.dtype)] for s in self.slots]}

    @classmethod
    def from_plain(cls, plain: Mapping[str, Any]) -> FlatLayout:
        return cls({key: (tuple(shape), dtype_from_name(dt)) for key, shape, dt in plain["entries"]})

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of every tensor inside ``buffer`` (a uint8 tensor of at least ``nbytes``)."""
        return {s.key: buffer[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.slots}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatLayout) and other.slots == self.slots

    def __repr__(self) -> str:
        return f"FlatLayout({len(self.slots)} tensors, {self.nbytes} bytes)"
