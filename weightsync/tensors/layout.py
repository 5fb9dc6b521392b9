"""Where each tensor lives inside one contiguous weights buffer.

A :class:`FlatLayout` is computed once from the sender's weights, sent to every
receiver at connect as plain data, and checked there against the receiver's
own model before any byte moves. Tensors are grouped by dtype and each one
starts on a 64-byte boundary, so any dtype view of the buffer is aligned.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ..errors import ConfigurationError
from .copies import copy_tensors

__all__ = ["FlatLayout", "TensorSlot"]

ALIGN = 64


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: Any) -> Any:
    """``torch.<name>`` for a public name, else ``None`` (names arrive from peers: no private attribute)."""
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        return None
    return getattr(torch, name, None)


def dtype_from_name(name: str) -> torch.dtype:
    dtype = _torch_dtype(name)
    if not isinstance(dtype, torch.dtype):
        raise ConfigurationError(f"unknown dtype {name!r} in layout")
    return dtype


def wire_dtype_from_name(name: str | None) -> torch.dtype | None:
    """The dtype weights travel as (``None``: their own); only floating dtypes.

    Raises:
        ConfigurationError: not the name of a floating torch dtype.
    """
    if name is None:
        return None
    dtype = _torch_dtype(name)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigurationError(f"wire_dtype must name a floating dtype such as 'bfloat16', got {name!r}")
    return dtype


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place: ``dtype`` is the model's, ``wire`` the dtype its bytes have in the buffer."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int
    wire: torch.dtype


class FlatLayout:
    """The placement of every weight tensor in one flat byte buffer.

    Args:
        spec: ``{dotted_key: (shape, dtype)}`` in the order the tensors are extracted.
        wire_dtype: floating tensors are stored in the buffer as this dtype (cast when
            written, cast back when copied out); ``None`` keeps every dtype.
    """

    def __init__(
        self, spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]], wire_dtype: torch.dtype | None = None
    ) -> None:
        self.wire_dtype = wire_dtype
        by_dtype: dict[torch.dtype, list[str]] = {}
        for key, (_, dtype) in spec.items():
            by_dtype.setdefault(dtype, []).append(key)
        slots: list[TensorSlot] = []
        offset = 0
        for dtype, keys in by_dtype.items():
            wire = wire_dtype if wire_dtype is not None and dtype.is_floating_point else dtype
            itemsize = torch.empty((), dtype=wire).element_size()
            for key in keys:
                shape = tuple(int(s) for s in spec[key][0])
                numel = 1
                for s in shape:
                    numel *= s
                slots.append(TensorSlot(key, shape, dtype, offset, numel * itemsize, wire))
                offset += -(-numel * itemsize // ALIGN) * ALIGN
        self.slots = slots
        self.nbytes = max(offset, ALIGN)
        self._spec = {s.key: (s.shape, s.dtype) for s in slots}
        self._strides = [_contiguous_strides(s.shape) for s in slots]
        self._offsets = [s.offset for s in slots]
        #: Whether some tensor travels in a dtype of its own (``wire_dtype``): it must be cast back, not shared.
        self.casts = any(s.wire != s.dtype for s in slots)

    @classmethod
    def from_weights(cls, flat: Mapping[str, torch.Tensor], wire_dtype: torch.dtype | None = None) -> FlatLayout:
        return cls({k: (tuple(v.shape), v.dtype) for k, v in flat.items()}, wire_dtype)

    @property
    def spec(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{dotted_key: (shape, dtype)}``, read-only (no copy: receivers check it at every update)."""
        return MappingProxyType(self._spec)

    @property
    def weights_nbytes(self) -> int:
        """Bytes of weight data, padding excluded."""
        return sum(s.nbytes for s in self.slots)

    def to_plain(self) -> dict[str, Any]:
        """JSON-able description, the form in which it crosses a process boundary."""
        return {
            "entries": [[s.key, list(s.shape), dtype_name(s.dtype)] for s in self.slots],
            "wire_dtype": None if self.wire_dtype is None else dtype_name(self.wire_dtype),
        }

    @classmethod
    def from_plain(cls, plain: Mapping[str, Any]) -> FlatLayout:
        """The layout :meth:`to_plain` described (as a peer sent it).

        Raises:
            ConfigurationError: not such a description (keys, shapes of non-negative ints, dtype names).
        """
        try:
            entries = {}
            for key, shape, dt in plain["entries"]:
                if not isinstance(key, str) or not all(type(n) is int and n >= 0 for n in shape):
                    raise ValueError(f"entry {key!r:.80}")
                entries[key] = (tuple(shape), dtype_from_name(dt))
            wire = wire_dtype_from_name(plain.get("wire_dtype"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigurationError(f"malformed layout from the sender ({exc})") from None
        return cls(entries, wire)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views (the wire dtype) of every tensor inside ``buffer`` (a uint8 tensor of at least ``nbytes``)."""
        return self._views_in(buffer, 0, len(self.slots))

    def _views_in(self, buffer: torch.Tensor, first: int, last: int) -> dict[str, torch.Tensor]:
        """Views of slots ``[first, last)`` in ``buffer``, which holds the bytes from slot ``first``'s offset on.

        One typed view per run of slots of one wire dtype, then one ``as_strided`` per tensor: a third of
        the cost of slicing, retyping and reshaping each tensor (about 1 us a tensor against 3 on 2 cores),
        which receivers that get a new buffer with every update pay at every update.
        """
        views: dict[str, torch.Tensor] = {}
        base = self.slots[first].offset if first < last else 0
        i = first
        while i < last:
            wire = self.slots[i].wire
            j = i + 1
            while j < last and self.slots[j].wire == wire:
                j += 1
            start, end = self.slots[i].offset, self.slots[j - 1].offset + self.slots[j - 1].nbytes
            typed = buffer[start - base : end - base].view(wire)
            origin, size = typed.storage_offset(), typed.element_size()
            for slot, stride in zip(self.slots[i:j], self._strides[i:j]):
                views[slot.key] = typed.as_strided(slot.shape, stride, origin + (slot.offset - start) // size)
            i = j
        return views

    def views_at(self, buffer: torch.Tensor, offset: int) -> dict[str, torch.Tensor]:
        """Typed views of the tensors wholly inside ``buffer`` (uint8), which holds the layout's bytes from byte
        ``offset`` on (a piece of a payload: :meth:`placed`)."""
        end = offset + buffer.numel()
        first = bisect.bisect_left(self._offsets, offset)
        last = first
        while last < len(self.slots) and self.slots[last].offset + self.slots[last].nbytes <= end:
            last += 1
        if first == last:
            return {}
        return self._views_in(buffer[self.slots[first].offset - offset :], first, last)

    def buckets(self, max_bytes: int | None) -> list[tuple[int, int, int, int]]:
        """Split the buffer at tensor boundaries into runs of at most ``max_bytes`` (a larger tensor is a
        bucket of its own); ``None``: one bucket. Returns ``(first_slot, last_slot, start, end)`` for each,
        slots ``[first, last)`` and bytes ``[start, end)``; the buckets tile ``[0, nbytes)``."""
        if not self.slots:
            return [(0, 0, 0, self.nbytes)]
        cuts = [0]
        for i, slot in enumerate(self.slots[1:], start=1):
            if max_bytes is not None and slot.offset + slot.nbytes - self.slots[cuts[-1]].offset > max_bytes:
                cuts.append(i)
        bounds = [self.slots[i].offset for i in cuts[1:]]
        starts, ends = [0, *bounds], [*bounds, self.nbytes]
        return list(zip(cuts, [*cuts[1:], len(self.slots)], starts, ends))

    def pieces(
        self,
        flat: Mapping[str, torch.Tensor],
        staging: torch.Tensor,
        direct_min: int,
        staging_views: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """The weights as a few contiguous byte buffers, with one copy at most of each byte.

        A CPU tensor of at least ``direct_min`` bytes that is contiguous (and not
        cast to a wire dtype) is a buffer of its own, its memory as it is (no copy). Each run of the other tensors is
        packed into its place in ``staging`` (a uint8 buffer of ``nbytes``, reused
        across sends) and that range is one buffer. Returns the buffers (uint8)
        and, for each, the range ``[first, last)`` of :attr:`slots` it holds, which
        is what :meth:`unpack` needs. ``staging_views``: :meth:`views` of ``staging``, for a caller that
        keeps them from send to send (made here otherwise).
        """
        if staging_views is None:
            staging_views = self.views(staging)
        buffers: list[torch.Tensor] = []
        ranges: list[tuple[int, int]] = []
        run: list[int] = []
        packed_dst: list[torch.Tensor] = []
        packed_src: list[torch.Tensor] = []

        def close_run() -> None:
            if run:
                first, last = self.slots[run[0]], self.slots[run[-1]]
                for s in self.slots[run[0] : run[-1] + 1]:
                    packed_dst.append(staging_views[s.key])
                    packed_src.append(flat[s.key])
                buffers.append(staging[first.offset : last.offset + last.nbytes])
                ranges.append((run[0], run[-1] + 1))
                run.clear()

        for i, slot in enumerate(self.slots):
            tensor = flat[slot.key]
            if slot.nbytes >= direct_min and slot.wire == slot.dtype and tensor.is_cpu and tensor.is_contiguous():
                close_run()
                buffers.append(tensor.detach().reshape(-1).view(torch.uint8))
                ranges.append((i, i + 1))
            else:
                run.append(i)
        close_run()
        copy_tensors(packed_dst, packed_src)  # every run at once: small tensors spread over torch's threads
        return buffers, ranges

    def whole(self, buffer: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """``buffer`` (uint8, at least :attr:`nbytes`), which holds every tensor in its place, as the one piece
        of a payload: what :meth:`pieces` returns, with no copy."""
        last = self.slots[-1] if self.slots else None
        return [buffer[: last.offset + last.nbytes if last else 0]], [(0, len(self.slots))]

    def placed(self, buffers: list[torch.Tensor], ranges: list[tuple[int, int]]) -> list[tuple[int, torch.Tensor]]:
        """Where each buffer :meth:`pieces` made starts in the layout: ``(byte offset, buffer)`` pairs, each
        buffer checked to hold exactly the bytes of its range of tensors, the ranges to cover every tensor once.

        Raises:
            ConfigurationError: the payload does not fit the layout.
        """
        covered = [i for first, last in ranges for i in range(first, last)]
        if len(buffers) != len(ranges) or covered != list(range(len(self.slots))):
            raise ConfigurationError(f"a payload of {len(buffers)} buffers does not cover the layout's tensors")
        placed: list[tuple[int, torch.Tensor]] = []
        for buffer, (first, last) in zip(buffers, ranges):
            base = self.slots[first].offset
            end = self.slots[last - 1].offset + self.slots[last - 1].nbytes
            if buffer.dtype != torch.uint8 or buffer.numel() != end - base:
                raise ConfigurationError(
                    f"a payload buffer holds {buffer.numel()} bytes where tensors {first}..{last - 1} need {end - base}"
                )
            placed.append((base, buffer))
        return placed

    def unpack(self, buffers: list[torch.Tensor], ranges: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        """Typed views of every tensor inside the buffers :meth:`pieces` made (checked to fit: :meth:`placed`)."""
        views: dict[str, torch.Tensor] = {}
        for (_, buffer), (first, last) in zip(self.placed(buffers, ranges), ranges):
            views.update(self._views_in(buffer, first, last))
        return views

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatLayout) and other.slots == self.slots

    def __repr__(self) -> str:
        return f"FlatLayout({len(self.slots)} tensors, {self.nbytes} bytes)"
