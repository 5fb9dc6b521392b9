"""Deltas' loops, compiled by numba: the trainer's comparison of two versions (:func:`scan`) and its bitmaps of
the changes (:func:`mark`), and the worker's writes of them (:func:`write_patch`, :func:`write_bitmap`).

numpy would take five passes over memory to compare (compare, search the mask, gather, compute positions, scatter),
and its scatter and search for set bits cost tens of nanoseconds a word; these loops read each word once.
:func:`scan` tests blocks of :data:`BLOCK` 8-byte words whole first (an OR of XORs, which the compiler vectorizes);
in a block that differs, a mask of its 8-byte words that differ is made without a branch, and only its set bits
are visited (and, where few changed, in each of those words only its lanes that differ). A block right after one
that held a change skips the whole test and goes straight to the masks: changes are spread, so most such blocks
hold one too (with 1% of float32 values changed at random, 92% of blocks do), and the test would be a second pass
over them. Where nothing changed it runs at memory speed; a changed value costs a few cycles, and a block that
holds one about one mispredicted branch.

numba is imported on first use (``import weightsync`` does not pay for it); each loop is compiled once per word
dtype and cached on disk.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..errors import ConfigurationError

__all__ = ["ROOM", "bitmap_count", "mark", "prepare", "prepare_writes", "scan", "write_bitmap", "write_patch"]

#: 8-byte words tested together before any one of them is looked at (1 KB).
BLOCK = 128
#: The room :func:`scan` needs past its outputs' last write (the most words of 64 8-byte words).
ROOM = 512
#: Past this many changed 8-byte words of 64, :func:`scan` writes every lane of each (1% of bfloat16 values
#: changed puts about 2.5 changed words in 64, 10% about 22).
DENSE = 8


def scan(new: np.ndarray, old: np.ndarray, first: int, at: np.ndarray, values: np.ndarray, n: int, most: int) -> int:
    """Compare ``new`` with ``old`` (1-D arrays of one integer dtype of at most 8 bytes, same size): for each word
    that differs, write its position plus ``first`` into ``at[n], at[n+1], ...`` (int32), its new value into
    ``values`` (``new``'s dtype) and into ``old``.

    ``at`` and ``values`` need room for ``most + ROOM`` words from ``n``. Returns the new ``n``; ``-1`` once more
    than ``most`` words were found in all (then ``old`` is partly brought up to date: the caller copies it whole)."""
    wide = new.nbytes // 8  # tested as 8-byte words (numba widens narrower integers before operating on them)
    per = _lanes(new)
    return int(
        _compiled(_scan)(
            new[: wide * per].view(np.int64),
            old[: wide * per].view(np.int64),
            new,
            old,
            first,
            at,
            values,
            n,
            most,
        )
    )


def mark(bits: np.ndarray, at: np.ndarray) -> None:
    """Set bit ``at[i] % 64`` of ``bits[at[i] // 64]`` for each ``i`` (``bits``: uint64, zero, room for every
    position of ``at``, which is not checked)."""
    _compiled(_mark)(bits, at)


def write_patch(target: np.ndarray, at: np.ndarray, values: np.ndarray) -> None:
    """``target[at[i]] = values[i]`` for each ``i``. ``at`` (int32) must be checked first: every position within
    ``target`` (nothing is checked here)."""
    _compiled(_write_patch)(target, at, values)


def bitmap_count(bits: np.ndarray, words: int) -> int:
    """The bits set in ``bits`` (uint64: bit ``j`` of word ``i`` marks position ``64 * i + j``); ``-1`` if one marks
    a position at or past ``words``."""
    return int(_compiled(_bitmap_count)(bits, words))


def write_bitmap(target: np.ndarray, bits: np.ndarray, values: np.ndarray) -> None:
    """``target[p] = values[k]`` for the ``k``-th set bit of ``bits``, at position ``p``. ``bits`` must be checked
    first (:func:`bitmap_count`: every set bit within ``target``, as many as ``values``)."""
    _compiled(_write_bitmap)(target, bits, values)


def prepare(words: Iterable[np.dtype[Any]]) -> None:
    """Compile (or load from numba's cache) :func:`scan` for each of ``words``, and :func:`mark`, so that the first
    comparison does not pay for it (about 1.5 s for four word sizes compiled, 0.4 s loaded from the cache)."""
    for word in set(words):
        empty = np.zeros(0, dtype=word)
        scan(empty, empty.copy(), 0, np.empty(ROOM, dtype=np.int32), np.empty(ROOM, dtype=word), 0, 0)
    mark(np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int32))


def prepare_writes(words: Iterable[np.dtype[Any]]) -> None:
    """Compile (or load) the worker's loops (:func:`write_patch`, :func:`write_bitmap`, :func:`bitmap_count`) for
    each of ``words``, so that the first changes a worker applies do not pay for it (about 1 s compiled)."""
    none, marks = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.uint64)
    bitmap_count(marks, 0)
    for word in set(words):
        empty = np.zeros(0, dtype=word)
        write_patch(empty, none, empty)
        write_bitmap(empty, marks, empty)


@functools.cache
def _compiled(loop: Callable[..., Any]) -> Callable[..., Any]:
    numba = _numba()
    options = {"nogil": True, "boundscheck": False, "error_model": "numpy"}
    try:
        return numba.njit(cache=True, **options)(loop)
    except RuntimeError:  # nowhere to cache it (a read-only install, no writable home): compiled in each process
        return numba.njit(**options)(loop)


@functools.cache
def _numba() -> Any:
    """numba, imported (its import and the compiling are paid by the first delta, not by every import), with
    :func:`_lanes`, :func:`_trailing_zeros` and :func:`_popcount` taught to it."""
    if sys.byteorder != "little":  # the loops cut words' lanes, and bitmaps' bits, out of little-endian words
        raise ConfigurationError(f"delta updates need a little-endian host; this one is {sys.byteorder}-endian")
    import numba  # noqa: PLC0415
    from numba.extending import intrinsic, overload  # noqa: PLC0415

    # (numba matches this signature with the lambda's, annotations and all: it has none)
    @overload(_lanes)
    def _lanes_of(words):
        lanes = 64 // words.dtype.bitwidth  # (a constant of the array's type: loops over lanes are unrolled)
        return lambda words: lanes

    @intrinsic
    def _cttz(typingctx, x):
        def codegen(context, builder, signature, args):  # one instruction (tzcnt); never asked of 0 (undefined)
            return builder.cttz(args[0], context.get_constant(numba.types.boolean, True))

        return x(x), codegen

    @intrinsic
    def _ctpop(typingctx, x):
        def codegen(context, builder, signature, args):  # one instruction (popcnt)
            return builder.ctpop(args[0])

        return x(x), codegen

    @overload(_trailing_zeros)
    def _trailing_zeros_of(x):
        return lambda x: _cttz(x)

    @overload(_popcount)
    def _popcount_of(x):
        return lambda x: _ctpop(x)

    return numba


def _lanes(words: np.ndarray) -> int:
    """How many of ``words``' words an 8-byte word holds."""
    return 8 // words.itemsize


def _trailing_zeros(x: int) -> int:
    """The position of ``x``'s lowest set bit (``x`` > 0)."""
    return (x & -x).bit_length() - 1


def _popcount(x: int) -> int:
    """How many bits of ``x`` are set."""
    return bin(x).count("1")


# The loops, as numba compiles them (as Python they would take minutes).


def _scan(
    new64: np.ndarray,
    old64: np.ndarray,
    new: np.ndarray,
    old: np.ndarray,
    first: int,
    at: np.ndarray,
    values: np.ndarray,
    n: int,
    most: int,
) -> int:
    """:func:`scan`'s loop, as numba compiles it (as Python it would take minutes): ``new64`` and ``old64`` are the
    8-byte words of ``new`` and ``old``'s first bytes (lanes of ``new``'s words)."""
    one = np.uint64(1)
    per = _lanes(new)
    bits = 64 // per
    mask = (one << np.uint64(bits)) - one if per > 1 else ~np.uint64(0)  # one lane's bits
    blocks = new64.size // BLOCK
    busy = False  # whether the block before held a change
    for k in range(blocks):
        s = k * BLOCK
        if not busy:  # (after a block that held a change, the next most often holds one too: not tested whole)
            acc = new64[s] ^ old64[s]
            for j in range(BLOCK):  # (fixed bounds: the compiler vectorizes it)
                acc |= new64[s + j] ^ old64[s + j]
            if acc == 0:
                continue
        busy = False
        for half in range(s, s + BLOCK, 64):
            # One bit per 8-byte word of these 64 that differs, set without a branch; then only the set bits are
            # visited, lowest first.
            marks = np.uint64(0)
            for j in range(64):
                marks |= np.uint64(new64[half + j] != old64[half + j]) << np.uint64(j)
            if marks == 0:
                continue
            busy = True
            # Where few words changed, a changed word most often holds one changed lane: its lanes that differ
            # are visited (a loop whose exit is predicted). Where many did, how many lanes of a word changed is
            # anybody's guess: every lane is written, and the count moves only past those that differ (no branch).
            dense = _popcount(marks) > DENSE
            while marks != 0:
                u = half + np.int64(_trailing_zeros(marks))
                marks &= marks - one
                # (lanes cut out of the 8-byte word in a register; lane 0 is the low bits: little-endian)
                w = np.uint64(new64[u])
                x = w ^ np.uint64(old64[u])
                old64[u] = w  # (the word read once: what is sent and what is kept are the same bytes)
                if dense:
                    for lane in range(per):
                        at[n] = first + u * per + lane
                        values[n] = w >> np.uint64(lane * bits)
                        n += ((x >> np.uint64(lane * bits)) & mask) != 0
                    continue
                while x != 0:
                    lane = np.int64(_trailing_zeros(x)) // bits
                    at[n] = first + u * per + lane
                    values[n] = w >> np.uint64(lane * bits)
                    n += 1
                    x &= ~(mask << np.uint64(lane * bits))
            if n > most:
                return -1
    for i in range(blocks * BLOCK * per, new.size):  # the last block's words, one by one
        v = new[i]
        if v != old[i]:
            if n == most:
                return -1
            at[n] = first + i
            values[n] = v
            old[i] = v
            n += 1
    return n


def _mark(bits: np.ndarray, at: np.ndarray) -> None:
    one = np.uint64(1)
    for i in range(at.size):
        p = np.int64(at[i])
        bits[p >> 6] |= one << np.uint64(p & 63)


def _write_patch(target: np.ndarray, at: np.ndarray, values: np.ndarray) -> None:
    for i in range(at.size):
        target[at[i]] = values[i]


def _bitmap_count(bits: np.ndarray, words: int) -> int:
    total = 0
    for i in range(bits.size):
        x = bits[i]
        if x == 0:
            continue
        if (i + 1) * 64 > words:  # a word that reaches past the positions: none of its bits there may be set
            keep = words - i * 64
            if keep <= 0 or (keep < 64 and x >> np.uint64(keep) != 0):
                return -1
        total += np.int64(_popcount(x))
    return total


def _write_bitmap(target: np.ndarray, bits: np.ndarray, values: np.ndarray) -> None:
    one = np.uint64(1)
    k = 0
    for i in range(bits.size):
        x = bits[i]
        while x != 0:
            target[i * 64 + np.int64(_trailing_zeros(x))] = values[k]
            x &= x - one
            k += 1
