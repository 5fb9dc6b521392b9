"""Lossless deltas between two versions' bytes: what changed, bit for bit, chunk by chunk.

A version's bytes are the layout's buffer (wire dtypes, padding zero). They are
cut into chunks, each a run of one wire dtype, and compared as integer words of
that dtype's size: two values differ when their bits do (``-0.0`` against
``0.0``, two NaNs with other payloads: both are changes), so applying a delta to
the base gives exactly the new bytes, whatever the dtype.

Each chunk travels as one of:

- ``SAME``: nothing changed, nothing sent;
- ``PATCH``: the changed words' positions in the chunk (``int32``) and their new values;
- ``BITMAP``: one bit per word of the chunk (set: changed) and the changed words' new values, which is smaller
  than positions once more than one word in 32 changed;
- ``WHOLE``: the chunk's bytes (a patch would be larger).

A :class:`Delta` is a plain description (:meth:`Delta.to_plain`) and one body
buffer; :func:`apply_delta` checks both against the chunks before it writes
anything. The trainer's side, which finds the changes, is
:class:`~weightsync.tensors.delta_base.DeltaBase`; a worker under ``track_writes`` then writes into its model only
what :func:`changed_spans` says may differ.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import ConfigurationError, WeightSyncError
from .kernels import bitmap_count, mark, write_bitmap, write_patch
from .layout import FlatLayout

__all__ = [
    "BITMAP",
    "PATCH",
    "SAME",
    "WHOLE",
    "BodyWriter",
    "Chunk",
    "Delta",
    "Part",
    "apply_delta",
    "changed_spans",
    "chunks_of",
    "np_word",
    "part_bytes",
    "body_size",
    "changes_bytes",
    "word_dtype",
]

SAME, PATCH, WHOLE, BITMAP = 0, 1, 2, 3
#: The largest chunk, in bytes: the unit ``auto`` chooses between a patch and the whole bytes for.
CHUNK_BYTES = 4 << 20
#: Every segment of a delta's body starts at a multiple of this (a typed view of it needs its alignment).
SEGMENT_ALIGN = 8
#: The most threads a comparison or an apply runs on (they read memory: more cores than memory channels do not help).
MAX_THREADS = 4
#: Bytes a patch spends per changed word besides its value: its position.
INDEX_BYTES = 4
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype whose words a ``dtype`` buffer is compared in (its element size; 8 bytes at most)."""
    size = torch.empty((), dtype=dtype).element_size()
    if size in _WORDS:
        return _WORDS[size]
    return torch.int64 if size % 8 == 0 else torch.uint8


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[start, end)`` of the layout, compared as ``word`` integers."""

    start: int
    end: int
    word: torch.dtype

    @property
    def itemsize(self) -> int:
        return self.word.itemsize

    @property
    def words(self) -> int:
        return (self.end - self.start) // self.itemsize


def chunks_of(layout: FlatLayout, max_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """Tile the layout's ``[0, nbytes)`` with chunks of one wire dtype each, at most ``max_bytes`` (rounded down to
    64 bytes, a multiple of every word: each part of a body then starts 8-byte aligned, whole chunks too). The
    layout pads each tensor to 64 bytes, so every run of one wire dtype is whole words."""
    max_bytes = max(max_bytes - max_bytes % 64, 64)
    runs: list[tuple[int, torch.dtype]] = []  # (start, wire dtype) of each run of one wire dtype
    for slot in layout.slots:
        if not runs or runs[-1][1] != slot.wire:
            runs.append((slot.offset, slot.wire))
    if not runs:
        runs = [(0, torch.uint8)]
    bounds = [start for start, _ in runs[1:]] + [layout.nbytes]
    out: list[Chunk] = []
    for (start, wire), end in zip(runs, bounds):
        word = word_dtype(wire)
        size = torch.empty((), dtype=word).element_size()
        step = max(max_bytes // size, 1) * size
        for at in range(start, end, step):
            out.append(Chunk(at, min(at + step, end), word))
    return out


@dataclass
class Delta:
    """The changes from version ``base`` to ``version``.

    Attributes:
        base: the version it applies to.
        version: the version it makes.
        kinds: per chunk, ``SAME``, ``PATCH``, ``BITMAP`` or ``WHOLE``.
        counts: per chunk, the changed words (a patch's length; a whole chunk's words).
        body: the bytes, chunk by chunk: a patch's positions (int32) then its values, or a whole chunk's bytes,
            each part padded to 8 bytes (uint8, CPU; empty until a received body is in).
        base_digest: the checksum of the base's bytes, which a worker checks before applying (``None``: not checked).
        digest: the checksum of the new version's bytes, checked after applying, before the model sees them.
    """

    base: int
    version: int
    kinds: list[int]
    counts: list[int]
    body: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    base_digest: str | None = None
    digest: str | None = None
    #: Bytes of the body where it was not packed (too large to pay: sent whole); ``None``: ``body``'s own.
    size: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the body."""
        return int(self.body.numel()) if self.size is None else self.size

    def to_plain(self) -> dict[str, Any]:
        """The description, JSON-able (the body travels on its own)."""
        return {
            "base": self.base,
            "version": self.version,
            "kinds": list(self.kinds),
            "counts": list(self.counts),
            "nbytes": self.nbytes,
            "base_digest": self.base_digest,
            "digest": self.digest,
        }

    @classmethod
    def from_plain(cls, plain: Mapping[str, Any], chunks: Sequence[Chunk]) -> Delta:
        """The delta a peer described, checked against ``chunks``; its body still to come (:func:`body_size`
        bytes).

        Raises:
            ConfigurationError: not such a description, or not one of these chunks.
        """
        try:
            base, version, nbytes = plain["base"], plain["version"], plain["nbytes"]
            kinds, counts = list(plain["kinds"]), list(plain["counts"])
            base_digest, digest = plain.get("base_digest"), plain.get("digest")
            if not all(type(v) is int for v in (base, version, nbytes, *kinds, *counts)):
                raise ValueError("versions, sizes, kinds and counts must be integers")
            if not all(d is None or isinstance(d, str) for d in (base_digest, digest)):
                raise ValueError("digests must be strings")
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigurationError(f"malformed delta from the sender ({exc})") from None
        delta = cls(base, version, kinds, counts, base_digest=base_digest, digest=digest)
        if body_size(delta, chunks) != nbytes:
            raise ConfigurationError(f"malformed delta from the sender ({nbytes} bytes where its chunks need more)")
        return delta


