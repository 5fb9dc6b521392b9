"""The trainer's copy of the newest version's bytes, and the comparison of each next version with it.

:class:`DeltaBase` compares chunk by chunk (:mod:`~weightsync.tensors.delta` says what a chunk is and how its changes
travel): as 8-byte words first, then the changed ones word by word, or word by word over a piece where many changed;
vectorized numpy calls, no loop over values; on torch's threads, which read memory faster than one.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from .delta import (
    CHUNK_BYTES,
    MAX_THREADS,
    SAME,
    WHOLE,
    Chunk,
    Delta,
    Part,
    changes_bytes,
    chunks_of,
    np_word,
    pack_body,
    part_bytes,
)
from .layout import FlatLayout

__all__ = ["DeltaBase", "wire_sources"]

#: Past one changed 8-byte word in this many, a piece is compared word by word rather than by gathering them.
DIRECT_SHARE = 16


class DeltaBase:
    """The trainer's copy of the newest version's bytes, against which the next version's delta is computed.

    One buffer of the layout's size (host memory, padding zero), and per thread a mask of one byte per 8 of a
    chunk: what deltas cost the trainer in memory. :meth:`update` compares the next version with it chunk by
    chunk (a comparison of 8-byte words, then of the changed words' own words), on as many threads as torch's
    (the comparison reads memory; one core does not read it as fast as two), and writes the changes into it: no
    copy of the model is made, the base becomes the new version by the changes alone.

    Args:
        layout: the versions' layout.
        chunk_bytes: the largest chunk (:func:`chunks_of`).
    """

    def __init__(self, layout: FlatLayout, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.layout = layout
        self.chunks = chunks_of(layout, chunk_bytes)
        self.buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
        #: The version the buffer holds (``None``: none yet).
        self.version: int | None = None
        self._mask_bytes = max(c.end - c.start for c in self.chunks) // 8 + 8
        self._local = threading.local()
        self._views = layout.views(self.buffer)

    def forget(self) -> None:
        """The buffer holds no version any more (the next :meth:`update` fills it whole)."""
        self.version = None

    def update(
        self,
        sources: dict[str, torch.Tensor],
        version: int,
        *,
        whole_if_larger: bool = True,
        most: int | None = None,
    ) -> Delta | None:
        """Make the buffer hold ``version``, whose tensors are ``sources`` (by key, the layout's wire dtypes,
        contiguous, on the CPU: :meth:`wire_sources`), and return the delta from the version it held (``None``
        if it held none: the buffer was filled whole).

        ``whole_if_larger``: a chunk whose patch would be larger than its bytes goes whole (``auto``). ``most``:
        a body of at least this many bytes is not packed (the delta says its size and has no body: the version
        goes whole).
        """
        base = self.version
        self.version = None  # until every chunk holds the new bytes
        if base is None:
            for slot in self.layout.slots:
                self._views[slot.key].copy_(sources[slot.key])
            self.version = version
            return None
        pieces = self._pieces(sources)
        compared = _Comparison(pieces, [offset for offset, _ in pieces], self.buffer.numpy(), whole_if_larger)

        def one(chunk: Chunk) -> tuple[int, int, Part | None]:
            return self._chunk(chunk, compared)

        threads = min(torch.get_num_threads(), len(self.chunks), MAX_THREADS)
        # (threads of this call's own: none outlives it, whatever happens to the caller)
        with ThreadPoolExecutor(threads, thread_name_prefix="weightsync-delta") if threads > 1 else _Inline() as pool:
            done = list(pool.map(one, self.chunks))
            parts = [part for _, _, part in done if part is not None]
            size = sum(part_bytes(part) for part in parts)
            body = pack_body(parts, pool.map) if most is None or size < most else torch.empty(0, dtype=torch.uint8)
        self.version = version
        return Delta(base, version, [kind for kind, _, _ in done], [count for _, count, _ in done], body, size=size)

    def _chunk(self, chunk: Chunk, compared: _Comparison) -> tuple[int, int, Part | None]:
        """Compare ``chunk`` and bring the buffer's bytes there up to date; its kind, count and part of the body
        (``None``: nothing to send)."""
        buffer = compared.buffer
        found = self._changes(chunk, compared)
        if found is None:  # more changed than changes would pay for: the whole chunk
            for offset, data in compared.within(chunk):
                start, end = max(offset, chunk.start), min(offset + data.size, chunk.end)
                buffer[start:end] = data[start - offset : end - offset]
            return WHOLE, chunk.words, (chunk, WHOLE, None, buffer[chunk.start : chunk.end])
        at, values = found
        if not at.size:
            return SAME, 0, None
        buffer[chunk.start : chunk.end].view(np_word(chunk))[at] = values
        kind, _ = changes_bytes(int(at.size), chunk)
        return kind, int(at.size), (chunk, kind, at, values)

    def _pieces(self, sources: dict[str, torch.Tensor]) -> list[tuple[int, np.ndarray]]:
        """Each tensor's bytes, with their offset in the layout, in layout order."""
        return [
            (slot.offset, sources[slot.key].reshape(-1).view(torch.uint8).numpy())
            for slot in self.layout.slots
            if slot.nbytes
        ]

    def _changes(self, chunk: Chunk, compared: _Comparison) -> tuple[np.ndarray, np.ndarray] | None:
        """The positions (in ``chunk.word`` words from its start) and new values of the words that changed in
        ``chunk``; ``None`` (under ``whole_if_larger``) once so many changed that a patch of them would be larger
        than the chunk."""
        word = np_word(chunk)
        size = chunk.itemsize
        found_at: list[np.ndarray] = []
        found_values: list[np.ndarray] = []
        limit = (chunk.end - chunk.start) if compared.whole_if_larger else None
        buffer = compared.buffer
        mask = getattr(self._local, "mask", None)
        if mask is None:
            mask = self._local.mask = np.empty(self._mask_bytes, dtype=np.bool_)
        for offset, data in compared.within(chunk):
            start, end = max(offset, chunk.start), min(offset + data.size, chunk.end)
            new, old = data[start - offset : end - offset], buffer[start:end]
            first = (start - chunk.start) // size
            wide = (end - start) // 8 * 8  # compared as 8-byte words, then the changed ones word by word
            hit = _changed_words(new[:wide].view(np.int64), old[:wide].view(np.int64), mask)
            if size < 8 and hit.size * DIRECT_SHARE > wide // 8:
                # Many changed: word by word over the piece costs less than gathering the changed 8-byte words.
                news, olds = new[: (end - start) // size * size].view(word), old[: (end - start) // size * size]
                differ = news != olds.view(word)
                if limit is not None and changes_bytes(int(np.count_nonzero(differ)), chunk)[1] >= limit:
                    return None  # counted, not gathered: the chunk goes whole
                sub = np.flatnonzero(differ)
                found_at.append(first + sub)
                found_values.append(news[sub])
            else:
                if hit.size:
                    per = 8 // size
                    got = new[:wide].view(np.int64)[hit].view(word).reshape(-1, per)
                    had = old[:wide].view(np.int64)[hit].view(word).reshape(-1, per)
                    sub = np.flatnonzero(got != had)
                    shift = per.bit_length() - 1  # (per is a power of two: shifts cost less than divisions)
                    found_at.append(first + ((hit[sub >> shift] << shift) | (sub & (per - 1))))
                    found_values.append(got.reshape(-1)[sub])
                if wide < end - start:  # a tail shorter than 8 bytes
                    tail_new, tail_old = new[wide:].view(word), old[wide:].view(word)
                    sub = np.flatnonzero(tail_new != tail_old)
                    found_at.append(first + wide // size + sub)
                    found_values.append(tail_new[sub])
            if limit is not None and changes_bytes(sum(int(a.size) for a in found_at), chunk)[1] >= limit:
                return None
        if not found_at:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=word)
        if len(found_at) == 1:
            return found_at[0], found_values[0]
        return np.concatenate(found_at), np.concatenate(found_values)


def _changed_words(new: np.ndarray, old: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The positions where the int64 arrays ``new`` and ``old`` differ (``mask``: scratch of at least their size
    plus 8). The comparison's mask is searched 8 bytes at a time, then only the groups of 8 that hold a change:
    sparse changes cost a fraction of one ``flatnonzero`` over the whole mask."""
    n = new.size
    np.not_equal(new, old, out=mask[:n])
    groups = -(-n // 8)
    mask[n : groups * 8] = False
    packed = mask[: groups * 8].view(np.uint64)
    marked = np.flatnonzero(packed != 0)  # (numpy finds the true ones of a bool array faster than the nonzero words)
    if marked.size * 4 > groups:  # dense: the plain search is as cheap
        return np.flatnonzero(mask[:n])
    lanes = np.flatnonzero(packed[marked].view(np.bool_))
    return marked[lanes >> 3] * 8 + (lanes & 7)


@dataclass(frozen=True)
class _Comparison:
    """What one :meth:`DeltaBase.update` compares: the new version's tensors as bytes with their offsets in the
    layout (in layout order), those offsets, the base's buffer, and whether a chunk that changed more than a patch
    pays for goes whole."""

    pieces: list[tuple[int, np.ndarray]]
    offsets: list[int]
    buffer: np.ndarray
    whole_if_larger: bool

    def within(self, chunk: Chunk) -> list[tuple[int, np.ndarray]]:
        """The pieces with bytes inside ``chunk``."""
        out = []
        for offset, data in self.pieces[max(bisect.bisect_right(self.offsets, chunk.start) - 1, 0) :]:
            if offset >= chunk.end:
                break
            if offset + data.size > chunk.start:
                out.append((offset, data))
        return out


class _Inline:
    """A pool of no thread: ``map`` is the builtin's."""

    map = staticmethod(map)

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def wire_sources(layout: FlatLayout, flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``flat``'s tensors as :meth:`DeltaBase.update` reads them: in the layout's wire dtype, contiguous, on the
    CPU (the trainer's own memory where it already is so; a copy otherwise)."""
    out = {}
    for slot in layout.slots:
        tensor = flat[slot.key].detach()
        if tensor.dtype != slot.wire or not tensor.is_contiguous() or tensor.device.type != "cpu":
            tensor = tensor.to(device="cpu", dtype=slot.wire).contiguous()
        out[slot.key] = tensor
    return out
