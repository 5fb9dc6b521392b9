"""The trainer's copy of the newest version's bytes, and the comparison of each next version with it.

:class:`DeltaBase` compares chunk by chunk (:mod:`~weightsync.tensors.delta` says what a chunk is and how its changes
travel), each in one compiled pass (:mod:`~weightsync.tensors.kernels`), on torch's threads, which read memory
faster than one.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .delta import (
    CHUNK_BYTES,
    MAX_THREADS,
    SAME,
    WHOLE,
    BodyWriter,
    Chunk,
    Delta,
    Part,
    changes_bytes,
    chunks_of,
    np_word,
)
from .kernels import ROOM, prepare, scan
from .layout import FlatLayout
from .written import Ranges, WrittenPages, open_tracker

__all__ = ["DeltaBase", "wire_sources"]


class DeltaBase:
    """The trainer's copy of the newest version's bytes, against which the next version's delta is computed.

    One buffer of the layout's size (host memory, padding zero), and per thread and per word size of the layout room
    for one chunk's changed positions and values (a position is 4 bytes, beside the value: with 4 MB chunks, up to
    7.8 MiB for 4-byte words and 17.5 MiB for 1-byte words under ``whole_if_larger``, whose bitmaps hold more changes
    than patches; 8 and 20 MiB without; its pages are taken as changes are written): what deltas cost the trainer
    in memory. :meth:`update` compares the next version with it chunk by
    chunk, one pass per chunk that finds the changes and writes them into the buffer, on as many threads as torch's
    (the comparison reads memory; one core does not read it as fast as two): no copy of the model is made, the base
    becomes the new version by the changes alone.

    Under ``track_writes`` (where the kernel keeps the record: :mod:`~weightsync.tensors.written`), only the bytes
    of the pages written since the last update are compared: the rest cannot have changed.

    Args:
        layout: the versions' layout.
        chunk_bytes: the largest chunk (:func:`chunks_of`).
        track_writes: ask the kernel which pages of the sources were written, and compare only those.
    """

    def __init__(self, layout: FlatLayout, chunk_bytes: int = CHUNK_BYTES, track_writes: bool = False) -> None:
        self.layout = layout
        self.chunks = chunks_of(layout, chunk_bytes)
        self.buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
        #: The version the buffer holds (``None``: none yet).
        self.version: int | None = None
        #: Per chunk, the most changed words a patch of which is smaller than the chunk.
        self._most = {chunk: _most_changes(chunk) for chunk in self.chunks}
        self._local = threading.local()
        self._views = layout.views(self.buffer)
        self._tracker: WrittenPages | None = open_tracker() if track_writes else None

    @property
    def tracks_writes(self) -> bool:
        """Whether only the pages written since the last update are compared (asked, and the kernel can say)."""
        return self._tracker is not None

    def forget(self) -> None:
        """The buffer holds no version any more (the next :meth:`update` fills it whole)."""
        self.version = None

    def close(self) -> None:
        """Stop asking the kernel about the sources' pages."""
        if self._tracker is not None:
            self._tracker.close()

    def update(
        self,
        sources: dict[str, torch.Tensor],
        version: int,
        *,
        whole_if_larger: bool = True,
        most: int | None = None,
        own: Collection[str] | None = None,
    ) -> Delta | None:
        """Make the buffer hold ``version``, whose tensors are ``sources`` (by key, the layout's wire dtypes,
        contiguous, on the CPU: :meth:`wire_sources`), and return the delta from the version it held (``None``
        if it held none: the buffer was filled whole).

        ``whole_if_larger``: a chunk whose patch would be larger than its bytes goes whole (``auto``). ``most``:
        a body of at least this many bytes is not kept (the delta says its size and has no body: the version
        goes whole). ``own``: the keys whose tensors are memory that lives from version to version (the model's
        own, not copies made for this call), the only ones whose writes are asked about (``None``: all).
        """
        base = self.version
        self.version = None  # until every chunk holds the new bytes
        # (asked first: the pages are protected again before they are read, so a write from now on shows next time)
        written: dict[str, Ranges | None] = {}
        if self._tracker is not None:
            written = self._tracker.written(sources if own is None else {k: sources[k] for k in own})
        if base is None:
            for slot in self.layout.slots:
                self._views[slot.key].copy_(sources[slot.key])
            prepare(np_word(chunk) for chunk in self.chunks)  # (the first version, at connect, pays for it)
            self.version = version
            return None
        pieces = self._pieces(sources, written)
        if not pieces:  # nothing written since the last version: no chunk to compare
            self.version = version
            return Delta(base, version, [SAME] * len(self.chunks), [0] * len(self.chunks))
        compared = _Comparison(pieces, [offset for offset, _ in pieces], self.buffer.numpy(), whole_if_larger)
        writer = BodyWriter(self.chunks, whole_if_larger, most)

        def one(item: tuple[int, Chunk]) -> tuple[int, int]:
            index, chunk = item
            try:
                kind, count, part = self._chunk(chunk, compared)
                writer.place(index, part)  # (before this thread's next chunk reuses its room)
            except BaseException:
                writer.fail(index)
                raise
            return kind, count

        threads = min(torch.get_num_threads(), len(self.chunks), MAX_THREADS)
        # (threads of this call's own: none outlives it, whatever happens to the caller)
        with ThreadPoolExecutor(threads, thread_name_prefix="weightsync-delta") if threads > 1 else _Inline() as pool:
            try:
                done = list(pool.map(one, enumerate(self.chunks)))
            except BaseException:  # (an interrupt cancels chunks not started: the threads' waits on them end too)
                writer.fail(-1)
                raise
        self.version = version
        kinds, counts = [kind for kind, _ in done], [count for _, count in done]
        return Delta(base, version, kinds, counts, writer.body(), size=writer.size)

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
        kind, _ = changes_bytes(int(at.size), chunk)
        return kind, int(at.size), (chunk, kind, at, values)

    def _pieces(
        self, sources: dict[str, torch.Tensor], written: dict[str, Ranges | None]
    ) -> list[tuple[int, np.ndarray]]:
        """The bytes to compare, with their offset in the layout, in layout order: each tensor's, or, where
        ``written`` has its ranges, those alone (widened to whole 8-byte words: a piece holds whole words)."""
        out = []
        for slot in self.layout.slots:
            if not slot.nbytes:
                continue
            data = sources[slot.key].reshape(-1).view(torch.uint8).numpy()
            ranges = written.get(slot.key)
            if ranges is None:
                out.append((slot.offset, data))
                continue
            for lo, hi in ranges:
                lo, hi = lo - lo % 8, min(-(-hi // 8) * 8, data.size)
                out.append((slot.offset + lo, data[lo:hi]))
        return out

    def _changes(self, chunk: Chunk, compared: _Comparison) -> tuple[np.ndarray, np.ndarray] | None:
        """The positions (in ``chunk.word`` words from its start) and new values of the words that changed in
        ``chunk``, which the buffer then holds; ``None`` (under ``whole_if_larger``) once so many changed that a
        patch of them would be larger than the chunk (the buffer there is then partly up to date)."""
        word = np_word(chunk)
        most = self._most[chunk] if compared.whole_if_larger else chunk.words
        at, values = self._scratch(word, most + ROOM)
        n = 0
        for offset, data in compared.within(chunk):
            start, end = max(offset, chunk.start), min(offset + data.size, chunk.end)
            # (a piece holds whole words: tensors are whole elements, chunks start at a tensor's 64-byte offset)
            new, old = data[start - offset : end - offset].view(word), compared.buffer[start:end].view(word)
            n = scan(new, old, (start - chunk.start) // chunk.itemsize, at, values, n, most)
            if n < 0:
                return None
        return at[:n], values[:n]  # (this thread's room: packed before its next chunk)

    def _scratch(self, word: np.dtype[Any], words: int) -> tuple[np.ndarray, np.ndarray]:
        """This thread's room for ``words`` changed positions and values (``word`` values)."""
        room = getattr(self._local, "room", None)
        if room is None:
            room = self._local.room = {}
        if word not in room or room[word][0].size < words:
            room[word] = (np.empty(words, dtype=np.int32), np.empty(words, dtype=word))
        return room[word]


def _most_changes(chunk: Chunk) -> int:
    """The most changed words of ``chunk`` whose patch (or bitmap) is smaller than the chunk's bytes."""
    low, high = 0, chunk.words  # changes_bytes grows with the count: the largest count under the chunk's bytes
    while low < high:
        mid = (low + high + 1) // 2
        if changes_bytes(mid, chunk)[1] < chunk.end - chunk.start:
            low = mid
        else:
            high = mid - 1
    return low


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