def _padded(n: int) -> int:
    return -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN


def _bitmap_bytes(count: int, chunk: Chunk) -> int:
    """Bytes of one chunk's bitmap: a bit per word, then the changed words' values, each padded to 8 bytes."""
    return _padded(-(-chunk.words // 8)) + _padded(count * chunk.itemsize)


def changes_bytes(count: int, chunk: Chunk) -> tuple[int, int]:
    """The smaller encoding of ``count`` changed words of ``chunk`` (``PATCH`` or ``BITMAP``), and its bytes."""
    patch, bitmap = _patch_bytes(count, chunk.itemsize), _bitmap_bytes(count, chunk)
    return (PATCH, patch) if patch <= bitmap else (BITMAP, bitmap)


def _patch_bytes(count: int, itemsize: int) -> int:
    """Bytes of one chunk's patch: its positions, then its values, each padded to 8 bytes."""
    return _padded(count * INDEX_BYTES) + _padded(count * itemsize)


def body_size(delta: Delta, chunks: Sequence[Chunk]) -> int:
    """The bytes of ``delta``'s body, from its kinds and counts.

    Raises:
        ConfigurationError: its kinds or counts do not fit ``chunks``.
    """
    if len(delta.kinds) != len(chunks) or len(delta.counts) != len(chunks):
        raise ConfigurationError(f"a delta of {len(delta.kinds)} chunks where the layout has {len(chunks)}")
    total = 0
    for chunk, kind, count in zip(chunks, delta.kinds, delta.counts):
        if kind == PATCH and 0 < count <= chunk.words:
            total += _patch_bytes(count, chunk.itemsize)
        elif kind == BITMAP and 0 < count <= chunk.words:
            total += _bitmap_bytes(count, chunk)
        elif kind == WHOLE and count == chunk.words:
            total += chunk.end - chunk.start
        elif kind != SAME or count != 0:
            raise ConfigurationError(
                f"a delta chunk of kind {kind} with {count} words, where the chunk at byte {chunk.start} holds "
                f"{chunk.words}"
            )
    return total


_NP_WORDS = {torch.uint8: np.dtype(np.uint8), torch.int16: np.dtype(np.int16), torch.int32: np.dtype(np.int32),
             torch.int64: np.dtype(np.int64)}  # fmt: skip


def np_word(chunk: Chunk) -> Any:
    return _NP_WORDS[chunk.word]


#: One chunk's part of a body: the chunk, its kind, the changed words' positions (``None``: whole), the values.
Part = tuple[Chunk, int, "np.ndarray | None", np.ndarray]


def part_bytes(part: Part) -> int:
    chunk, kind, at, _ = part
    if at is None:
        return chunk.end - chunk.start
    return _bitmap_bytes(int(at.size), chunk) if kind == BITMAP else _patch_bytes(int(at.size), chunk.itemsize)


class BodyWriter:
    """A body written part by part while its chunks are compared on several threads: a chunk's part goes where the
    parts before it end, packed by the thread that found it if those ends are known, else left for the thread that
    places the chunk before it (which packs every part waiting in line behind its own): no thread waits for
    another's comparison.

    1) :meth:`place`, once per chunk, from any thread, with what to call once its part is packed (its room is
       free again);
    2) :meth:`fail`, from the thread of a chunk that could not be compared or packed (the chunks placed after it
       raise in :meth:`place`; some may have been written already: the body is not to be used; the parts waiting
       are dropped, their ``done`` called, and none waits from then on), or with ``-1`` from the caller when it
       stops waiting for the threads (an interrupt);
    3) :meth:`body`, once every chunk was placed.

    Room for the largest body is reserved; only the pages written are ever touched.

    Args:
        chunks: the chunks, in order.
        whole_if_larger: no part is larger than its chunk (``auto``); without it, one may be a bitmap of every
            word and all their values.
        most: a body of at least this many bytes is not written (``None``: any size is).
    """

    def __init__(self, chunks: Sequence[Chunk], whole_if_larger: bool, most: int | None = None) -> None:
        room = sum(
            chunk.end - chunk.start
            if whole_if_larger
            else max(chunk.end - chunk.start, changes_bytes(chunk.words, chunk)[1])
            for chunk in chunks
        )
        if most is not None:  # (no part that ends past it is written)
            room = min(room, most)
        self._out = np.zeros(room, dtype=np.uint8)  # (zero pages mapped on first write: padding and bitmaps zero)
        self._ends: list[int | None] = [None] * len(chunks)
        self._waiting: dict[int, tuple[Part | None, Callable[[], None]]] = {}  # placed, the chunk before not yet
        self._lock = threading.Lock()
        self._failed = len(chunks)  # the first chunk that could not be compared (none)
        self._most = most

    def place(self, index: int, part: Part | None, done: Callable[[], None]) -> None:
        """Chunk ``index``'s ``part`` (``None``: nothing to send): packed where chunk ``index - 1``'s ends, by this
        thread with the parts waiting behind it if that end is known, else by the thread that places chunk
        ``index - 1``. ``done()`` is called once it is packed, or dropped.

        Raises:
            WeightSyncError: a chunk failed (:meth:`fail`).
        """
        packs: list[tuple[Part | None, int, Callable[[], None]]] = []
        with self._lock:
            failed = self._failed if self._failed < len(self._ends) else None  # (the body is not to be used)
            if failed is None:
                if index and self._ends[index - 1] is None:
                    self._waiting[index] = (part, done)
                    return
                start = 0 if index == 0 else self._ends[index - 1]
                assert start is not None
                while True:  # this part, and those in line behind it
                    packs.append((part, start, done))
                    start += 0 if part is None else part_bytes(part)
                    self._ends[index] = start
                    index += 1
                    if index not in self._waiting:
                        break
                    part, done = self._waiting.pop(index)
        if failed is not None:  # (its room given back outside the lock, as every other)
            done()
            raise WeightSyncError(f"chunk {index} of a delta was not packed: chunk {failed} failed")
        try:
            for part, start, _ in packs:
                size = 0 if part is None else part_bytes(part)
                if part is not None and (self._most is None or start + size < self._most):
                    _pack_part(part, self._out[start : start + size])
        finally:
            for _, _, done in packs:
                done()

    def fail(self, index: int) -> None:
        """Chunk ``index`` failed (``-1``: the whole body): the chunks not placed yet are not (:meth:`place`
        raises), and those waiting are dropped."""
        with self._lock:
            self._failed = min(self._failed, index)
            dropped, self._waiting = list(self._waiting.values()), {}
        for _, done in dropped:
            done()

    def ready(self, index: int) -> bool:
        """Whether chunk ``index``'s part would be packed as it is placed (every chunk before it placed)."""
        return index == 0 or self._ends[index - 1] is not None

    @property
    def size(self) -> int:
        """The body's bytes (every chunk placed)."""
        return (self._ends[-1] or 0) if self._ends else 0

    def body(self) -> torch.Tensor:
        """The body (empty where it is at least ``most`` bytes: not written)."""
        if self._most is not None and self.size >= self._most:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_numpy(self._out[: self.size])


def _pack_part(part: Part, out: np.ndarray) -> None:
    """Write one chunk's ``part`` of the body into ``out`` (its bytes there, zeros)."""
    chunk, kind, at, values = part
    if at is None:
        out[:] = values
        return
    if kind == BITMAP:
        start = _padded(-(-chunk.words // 8))
        mark(out[:start].view(np.uint64), at)
    else:
        out[: at.size * INDEX_BYTES].view(np.int32)[:] = at
        start = _padded(int(at.size) * INDEX_BYTES)
    out[start : start + at.size * chunk.itemsize].view(values.dtype)[:] = values


def apply_delta(target: torch.Tensor, chunks: Sequence[Chunk], delta: Delta) -> None:
    """Write ``delta`` into ``target`` (uint8, CPU, the base's bytes), which then holds the new version's bytes.
    Everything is checked before anything is written: the body's size, and every position (within its chunk,
    strictly increasing).

    Raises:
        ConfigurationError: the body does not fit the delta, or a position is out of place; ``target`` unchanged.
    """
    size = body_size(delta, chunks)
    if delta.body.dtype != torch.uint8 or delta.body.numel() != size:
        raise ConfigurationError(f"a delta body of {delta.body.numel()} bytes where its description says {size}")
    body = delta.body.reshape(-1).numpy()
    writes: list[tuple[Chunk, int, np.ndarray | None, np.ndarray]] = []  # chunk, kind, positions or bits, values
    offset = 0
    for chunk, kind, count in zip(chunks, delta.kinds, delta.counts):
        if kind == SAME:
            continue
        if kind == WHOLE:
            writes.append((chunk, kind, None, body[offset : offset + chunk.end - chunk.start]))
            offset += chunk.end - chunk.start
            continue
        if kind == BITMAP:
            marked = _padded(-(-chunk.words // 8))  # bytes of marks, a bit per word
            marks = body[offset : offset + marked].view(np.uint64)  # (bit j of byte b: word 8 * b + j; little-endian)
            offset += marked
            if bitmap_count(marks, chunk.words) != count:
                raise ConfigurationError(
                    f"a delta bitmap for bytes {chunk.start}..{chunk.end} marks other than its {count} words; "
                    "nothing applied"
                )
        else:
            marks = body[offset : offset + count * INDEX_BYTES].view(np.int32)
            offset += _padded(count * INDEX_BYTES)
            if marks[0] < 0 or marks[-1] >= chunk.words or (count > 1 and not bool((marks[1:] > marks[:-1]).all())):
                raise ConfigurationError(
                    f"a delta patch for bytes {chunk.start}..{chunk.end} holds positions out of place; nothing applied"
                )
        values = body[offset : offset + count * chunk.itemsize].view(np_word(chunk))
        offset += _padded(count * chunk.itemsize)
        writes.append((chunk, kind, marks, values))
    out = target.numpy()

    def write(chunk: Chunk, kind: int, marks: np.ndarray | None, values: np.ndarray) -> None:
        if marks is None:
            out[chunk.start : chunk.end] = values
        elif kind == BITMAP:
            write_bitmap(out[chunk.start : chunk.end].view(values.dtype), marks, values)
        else:
            write_patch(out[chunk.start : chunk.end].view(values.dtype), marks, values)

    # On torch's threads (at most 4): each write is a scatter into memory the cache does not hold, and two cores
    # wait on two misses at once.
    threads = min(torch.get_num_threads(), len(writes), MAX_THREADS)
    if threads > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="weightsync-delta") as pool:
            list(pool.map(write, *zip(*writes)))
    else:
        for each in writes:
            write(*each)


def changed_spans(
    dst: Mapping[str, torch.Tensor],
    buffer: torch.Tensor,
    layout: FlatLayout,
    changed: list[tuple[int, int]],
    written: Mapping[str, list[tuple[int, int]] | None],
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """What to copy into the model's tensors ``dst`` from ``buffer`` (a version's bytes, as ``layout`` places them)
    where they may differ from it: the layout's byte ranges ``changed`` (since the version they held) and, per
    tensor, the ranges written since it was applied (``written``, from its first byte; ``None``: all of it). Returns
    the byte views to write and those to read (:func:`copy_tensors` them), in order, none overlapping.

    ``None`` where ``dst`` cannot be written byte for byte (a tensor not contiguous, not on the CPU, or not of its
    wire dtype), or where two of its names share memory and the version's bytes differ under them (tied in the
    worker's model and not in the trainer's: a write under one name shows under the other, which a whole write then
    overwrites in the layout's order): the caller writes the version whole. Names tied alike on both sides (the
    same memory, the same bytes) are written as any other.
    """
    slots = [slot for slot in layout.slots if slot.nbytes]
    for slot in slots:
        tensor = dst[slot.key]
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.dtype != slot.wire:
            return None
    held = sorted(slots, key=lambda s: dst[s.key].data_ptr())
    for a, b in zip(held, held[1:]):
        at_a, at_b = dst[a.key].data_ptr(), dst[b.key].data_ptr()
        if at_b < at_a + a.nbytes and not (
            at_a == at_b
            and a.nbytes == b.nbytes
            and torch.equal(buffer[a.offset : a.offset + a.nbytes], buffer[b.offset : b.offset + b.nbytes])
        ):
            return None
    starts = [lo for lo, _ in changed]
    targets, sources = [], []
    for slot in slots:
        end = slot.offset + slot.nbytes
        ranges = written.get(slot.key)
        spans = [(0, slot.nbytes)] if ranges is None else list(ranges)
        for lo, hi in changed[max(bisect.bisect_right(starts, slot.offset) - 1, 0) :]:
            if lo >= end:
                break
            if hi > slot.offset:
                spans.append((max(lo, slot.offset) - slot.offset, min(hi, end) - slot.offset))
        out = dst[slot.key].detach().reshape(-1).view(torch.uint8)
        at = 0  # (the spans in order, overlaps written once)
        for lo, hi in sorted(spans):
            lo = max(lo, at)
            if lo < hi:
                targets.append(out[lo:hi])
                sources.append(buffer[slot.offset + lo : slot.offset + hi])
                at = hi
    return targets, sources
