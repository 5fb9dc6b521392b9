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

:class:`DeltaBase` is the trainer's side: its copy of the newest version, which
it compares each next version with, chunk after chunk (one
comparison of 8-byte words, then of the changed ones' own words: vectorized,
no loop over values), and brings up to date by the changes alone. A
:class:`Delta` is a plain description (:meth:`Delta.to_plain`) and one body
buffer; :func:`apply_delta` checks both against the chunks before it writes anything.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import ConfigurationError
from .layout import FlatLayout

__all__ = [
    "BITMAP",
    "PATCH",
    "SAME",
    "WHOLE",
    "Chunk",
    "Delta",
    "DeltaBase",
    "apply_delta",
    "chunks_of",
    "body_size",
    "wire_sources",
    "word_dtype",
]

SAME, PATCH, WHOLE, BITMAP = 0, 1, 2, 3
#: The largest chunk, in bytes: the unit ``auto`` chooses between a patch and the whole bytes for.
CHUNK_BYTES = 4 << 20
#: Every segment of a delta's body starts at a multiple of this (a typed view of it needs its alignment).
SEGMENT_ALIGN = 8
#: Bytes a patch spends per changed word besides its value: its position.
INDEX_BYTES = 4
#: The most threads a comparison runs on (it reads memory: more cores than memory channels do not help).
MAX_THREADS = 4
#: Past one changed 8-byte word in this many, a piece is compared word by word rather than by gathering them.
DIRECT_SHARE = 16
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
        return torch.empty((), dtype=self.word).element_size()

    @property
    def words(self) -> int:
        return (self.end - self.start) // self.itemsize


