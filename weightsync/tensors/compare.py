"""One pass over two versions' words: where they differ, the new values there, and the old brought up to date.

numpy would take five passes over memory for this (compare, search the mask, gather, compute positions, scatter);
this loop, compiled by numba, reads each word of both versions once. Blocks of :data:`BLOCK` words are tested
whole first (an OR of XORs, which the compiler vectorizes), then the sub-blocks of :data:`SUB` words of a block
that differs, and only then the words of a sub-block that differs, without a branch per word: memory speed where
nothing changed, and a few cycles a word where much did.

numba is imported on first use (``import weightsync`` does not pay for it); the compiled loop is cached on disk,
one per word dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = ["ROOM", "prepare", "scan"]

#: 8-byte words tested together before any one of them is looked at (1 KB).
BLOCK = 128
#: 8-byte words of a block that differs tested together (one 64-byte cache line).
SUB = 8
#: The room :func:`scan` needs past its outputs' last write: the most words a ``SUB`` of 8-byte words holds.
ROOM = SUB * 8


def scan(new: np.ndarray, old: np.ndarray, first: int, at: np.ndarray, values: np.ndarray, n: int, most: int) -> int:
    """Compare ``new`` with ``old`` (1-D arrays of one integer dtype, same size, aligned to 8 bytes): for each word
    that differs, write its position plus ``first`` into ``at[n], at[n+1], ...`` (int32), its new value into
    ``values`` (``new``'s dtype) and into ``old``.

    ``at`` and ``values`` need room for ``most + ROOM`` words from ``n``. Returns the new ``n``; ``-1`` once more
    than ``most`` words were found in all (then ``old`` is partly brought up to date: the caller copies it whole)."""
    wide = new.nbytes // 8  # tested as 8-byte words (numba widens narrower integers before operating on them)
    per = 8 // new.itemsize
    return int(
        _compiled()(
            new[: wide * per].view(np.int64),
            old[: wide * per].view(np.int64),
            new,
            old,
            per,
            first,
            at,
            values,
            n,
            most,
        )
    )


def prepare(words: Iterable[np.dtype[Any]]) -> None:
    """Compile (or load from numba's cache) the loop for each of ``words``, so that the first comparison does not
    pay for it (about 1.5 s for four word sizes compiled, 0.4 s loaded from the cache)."""
    for word in set(words):
        empty = np.zeros(0, dtype=word)
        scan(empty, empty.copy(), 0, np.empty(ROOM, dtype=np.int32), np.empty(ROOM, dtype=word), 0, 0)


@functools.cache
def _compiled() -> Callable[..., Any]:
    import numba  # noqa: PLC0415  (its import and the compiling are paid by the first delta, not by every import)

    return numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")(_scan)


def _scan(
    new64: np.ndarray,
    old64: np.ndarray,
    new: np.ndarray,
    old: np.ndarray,
    per: int,
    first: int,
    at: np.ndarray,
    values: np.ndarray,
    n: int,
    most: int,
) -> int:
    """:func:`scan`'s loop, as numba compiles it (as Python it would take minutes): ``new64`` and ``old64`` are the
    8-byte words of ``new`` and ``old``'s first bytes, ``per`` words each."""
    wide = new64.size
    blocks = wide // BLOCK
    for k in range(blocks):
        s = k * BLOCK
        acc = new64[s] ^ old64[s]
        for j in range(BLOCK):  # (fixed bounds: the compiler vectorizes it)
            acc |= new64[s + j] ^ old64[s + j]
        if acc == 0:
            continue
        for q in range(BLOCK // SUB):
            t = s + q * SUB
            acc = new64[t] ^ old64[t]
            for j in range(SUB):
                acc |= new64[t + j] ^ old64[t + j]
            if acc == 0:
                continue
            for u in range(t, t + SUB):
                if new64[u] == old64[u]:
                    continue
                for i in range(u * per, (u + 1) * per):  # every word written, the count moved where one differs
                    v = new[i]
                    differs = v != old[i]
                    at[n] = first + i
                    values[n] = v
                    old[i] = v
                    n += differs
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
