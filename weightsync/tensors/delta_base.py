"""The trainer's copy of the newest version's bytes, and the comparison of each next version with it.

:class:`DeltaBase` compares chunk by chunk (:mod:`~weightsync.tensors.delta` says what a chunk is and how its changes
travel), each in one compiled pass (:mod:`~weightsync.tensors.kernels`), on torch's threads, which read memory
faster than one.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from ..errors import WeightSyncError
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

    One buffer of the layout's size (host memory, padding zero), and per thread and per word size of the layout two
    rooms for one chunk's changed positions and values (a position is 4 bytes, beside the value: with 4 MB chunks, up to
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
        self._rooms = _Rooms()
        self._views = layout.views(self.buffer)
        self._tracker: WrittenPages | None = open_tracker() if track_writes else None

    @property
    def views(self) -> dict[str, torch.Tensor]:
        """The version the buffer holds, tensor by tensor (in the layout's wire dtypes)."""
        return self._views

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
        compared = _Comparison(pieces, [offset for offset, _ in pieces], self.buffer.numpy())
        writer = BodyWriter(self.chunks, whole_if_larger, most)
        threads = min(torch.get_num_threads(), len(self.chunks), MAX_THREADS)
        causes: list[BaseException] = []  # the chunks' own failures, the first first

        def one(item: tuple[int, Chunk]) -> tuple[int, int]:
            index, chunk = item
            word = np_word(chunk)
            changes = self._most[chunk] if whole_if_larger else chunk.words
            room = self._rooms.take(word, changes + ROOM, 2 * threads, lambda: writer.ready(index))
            try:
                kind, count, part = self._chunk(chunk, compared, room, changes)
            except BaseException as exc:
                self._rooms.give(word, room)
                writer.fail(index)
                causes.append(exc)
                raise
            try:  # (the room is given back once the part is packed: then the chunk after it may be first)
                writer.place(index, part, partial(self._rooms.give, word, room))
            except BaseException:
                writer.fail(index)
                raise
            return kind, count

        # (threads of this call's own: none outlives it, whatever happens to the caller)
        with ThreadPoolExecutor(threads, thread_name_prefix="weightsync-delta") if threads > 1 else _Inline() as pool:
            try:
                found = list(pool.map(one, enumerate(self.chunks)))
            except BaseException as exc:  # (an interrupt cancels chunks not started; the parts waiting give back rooms)
                writer.fail(-1)
                if causes and exc is not causes[0]:  # a chunk before the one that failed heard of it: raise the cause
                    raise causes[0] from None
                raise
        self.version = version
        kinds, counts = [kind for kind, _ in found], [count for _, count in found]
        return Delta(base, version, kinds, counts, writer.body(), size=writer.size)

    def _chunk(
        self, chunk: Chunk, compared: _Comparison, room: tuple[np.ndarray, np.ndarray], most: int
    ) -> tuple[int, int, Part | None]:
        """Compare ``chunk`` and bring the buffer's bytes there up to date; its kind, count and part of the body
        (``None``: nothing to send), whose positions and values are in ``room`` (:meth:`_changes`)."""
        buffer = compared.buffer
        found = self._changes(chunk, compared, room, most)
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

    def _changes(
        self, chunk: Chunk, compared: _Comparison, room: tuple[np.ndarray, np.ndarray], most: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The positions (in ``chunk.word`` words from its start) and new values of the words that changed in
        ``chunk``, written into ``room`` (room for ``most + ROOM`` of them), which the buffer then holds; ``None``
        once more than ``most`` changed (under ``whole_if_larger``, a patch of them would be larger than the chunk;
        the buffer there is then partly up to date)."""
        word = np_word(chunk)
        at, values = room
        n = 0
        for offset, data in compared.within(chunk):
            start, end = max(offset, chunk.start), min(offset + data.size, chunk.end)
            # (a piece holds whole words: tensors are whole elements, chunks start at a tensor's 64-byte offset)
            new, old = data[start - offset : end - offset].view(word), compared.buffer[start:end].view(word)
            n = scan(new, old, (start - chunk.start) // chunk.itemsize, at, values, n, most)
            if n < 0:
                return None
        return at[:n], values[:n]


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
    layout (in layout order), those offsets, and the base's buffer."""

    pieces: list[tuple[int, np.ndarray]]
    offsets: list[int]
    buffer: np.ndarray

    def within(self, chunk: Chunk) -> list[tuple[int, np.ndarray]]:
        """The pieces with bytes inside ``chunk``."""
        out = []
        for offset, data in self.pieces[max(bisect.bisect_right(self.offsets, chunk.start) - 1, 0) :]:
            if offset >= chunk.end:
                break
            if offset + data.size > chunk.start:
                out.append((offset, data))
        return out


class _Rooms:
    """Room for the changed positions and values of the chunks being compared, per word size: one is taken for a
    chunk's comparison and given back once its part is packed into the body, which may be after the thread that
    took it went on to other chunks (the part waits for those before it: :class:`~.delta.BodyWriter`). Up to the
    limit a take names, rooms are kept from update to update (their pages touched once)."""

    #: Seconds :meth:`take` waits for a room: every one is held by a part waiting for a chunk that another thread
    #: is comparing (milliseconds' work); past this, that thread is stuck.
    WAIT_S = 60.0

    def __init__(self) -> None:
        self._free: dict[np.dtype[Any], list[tuple[np.ndarray, np.ndarray]]] = {}
        self._made: dict[np.dtype[Any], int] = {}  # (the rooms of each word size not dropped: free or taken)
        self._kept: dict[np.dtype[Any], int] = {}  # (the limit the last take named)
        self._given = threading.Condition()

    def take(
        self, word: np.dtype[Any], words: int, most: int, first: Callable[[], bool]
    ) -> tuple[np.ndarray, np.ndarray]:
        """A room for ``words`` positions and ``word`` values: a free one, or a new one while fewer than ``most``
        were made, or past that where ``first()`` (the chunk is the first not placed yet: the parts waiting wait
        for it, and it must not wait for their rooms; a room past ``most`` is dropped when given back).

        Raises:
            WeightSyncError: none was given back within :data:`WAIT_S`.
        """
        with self._given:
            self._kept[word] = most
            if not self._given.wait_for(
                lambda: self._free.get(word) or self._made.get(word, 0) < most or first(), self.WAIT_S
            ):
                raise WeightSyncError(
                    f"no room for a chunk's changes was given back within {self.WAIT_S} s: the comparison of a chunk "
                    "before it is stuck"
                )
            free = self._free.get(word)
            room = free.pop() if free else None
            if room is None:
                self._made[word] = self._made.get(word, 0) + 1
        if room is None or room[0].size < words:  # (one too small is replaced)
            room = (np.empty(words, dtype=np.int32), np.empty(words, dtype=word))
        return room

    def give(self, word: np.dtype[Any], room: tuple[np.ndarray, np.ndarray]) -> None:
        with self._given:
            if self._made[word] > self._kept[word]:
                self._made[word] -= 1
            else:
                self._free.setdefault(word, []).append(room)
            self._given.notify_all()


class _Inline:
    """A pool of no thread: ``map`` is the builtin's."""

    map = staticmethod(map)

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def wire_sources(layout: FlatLayout, flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``flat``'s tensors as :meth:`DeltaBase.update` reads them: in the layout's wire dtype, contiguous, on the
    CPU (the trainer's own memory where it already is so, bools aside; a copy otherwise).

    A copy is made as a whole send stages a tensor, by ``copy_`` into contiguous memory, so that both give the same
    bits: ``.to()`` of a permuted dense tensor keeps its strides and converts in another loop (a NaN became 0xffff,
    not 0x7fc0, in bfloat16), and a bool's bytes read as they are may hold 3 (a view of uint8 data), which torch's
    copy of a bool writes as 1."""
    out = {}
    for slot in layout.slots:
        tensor = flat[slot.key].detach()
        as_is = tensor.dtype == slot.wire and tensor.dtype != torch.bool
        if not (as_is and tensor.is_contiguous() and tensor.device.type == "cpu"):
            tensor = torch.empty(tensor.shape, dtype=slot.wire).copy_(tensor)
        out[slot.key] = tensor
    return out