def chunks_of(layout: FlatLayout, max_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """Tile the layout's ``[0, nbytes)`` with chunks of one wire dtype each, at most ``max_bytes`` (rounded to
    the word size). The layout pads each tensor to 64 bytes, so every run of one wire dtype is whole words."""
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


def _changes_bytes(count: int, chunk: Chunk) -> tuple[int, int]:
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
        buffer = self.buffer.numpy()
        pieces = self._pieces(sources)
        offsets = [offset for offset, _ in pieces]

        def one(chunk: Chunk) -> tuple[int, int, _Part | None]:
            return self._chunk(chunk, pieces, offsets, buffer, whole_if_larger)

        threads = min(torch.get_num_threads(), len(self.chunks), MAX_THREADS)
        if threads > 1:  # (threads of this call's own: none outlives it, whatever happens to the caller)
            with ThreadPoolExecutor(threads, thread_name_prefix="weightsync-delta") as pool:
                done = list(pool.map(one, self.chunks))
        else:
            done = [one(chunk) for chunk in self.chunks]
        parts = [part for _, _, part in done if part is not None]
        size = sum(_part_bytes(part) for part in parts)
        body = _pack(parts) if most is None or size < most else torch.empty(0, dtype=torch.uint8)
        self.version = version
        return Delta(base, version, [kind for kind, _, _ in done], [count for _, count, _ in done], body, size=size)

    def _chunk(
        self,
        chunk: Chunk,
        pieces: list[tuple[int, np.ndarray]],
        offsets: list[int],
        buffer: np.ndarray,
        whole_if_larger: bool,
    ) -> tuple[int, int, _Part | None]:
        """Compare ``chunk`` and bring the buffer's bytes there up to date; its kind, count and part of the body
        (``None``: nothing to send)."""
        found = self._changes(chunk, pieces, offsets, buffer, whole_if_larger)
        if found is None:  # more changed than changes would pay for: the whole chunk
            for offset, data in self._within(chunk, pieces, offsets):
                start, end = max(offset, chunk.start), min(offset + data.size, chunk.end)
                buffer[start:end] = data[start - offset : end - offset]
            return WHOLE, chunk.words, (chunk, WHOLE, None, buffer[chunk.start : chunk.end])
        at, values = found
        if not at.size:
            return SAME, 0, None
        buffer[chunk.start : chunk.end].view(_np_word(chunk))[at] = values
        kind, _ = _changes_bytes(int(at.size), chunk)
        return kind, int(at.size), (chunk, kind, at, values)

    def _pieces(self, sources: dict[str, torch.Tensor]) -> list[tuple[int, np.ndarray]]:
        """Each tensor's bytes, with their offset in the layout, in layout order."""
        return [
            (slot.offset, sources[slot.key].reshape(-1).view(torch.uint8).numpy())
            for slot in self.layout.slots
            if slot.nbytes
        ]

    @staticmethod
    def _within(chunk: Chunk, pieces: list[tuple[int, np.ndarray]], offsets: list[int]) -> list[tuple[int, np.ndarray]]:
        """The pieces with bytes inside ``chunk``."""
        out = []
        for offset, data in pieces[max(bisect.bisect_right(offsets, chunk.start) - 1, 0) :]:
            if offset >= chunk.end:
                break
            if offset + data.size > chunk.start:
                out.append((offset, data))
        return out

    def _changes(
        self,
        chunk: Chunk,
        pieces: list[tuple[int, np.ndarray]],
        offsets: list[int],
        buffer: np.ndarray,
        whole_if_larger: bool,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The positions (in ``chunk.word`` words from its start) and new values of the words that changed in
        ``chunk``; ``None`` (under ``whole_if_larger``) once so many changed that a patch of them would be larger
        than the chunk."""
        word = _np_word(chunk)
        size = chunk.itemsize
        found_at: list[np.ndarray] = []
        found_values: list[np.ndarray] = []
        limit = (chunk.end - chunk.start) if whole_if_larger else None
        mask = getattr(self._local, "mask", None)
        if mask is None:
            mask = self._local.mask = np.empty(self._mask_bytes, dtype=np.bool_)
        for offset, data in self._within(chunk, pieces, offsets):
            start, end = max(offset, chunk.start), min(offset + data.size, chunk.end)
            new, old = data[start - offset : end - offset], buffer[start:end]
            first = (start - chunk.start) // size
            wide = (end - start) // 8 * 8  # compared as 8-byte words, then the changed ones word by word
            hit = _changed_words(new[:wide].view(np.int64), old[:wide].view(np.int64), mask)
            if size < 8 and hit.size * DIRECT_SHARE > wide // 8:
                # Many changed: word by word over the piece costs less than gathering the changed 8-byte words.
                news, olds = new[: (end - start) // size * size].view(word), old[: (end - start) // size * size]
                differ = news != olds.view(word)
                if limit is not None and _changes_bytes(int(np.count_nonzero(differ)), chunk)[1] >= limit:
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
                    found_at.append(first + hit[sub // per] * per + sub % per)
                    found_values.append(got.reshape(-1)[sub])
                if wide < end - start:  # a tail shorter than 8 bytes
                    tail_new, tail_old = new[wide:].view(word), old[wide:].view(word)
                    sub = np.flatnonzero(tail_new != tail_old)
                    found_at.append(first + wide // size + sub)
                    found_values.append(tail_new[sub])
            if limit is not None and _changes_bytes(sum(int(a.size) for a in found_at), chunk)[1] >= limit:
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
    marked = np.flatnonzero(mask[: groups * 8].view(np.uint64))
    if marked.size * 4 > groups:  # dense: the plain search is as cheap
        return np.flatnonzero(mask[:n])
    lanes = np.flatnonzero(mask[: groups * 8].reshape(groups, 8)[marked])
    return marked[lanes // 8] * 8 + lanes % 8


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


def _np_word(chunk: Chunk) -> Any:
    return np.dtype(str(chunk.word).removeprefix("torch."))


#: One chunk's part of a body: the chunk, its kind, the changed words' positions (``None``: whole), the values.
_Part = tuple[Chunk, int, "np.ndarray | None", np.ndarray]


def _part_bytes(part: _Part) -> int:
    chunk, kind, at, _ = part
    if at is None:
        return chunk.end - chunk.start
    return _bitmap_bytes(int(at.size), chunk) if kind == BITMAP else _patch_bytes(int(at.size), chunk.itemsize)


def _pack(parts: list[_Part]) -> torch.Tensor:
    """The body: per chunk sent, its positions (int32) or its bitmap, then its values; or its whole bytes; each
    part padded to 8 bytes."""
    sizes = [_part_bytes(part) for part in parts]
    out = np.zeros(sum(sizes), dtype=np.uint8)
    offset = 0
    for (chunk, kind, at, values), size in zip(parts, sizes):
        if at is None:
            out[offset : offset + size] = values
        else:
            if kind == BITMAP:
                bits = np.zeros(chunk.words, dtype=np.bool_)
                bits[at] = True
                packed = np.packbits(bits, bitorder="little")
                out[offset : offset + packed.size] = packed
                start = offset + _padded(packed.size)
            else:
                out[offset : offset + at.size * INDEX_BYTES].view(np.int32)[:] = at
                start = offset + _padded(int(at.size) * INDEX_BYTES)
            out[start : start + at.size * chunk.itemsize].view(values.dtype)[:] = values
        offset += size
    return torch.from_numpy(out)


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
    writes: list[tuple[Chunk, np.ndarray | None, np.ndarray]] = []  # chunk, positions (None: whole), values
    offset = 0
    for chunk, kind, count in zip(chunks, delta.kinds, delta.counts):
        if kind == SAME:
            continue
        if kind == WHOLE:
            writes.append((chunk, None, body[offset : offset + chunk.end - chunk.start]))
            offset += chunk.end - chunk.start
            continue
        if kind == BITMAP:
            nbits = -(-chunk.words // 8)
            changed = np.unpackbits(body[offset : offset + nbits], count=chunk.words, bitorder="little").view(np.bool_)
            offset += _padded(nbits)
            if int(np.count_nonzero(changed)) != count:
                raise ConfigurationError(
                    f"a delta bitmap for bytes {chunk.start}..{chunk.end} marks other than its {count} words; "
                    "nothing applied"
                )
            at = np.flatnonzero(changed)
        else:
            at = body[offset : offset + count * INDEX_BYTES].view(np.int32)
            offset += _padded(count * INDEX_BYTES)
            if at[0] < 0 or at[-1] >= chunk.words or (count > 1 and not bool((at[1:] > at[:-1]).all())):
                raise ConfigurationError(
                    f"a delta patch for bytes {chunk.start}..{chunk.end} holds positions out of place; nothing applied"
                )
        values = body[offset : offset + count * chunk.itemsize].view(_np_word(chunk))
        offset += _padded(count * chunk.itemsize)
        writes.append((chunk, at, values))
    out = target.numpy()
    for chunk, positions, values in writes:
        if positions is None:
            out[chunk.start : chunk.end] = values
        else:
            out[chunk.start : chunk.end].view(values.dtype)[positions] = values
