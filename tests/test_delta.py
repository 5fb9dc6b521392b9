"""Deltas: only what changed since the version a worker holds, bit for bit what a whole send gives.

The codec on every dtype (changes found by bits, refused when malformed before anything is written), then the
``distributed`` engine with workers in this process: many versions with and without ``wire_dtype`` and
``checksum``, a worker that missed versions, a worker whose base is not the sender's (refused, then sent whole in
the same ``send()``), and a worker's own change to its model. The many versions, the missed ones and the
worker's own change run with ``track_writes`` too (the trainer and the workers read only the pages written since
the last version: ``tests/test_written.py``).
Restarts, kills and drops mid-send run with deltas in ``tests/test_faults.py``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from unittest import mock

import numpy as np
import pytest
import torch

import weightsync as ws
from tests._bodies import sparse_step
from tests._workers import build, connect_pair
from weightsync.errors import ConfigurationError, SyncTimeoutError
from weightsync.tensors.delta import (
    BITMAP,
    PATCH,
    SAME,
    WHOLE,
    BodyWriter,
    Delta,
    apply_delta,
    body_size,
    changes_bytes,
    chunks_of,
)
from weightsync.tensors.delta_base import DeltaBase, _Rooms
from weightsync.tensors.kernels import ROOM, scan
from weightsync.tensors.layout import FlatLayout

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _tensors(dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Tensors of ``dtype`` of several sizes, odd ones included (a tail shorter than 8 bytes), and a float32 one."""
    out = {}
    for i, n in enumerate([3, 1, 1000, 70_001, 5]):
        raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), generator=gen)
        out[f"t{i}"] = raw.to(torch.uint8).view(dtype) if dtype != torch.bool else raw.to(torch.uint8).bool()
    out["f"] = torch.randn(999, generator=gen)
    return out


def _change(flat: dict[str, torch.Tensor], fraction: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``flat`` with about ``fraction`` of its values' bits changed (a fresh dict of fresh tensors)."""
    out = {}
    for key, tensor in flat.items():
        raw = tensor.clone().reshape(-1)
        if raw.dtype == torch.bool:
            mask = torch.rand(raw.shape, generator=gen) < fraction
            raw[mask] = ~raw[mask]
        else:
            size = raw.element_size()
            words = raw.view(torch.uint8).view(-1, size)
            mask = torch.rand(words.shape[0], generator=gen) < fraction
            words[mask, 0] ^= 1  # one bit of each chosen value
        out[key] = raw.view(tensor.shape)
    return out


def _bytes(layout: FlatLayout, flat: dict[str, torch.Tensor]) -> torch.Tensor:
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for key, view in layout.views(buffer).items():
        view.copy_(flat[key])
    return buffer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("auto", [True, False], ids=["auto", "true"])
def test_changes_make_the_new_bytes_exactly_for_every_dtype(dtype, auto):
    gen = torch.Generator().manual_seed(0)
    flat = _tensors(dtype, gen)
    layout = FlatLayout.from_weights(flat)
    base = DeltaBase(layout, chunk_bytes=4096)  # many chunks: patches and whole ones side by side
    assert base.update(flat, 0) is None  # the first version fills the copy
    for version, fraction in enumerate([0.0, 0.001, 0.05, 0.6, 1.0, 0.01], start=1):
        old = base.buffer.clone()
        flat = _change(flat, fraction, gen)
        delta = base.update(flat, version, whole_if_larger=auto)
        assert delta is not None and (delta.base, delta.version) == (version - 1, version)
        expected = _bytes(layout, flat)
        assert torch.equal(base.buffer, expected)  # the sender's copy is the new version
        apply_delta(old, base.chunks, delta)
        assert torch.equal(old, expected)  # ... and so is what the worker makes of its copy
        if fraction == 0.0:
            assert delta.nbytes == 0 and set(delta.kinds) == {SAME}
        if fraction in (0.05, 0.6):  # past one word in 32, a bitmap of the changed words is smaller than positions
            assert BITMAP in delta.kinds
        if auto:
            assert delta.nbytes <= layout.nbytes + 8 * len(base.chunks)
        elif fraction == 1.0:
            assert WHOLE not in delta.kinds


@pytest.mark.parametrize("threads", [1, 4])
def test_chunks_compared_on_any_number_of_threads_pack_one_body_in_order(threads, monkeypatch):
    # Each thread writes its chunk's part where the chunks before it end: the body is the same whoever packs it.
    gen = torch.Generator().manual_seed(5)
    flat = {"a": torch.randn(60_000, generator=gen), "b": torch.randn(70_000, generator=gen).to(torch.bfloat16)}
    flat["same"] = torch.randn(20_000, generator=gen)
    layout = FlatLayout.from_weights(flat)
    changed = {**_change({k: flat[k] for k in "ab"}, 0.03, gen), "same": flat["same"]}
    bodies = []
    for count in (1, threads):
        monkeypatch.setattr(torch, "get_num_threads", lambda count=count: count)
        base = DeltaBase(layout, chunk_bytes=4096)
        base.update(flat, 0)
        delta = base.update(changed, 1)
        assert delta is not None and {PATCH, BITMAP, SAME} <= set(delta.kinds)
        bodies.append(delta.body.clone())
    assert torch.equal(bodies[0], bodies[1])


def test_a_slow_chunk_does_not_hold_the_others_up_and_its_part_still_goes_first(monkeypatch):
    """A thread whose chunk's part must wait for a chunk before it (still being compared) goes on to the next
    chunk, with another room: the slow chunk's thread packs the parts waiting behind its own. The body is the
    one a single thread packs, and no more rooms are made than two a thread."""
    gen = torch.Generator().manual_seed(9)
    flat = {"w": torch.randn(100_000, generator=gen)}
    layout = FlatLayout.from_weights(flat)
    changed = _change(flat, 0.03, gen)
    single = DeltaBase(layout, chunk_bytes=4096)
    single.update(flat, 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    expected = single.update(changed, 1)
    assert expected is not None
    compare = DeltaBase._changes
    others = threading.Semaphore(0)
    first_waited: list[bool] = []

    def first_is_slow(self, chunk, compared, room, most):
        if chunk.start == 0:  # chunk 0: until three chunks after it were compared (its rooms allow three)
            first_waited.append(all(others.acquire(timeout=10) for _ in range(3)))
        else:
            others.release()
        return compare(self, chunk, compared, room, most)

    base = DeltaBase(layout, chunk_bytes=4096)
    base.update(flat, 0)
    monkeypatch.setattr(DeltaBase, "_changes", first_is_slow)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    delta = base.update(changed, 1)
    assert first_waited == [True]  # (the other thread did not wait for chunk 0's part)
    assert delta is not None and torch.equal(delta.body, expected.body) and delta.kinds == expected.kinds
    assert torch.equal(base.buffer, _bytes(layout, changed))
    made = sum(base._rooms._made.values())
    assert made <= 4, base._rooms._made
    assert sum(len(free) for free in base._rooms._free.values()) == made


def test_after_a_chunk_failed_no_part_waits_and_every_room_is_given_back():
    """A part waiting for the chunk before it is dropped when a chunk fails, and a chunk placed from then on, even
    one before the failed chunk, raises at once: no room stays held by a part that nothing will pack."""
    layout = FlatLayout.from_weights({"w": torch.zeros(4096)})
    chunks = chunks_of(layout, 4096)
    assert len(chunks) == 4
    writer = BodyWriter(chunks, whole_if_larger=True)
    given: list[int] = []
    writer.place(2, None, lambda: given.append(2))  # (waits for chunk 1)
    writer.place(0, None, lambda: given.append(0))  # (packed at once)
    assert given == [0]
    writer.fail(3)
    assert given == [0, 2]
    with pytest.raises(ws.WeightSyncError, match="chunk 1 of a delta was not packed: chunk 3 failed"):
        writer.place(1, None, lambda: given.append(1))
    assert given == [0, 2, 1]


def test_the_first_chunk_not_placed_takes_a_room_past_the_limit_and_a_stuck_one_is_named(monkeypatch):
    """The parts waiting hold rooms for the first chunk not placed: it must not wait for theirs. A chunk behind a
    stuck one waits for a room at most ``WAIT_S``, then says so."""
    rooms = _Rooms()
    word = np.dtype(np.int32)
    held = rooms.take(word, 16, 1, lambda: False)
    second = rooms.take(word, 16, 1, lambda: True)  # (past the limit of one: it is first)
    assert held[0] is not second[0] and held[0].size >= 16 and second[1].dtype == word
    monkeypatch.setattr(_Rooms, "WAIT_S", 0.2)
    with pytest.raises(ws.WeightSyncError, match="no room .* stuck"):
        rooms.take(word, 16, 1, lambda: False)
    rooms.give(word, second)  # (past the limit: dropped, not kept)
    assert rooms._made[word] == 1 and not rooms._free.get(word)
    rooms.give(word, held)
    assert rooms.take(word, 32, 1, lambda: False)[0].size >= 32  # (one too small is replaced)


def test_a_chunk_that_cannot_be_compared_fails_the_update_and_the_next_one_sends_the_version_whole(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    flat = {"w": torch.randn(200_000, generator=gen)}
    layout = FlatLayout.from_weights(flat)
    base = DeltaBase(layout, chunk_bytes=4096)
    base.update(flat, 0)
    compare = DeltaBase._changes
    calls = 0
    lock = threading.Lock()
    failed = threading.Event()

    def fails_once(self, chunk, compared, room, most):
        nonlocal calls
        with lock:
            calls += 1
            call = calls
        if call == 7:
            failed.set()
            raise MemoryError("no room")
        if call in (5, 6):  # chunks before it finish after it failed: they hear of it, and the cause is still raised
            assert failed.wait(30)
        return compare(self, chunk, compared, room, most)

    monkeypatch.setattr(DeltaBase, "_changes", fails_once)
    monkeypatch.setattr(_Rooms, "WAIT_S", 3600.0)  # the chunks after it hear of it, they do not wait it out
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    changed = _change(flat, 0.01, gen)
    with pytest.raises(MemoryError, match="no room"):
        base.update(changed, 1)
    assert base.version is None  # its copy is partly the new version: it holds none
    made = sum(base._rooms._made.values())  # (the parts waiting gave their rooms back)
    assert sum(len(free) for free in base._rooms._free.values()) == made
    assert base.update(changed, 2) is None and torch.equal(base.buffer, _bytes(layout, changed))


def test_a_body_of_at_least_most_bytes_is_not_packed_and_says_its_size():
    gen = torch.Generator().manual_seed(8)
    flat = {"w": torch.randn(100_000, generator=gen)}
    layout = FlatLayout.from_weights(flat)
    base = DeltaBase(layout, chunk_bytes=4096)
    base.update(flat, 0)
    changed = _change(flat, 0.02, gen)
    full = base.update(changed, 1)
    assert full is not None and full.nbytes > 0
    base.update(flat, 2)
    under = base.update(changed, 3, most=full.nbytes + 1)  # (from version 2, the same changes again)
    assert under is not None and torch.equal(under.body, full.body)
    base.update(flat, 4)
    over = base.update(changed, 5, most=full.nbytes)
    assert over is not None and over.body.numel() == 0 and over.nbytes == full.nbytes
    assert torch.equal(base.buffer, _bytes(layout, changed))  # the copy is the new version all the same


def test_changes_are_found_by_bits_not_values():
    flat = {"w": torch.tensor([0.0, float("nan"), 1.0, 2.0])}
    layout = FlatLayout.from_weights(flat)
    base = DeltaBase(layout)
    base.update(flat, 0)
    nan_bits = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)  # another NaN
    new = {"w": torch.cat([torch.tensor([-0.0]), nan_bits, torch.tensor([1.0, 2.0])])}
    delta = base.update(new, 1, whole_if_larger=False)
    assert delta is not None and delta.kinds == [PATCH] and delta.counts == [2]
    assert torch.equal(base.buffer, _bytes(layout, new))


def test_most_changed_goes_whole_under_auto_and_nothing_changed_sends_nothing():
    gen = torch.Generator().manual_seed(1)
    flat = {"a": torch.randn(100_000, generator=gen), "b": torch.randn(10, generator=gen)}
    layout = FlatLayout.from_weights(flat)
    base = DeltaBase(layout, chunk_bytes=65536)
    base.update(flat, 0)
    same = base.update(flat, 1)
    assert same is not None and same.nbytes == 0 and set(same.kinds) == {SAME}
    moved = {k: v + 1 for k, v in flat.items()}
    whole = base.update(moved, 2)
    assert whole is not None and set(whole.kinds) == {WHOLE} and whole.nbytes == layout.nbytes


@pytest.mark.parametrize("more", [0, 1], ids=["at-the-bound", "one-past"])
def test_a_chunk_goes_whole_exactly_when_a_patch_would_not_be_smaller(more):
    flat = {"w": torch.zeros(50_000, dtype=torch.float32)}
    layout = FlatLayout.from_weights(flat)
    base = DeltaBase(layout)
    base.update(flat, 0)
    (chunk,) = base.chunks
    most = next(n for n in range(chunk.words, 0, -1) if changes_bytes(n, chunk)[1] < chunk.end - chunk.start)
    new = flat["w"].clone()
    new[torch.randperm(chunk.words, generator=torch.Generator().manual_seed(3))[: most + more]] = 1.0
    delta = base.update({"w": new}, 1)
    assert delta is not None and delta.kinds == ([WHOLE] if more else [changes_bytes(most, chunk)[0]])
    assert torch.equal(base.buffer, _bytes(layout, {"w": new}))


def test_tensors_that_start_off_an_8_byte_boundary_are_compared_as_well():
    whole = torch.randn(20_001, generator=torch.Generator().manual_seed(4))
    flat = {"a": whole[1:10_001], "b": whole[10_001:]}  # views 4 bytes past 8-byte boundaries
    layout = FlatLayout.from_weights(flat)
    base = DeltaBase(layout)
    base.update(flat, 0)
    old = base.buffer.clone()
    whole[[2, 9_999, 10_002, 20_000]] += 1.0
    delta = base.update(flat, 1)
    assert delta is not None and sum(delta.counts) == 4
    apply_delta(old, base.chunks, delta)
    assert torch.equal(old, _bytes(layout, flat)) and torch.equal(base.buffer, old)


@pytest.mark.parametrize("word", [np.uint8, np.int16, np.int32, np.int64])
def test_one_pass_finds_every_changed_word_and_stops_past_the_most_it_may_find(word):
    rng = np.random.default_rng(5)
    itemsize = np.dtype(word).itemsize
    for size in [0, 1, 7, 128 * 8 // itemsize - 1, 128 * 8 // itemsize + 3, 5000]:
        for changed in [0, 1, 3, size // 50, size // 3, size]:
            info = np.iinfo(word)  # every bit in play: lanes are cut out of 8-byte words, signs and all
            old = rng.integers(info.min, info.max, size, dtype=word, endpoint=True)
            new = old.copy()
            where = np.sort(rng.choice(size, min(changed, size), replace=False))
            bits = rng.integers(0, 8 * itemsize, where.size).astype(np.uint64)  # one bit of each, the top one too
            unsigned = new.view(f"u{itemsize}")
            unsigned[where] ^= (np.uint64(1) << bits).astype(unsigned.dtype)
            for most in sorted({0, where.size - 1, where.size, where.size + 1, size} - {-1}):
                at, values = np.empty(most + ROOM, np.int32), np.empty(most + ROOM, word)
                mine = old.copy()
                n = scan(new, mine, 10, at, values, 0, most)
                if where.size > most:
                    assert n == -1, (size, changed, most)
                else:
                    assert (
                        n == where.size
                        and np.array_equal(at[:n], where + 10)
                        and np.array_equal(values[:n], new[where])
                    )
                    assert np.array_equal(mine, new)


@pytest.mark.parametrize("word", [np.uint8, np.int32])
def test_one_pass_finds_changes_in_runs_of_blocks_and_in_blocks_alone(word):
    """A block right after one that held a change is looked at word by word without being tested whole first:
    changes at either end of such blocks, and in blocks alone between unchanged ones, are all found."""
    per_block = 128 * 8 // np.dtype(word).itemsize  # values of one block of the loop
    blocks = 40
    old = np.zeros(blocks * per_block + 5, dtype=word)
    # blocks 0-5 in a run, then 7, 9 and 10, then 20 and the tail; first, last and middle words of each
    changed = [0, 1, 2, 3, 4, 5, 7, 9, 10, 20]
    where = sorted({b * per_block + off for b in changed for off in (0, per_block // 2, per_block - 1)})
    where += [blocks * per_block + 4]
    new = old.copy()
    new[where] = 1
    at, values = np.empty(len(where) + ROOM, np.int32), np.empty(len(where) + ROOM, word)
    mine = old.copy()
    n = scan(new, mine, 0, at, values, 0, len(where))
    assert n == len(where) and at[:n].tolist() == where and (values[:n] == 1).all()
    assert np.array_equal(mine, new)


def test_the_loops_compile_where_numba_has_nowhere_to_cache_them():
    """A read-only install with no writable home: numba refuses to cache, and the loops are compiled in the
    process instead (in a process of its own: numba's locators are changed for the test)."""
    import subprocess
    import sys

    code = """
import numba.core.caching as caching
import numpy as np
for locator in caching.CacheImpl._locator_classes:
    locator.from_function = classmethod(lambda cls, function, path: None)
from weightsync.tensors import kernels
target = np.zeros(8, dtype=np.int32)
kernels.write_patch(target, np.array([2, 5], dtype=np.int32), np.array([7, 9], dtype=np.int32))
assert target.tolist() == [0, 0, 7, 0, 0, 9, 0, 0], target
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_changes_that_do_not_fit_are_refused_before_anything_is_written():
    gen = torch.Generator().manual_seed(2)
    flat = {"a": torch.randn(1000, generator=gen)}
    layout = FlatLayout.from_weights(flat)
    chunks = chunks_of(layout)
    base = DeltaBase(layout)
    base.update(flat, 0)
    target = base.buffer.clone()
    flat = _change(flat, 0.01, gen)
    delta = base.update(flat, 1, whole_if_larger=False)
    assert delta is not None and delta.kinds == [PATCH] and delta.counts[0] >= 2
    before = target.clone()
    count = delta.counts[0]
    for bad in ("beyond", "negative", "unsorted", "short"):
        broken = Delta(delta.base, delta.version, list(delta.kinds), list(delta.counts), delta.body.clone())
        positions = broken.body[: count * 4].view(torch.int32)
        if bad == "beyond":
            positions[-1] = chunks[0].words
        elif bad == "negative":
            positions[0] = -1
        elif bad == "unsorted":
            positions[0], positions[1] = int(positions[1]), int(positions[0])
        else:
            broken.body = broken.body[:-8]
        with pytest.raises(ConfigurationError):
            apply_delta(target, chunks, broken)
        assert torch.equal(target, before), bad
    plain = delta.to_plain()
    assert Delta.from_plain(plain, chunks).counts == delta.counts
    assert body_size(Delta.from_plain(plain, chunks), chunks) == delta.nbytes
    for wrong in (
        {**plain, "counts": [True]},
        {**plain, "kinds": [PATCH, PATCH]},
        {**plain, "nbytes": plain["nbytes"] + 8},
        {**plain, "counts": [chunks[0].words + 1]},
        {k: v for k, v in plain.items() if k != "base"},
        {**plain, "digest": 5},
    ):
        with pytest.raises(ConfigurationError):
            Delta.from_plain(wrong, chunks)


# ---------------------------------------------------------------- the distributed engine
class _Worker:
    """An in-process worker: a receiver applying in a thread of its own until stopped."""

    def __init__(self, scheme: ws.WeightSyncScheme, idx: int, model: torch.nn.Module, taking: bool = False) -> None:
        import pickle

        self.model = model
        self.scheme = pickle.loads(pickle.dumps(scheme))
        self.scheme.init_on_receiver(model_id=scheme.model_id, model=model, worker_idx=idx)
        self.errors: list[BaseException] = []
        self.closed: ws.ConnectionClosedError | None = None  # why its loop ended, if the sender ended it
        self.erred = threading.Event()  # (set once an error is recorded: a refusal is acked before it is)
        #: With ``taking``: each version is taken, then applied (as an inference engine's stager does); per version
        #: taken, the bytes of the copy kept for changes and of the model between the two.
        self.taking = taking
        self.between: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.discarding = 0  # with ``taking``: how many of the next versions taken are discarded, not applied
        self._stop = threading.Event()
        self._applied = threading.Condition()  # notified after each version applied
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def holds_version(self, version: int, timeout: float) -> bool:
        """Wait (up to ``timeout``) until this worker applied ``version``; whether it did."""
        with self._applied:
            return self._applied.wait_for(lambda: self.scheme.version == version, timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.taking:
                    applied = self.scheme.receive(timeout=0.05) is not None
                elif applied := (pending := self.scheme.take(0.05)) is not None:
                    kept = self.scheme._runtime.receiving.kept.buffer.clone()
                    self.between.append((kept, _flat_bytes(self.model)))
                    if self.discarding:
                        self.discarding -= 1
                        pending.discard()
                        continue
                    pending.apply()
                if applied:
                    with self._applied:
                        self._applied.notify_all()
            except ws.ConnectionClosedError as exc:
                self.closed = exc
                return
            except ws.WeightSyncError as exc:
                self.errors.append(exc)
                self.erred.set()

    def pause(self) -> None:
        """Stop receiving (alive, its connections open) until :meth:`resume`."""
        self._stop.set()
        self._thread.join(10)

    def resume(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.pause()
        self.scheme.shutdown()


@contextlib.contextmanager
def _logged(logger: str, text: str):
    """An event, set once ``logger`` logs a message that holds ``text`` (from any thread)."""
    seen = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                seen.set()

    watch = Watch()
    logging.getLogger(logger).addHandler(watch)
    try:
        yield seen
    finally:
        logging.getLogger(logger).removeHandler(watch)


def _flat_bytes(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in ws.WeightStrategy().flat(model).values()])


def _connected(n: int = 2, taking: bool = False, kind: Callable[[], torch.nn.Module] = lambda: build("tiny"), **kw):
    model = kind()
    scheme = ws.DistributedWeightSyncScheme(connect_timeout=60, **{"timeout": 20, "delta": "auto", **kw})
    scheme.init_on_sender(model_id="policy", model=model, num_workers=n)
    workers = [_Worker(scheme, i, kind(), taking) for i in range(n)]
    joiners = [threading.Thread(target=w.scheme.connect) for w in workers]
    for t in joiners:
        t.start()
    scheme.connect()
    for t in joiners:
        t.join(30)
    for w in workers:
        w.start()
    return model, scheme, workers


def _stop(scheme, workers) -> None:
    for w in workers:
        w.stop()
    scheme.shutdown()


def _sparse_step(model: torch.nn.Module, seed: int, fraction: float = 0.01) -> None:
    sparse_step(ws.WeightStrategy().flat(model).values(), seed, fraction)


def _all_hold(workers: list, model: torch.nn.Module, version: int) -> bool:
    """Whether every worker holds ``version``, and its bytes are the trainer's ``model``'s."""
    return all(w.scheme.version == version and _holds(w.model, model) for w in workers)


def _holds(replica: torch.nn.Module, model: torch.nn.Module, wire_dtype: str | None = None) -> bool:
    """Whether ``replica`` holds, bit for bit, what a whole send of ``model`` gives (cast to ``wire_dtype`` and
    back)."""
    wire = None if wire_dtype is None else getattr(torch, wire_dtype)
    got, sent = replica.state_dict(), model.state_dict()
    for key, tensor in sent.items():
        expected = tensor.to(wire).to(tensor.dtype) if wire is not None and tensor.is_floating_point() else tensor
        if not torch.equal(got[key].reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)):
            return False
    return True


TRACKED = pytest.mark.parametrize("track", [False, True], ids=["", "track_writes"])


@pytest.mark.parametrize("wire_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("checked", [False, True], ids=["", "checksum"])
@TRACKED
def test_many_versions_of_changes_are_bit_exact_on_every_worker(wire_dtype, checked, track):
    model, scheme, workers = _connected(wire_dtype=wire_dtype, checksum=checked, track_writes=track)
    try:
        for step in range(1, 13):
            _sparse_step(model, step, fraction=1.0 if step == 7 else 0.01)  # one step changes every value
            scheme.send()
            for w in workers:
                assert w.scheme.version == step and _holds(w.model, model, wire_dtype)
        stats = scheme.stats()
        # Every version to both workers as changes, even the one that changed every value: the tiny model's tensors
        # are mostly the layout's 64-byte padding, which never changes (whole chunks: the codec's tests).
        assert stats["changes_sent"] == 2 * 12
        assert all(not w.errors for w in workers)
    finally:
        _stop(scheme, workers)


class _Odd(torch.nn.Module):
    """A bool mask whose bytes may be other than 0 and 1 (a view of uint8 data: torch's copy of a bool writes 1 for
    each), and a channels_last conv weight: dense, not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(2, 4, 3).to(memory_format=torch.channels_last)
        self.register_buffer("mask", torch.zeros(8, dtype=torch.bool))


@pytest.mark.parametrize(("wire_dtype", "track"), [(None, True), ("bfloat16", False)])
def test_a_bool_mask_and_a_nan_in_a_permuted_tensor_end_as_a_whole_send_leaves_them(wire_dtype, track):
    """(an audit) The trainer's copy for changes took a bool's bytes as they were (3, where a whole send's copy
    writes 1: a worker sent changes, or sent whole from that copy, held 3; with a checksum every later change was
    refused), and converted a permuted tensor with ``.to()``, another loop than a whole send's ``copy_``: a NaN
    became 0xffff, not 0x7fc0, in bfloat16."""
    ran = {d: _connected(kind=_Odd, delta=d, wire_dtype=wire_dtype, track_writes=track) for d in ("auto", False)}
    try:
        for step in range(1, 5):
            for model, scheme, _ in ran.values():
                with torch.no_grad():
                    model.mask.view(torch.uint8)[step] = 3
                    model.conv.weight[0, 0, step % 3, 0] = float("nan")
                    model.conv.bias += 1
                scheme.send(worker_ids=0 if step == 2 else None)  # (worker 1 is sent version 3 whole)
            changed, whole = ([w.scheme.version for w in workers] for _, _, workers in ran.values())
            assert changed == whole == [step, step - 1 if step == 2 else step]
            for w, v in zip(ran["auto"][2], ran[False][2]):
                assert torch.equal(_flat_bytes(w.model), _flat_bytes(v.model)), (step, w.model.mask, v.model.mask)
        assert all(not w.errors for _, _, workers in ran.values() for w in workers)
        assert ran["auto"][1].stats()["changes_sent"] > 0
    finally:
        for _, scheme, workers in ran.values():
            _stop(scheme, workers)


@TRACKED
def test_a_worker_that_missed_versions_is_sent_the_version_whole(track):
    model, scheme, workers = _connected(track_writes=track)
    try:
        for step in (1, 2):
            _sparse_step(model, step)
            scheme.send(worker_ids=[0])  # worker 1 holds version 0
        _sparse_step(model, 3)
        scheme.send()
        assert scheme.stats()["changes_sent"] == 3  # worker 0 each time; worker 1 got version 2 whole
        for w in workers:
            assert w.scheme.version == 3 and _holds(w.model, model)
        _sparse_step(model, 4)
        scheme.send()  # both hold the base now
        assert scheme.stats()["changes_sent"] == 5
        assert all(_holds(w.model, model) for w in workers)
    finally:
        _stop(scheme, workers)


def test_a_worker_that_rejoins_after_a_failed_send_is_never_sent_the_bytes_of_that_send():
    """Version 1 goes as changes alone: the trainer's only whole copy of it is the one it compares with. The next send
    fails after that copy took its bytes (no free buffer): a worker that asks to rejoin then is told to ask again, not
    sent those bytes as version 1, and asks until a send succeeded: the same process then holds that send's version.
    (Before, it was refused for good and ended: also when its request came while a send was staging a version.)"""
    model, scheme, workers = _connected()
    core = scheme._runtime.sending
    try:
        _sparse_step(model, 1)
        scheme.send()
        assert scheme.stats()["changes_sent"] == 2
        version_1 = {k: v.clone() for k, v in model.state_dict().items()}
        _sparse_step(model, 2, fraction=0.5)
        engine = core.engine

        def busy(deadline, **where):
            raise SyncTimeoutError("no free staging buffer (the test's)", **where)

        with mock.patch.object(engine.pool, "acquire", busy), pytest.raises(SyncTimeoutError):
            scheme.send()
        with _logged(
            "weightsync.transports.distributed", "refused worker 1 connecting again: no whole version"
        ) as told:
            core.mark_dead(1, ws.WeightSyncError("dropped by the test", worker_idx=1))  # it asks to rejoin
            assert told.wait(30), "worker 1 was not told to ask again"
        assert workers[1].closed is None and workers[1].scheme.version == 1  # still asking, on its version 1
        assert all(torch.equal(workers[1].model.state_dict()[k], v) for k, v in version_1.items())
        with pytest.raises(ws.WeightSyncError, match="dropped by the test"):
            scheme.send()  # worker 0 is sent version 2 whole (the copy was forgotten); worker 1 is out, asking
        assert workers[0].scheme.version == 2 and _holds(workers[0].model, model)
        assert workers[1].holds_version(2, 30), workers[1].closed  # let back in: version 2, whole
        assert workers[1].closed is None and _holds(workers[1].model, model)
        _sparse_step(model, 3)
        scheme.send()  # both, as before
        assert _all_hold(workers, model, 3)
    finally:
        _stop(scheme, workers)


def test_a_worker_whose_copy_is_not_the_base_refuses_and_is_sent_the_version_whole_in_the_same_send():
    model, scheme, workers = _connected(checksum=True)
    try:
        _sparse_step(model, 1)
        scheme.send()
        kept = workers[1].scheme._runtime.receiving.kept.buffer
        kept[0] ^= 0xFF  # worker 1's copy of version 1 is no longer the sender's bytes
        _sparse_step(model, 2)
        scheme.send()  # no error: refused, then sent whole
        assert _all_hold(workers, model, 2)
        assert scheme.stats()["changes_sent"] == 2 + 1
        assert not workers[1].errors or all(isinstance(e, ws.DeltaBaseError) for e in workers[1].errors)
        _sparse_step(model, 3)
        scheme.send()  # its copy is whole again: changes reach both
        assert scheme.stats()["changes_sent"] == 3 + 2
        assert all(_holds(w.model, model) for w in workers)
    finally:
        _stop(scheme, workers)


def test_changes_taken_ahead_are_made_whole_before_the_apply_and_a_refusal_is_the_applys():
    # A worker that takes a version ahead and applies it later (an inference engine pauses for the apply alone)
    # has the whole version made of the changes when it takes them: its model is still the old version then.
    model, scheme, (worker,) = _connected(1, taking=True, checksum=True)
    try:
        before = _flat_bytes(worker.model)
        with torch.no_grad():
            next(model.parameters()).view(-1)[:2] += 1.0  # a step that changed two values
        scheme.send()
        kept, held = worker.between[-1]
        assert torch.equal(held, before) and not torch.equal(held, _flat_bytes(model))
        assert torch.equal(kept, scheme._runtime.sending.changes.base.buffer)  # the new version, made of the changes
        assert _holds(worker.model, model) and scheme.stats()["changes_sent"] == 1
        worker.scheme._runtime.receiving.kept.buffer[0] ^= 0xFF  # its copy is no longer the sender's bytes
        _sparse_step(model, 2)
        scheme.send()  # refused when taken, acked so when applied, then sent whole in the same send
        assert worker.scheme.version == 2 and _holds(worker.model, model)
        assert [type(e) for e in worker.errors] == [ws.DeltaBaseError]
        assert scheme.stats()["changes_sent"] == 1
    finally:
        worker.stop()
        scheme.shutdown()


def test_changes_refused_when_taken_and_then_discarded_are_acked_refused_and_sent_whole_in_the_same_send():
    # The program discarded a version the worker had refused on taking it (its copy is not the base): the ack says
    # why it was refused (it said "discarded" before), so the sender sends it whole in the same send.
    model, scheme, (worker,) = _connected(1, taking=True, checksum=True)
    try:
        _sparse_step(model, 1)
        scheme.send()
        worker.scheme._runtime.receiving.kept.buffer[0] ^= 0xFF  # its copy is no longer the sender's bytes
        worker.discarding = 1
        _sparse_step(model, 2)
        scheme.send()
        assert worker.scheme.version == 2 and _holds(worker.model, model) and worker.discarding == 0
        assert scheme.stats()["changes_sent"] == 1
    finally:
        worker.stop()
        scheme.shutdown()


class _Tied(torch.nn.Module):
    """An embedding and an output layer of 5 MB each (the second's chunks apart from the first's), the same
    Parameter under both names where ``tie``."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20000, 64)
        self.head = torch.nn.Linear(64, 20000, bias=False)
        if tie:
            self.head.weight = self.emb.weight


@pytest.mark.parametrize("track", [False, True], ids=["", "track_writes"])
@pytest.mark.parametrize("trainer_tied", [False, True], ids=["apart", "tied"])
def test_a_worker_whose_model_ties_two_names_ends_as_a_whole_send_leaves_it(track, trainer_tied, monkeypatch):
    # (state_dict names both.) A whole send writes the first name, then the second over the memory they share: the
    # second's bytes win. Under track_writes, where the trainer keeps the two apart, the changes of the first were
    # written alone, and the worker's model held bytes of the first no whole send leaves there; where the trainer
    # ties them too (the same bytes under both), the changes alone are written still.
    from weightsync.core.kept import KeptCopy

    changes_alone: list[bool] = []
    real = KeptCopy.write_changes
    monkeypatch.setattr(KeptCopy, "write_changes", lambda *a: changes_alone.append(real(*a)) or changes_alone[-1])
    torch.manual_seed(0)
    trainer, replica = _Tied(tie=trainer_tied), _Tied(tie=True)
    scheme = ws.DistributedWeightSyncScheme(
        timeout=20, connect_timeout=60, delta="auto", track_writes=track, strategy="state_dict"
    )
    scheme.init_on_sender(model_id="policy", model=trainer, num_workers=1)
    worker = _Worker(scheme, 0, replica)
    joining = threading.Thread(target=worker.scheme.connect)
    joining.start()
    scheme.connect()
    joining.join(30)
    worker.start()
    try:
        for step in (1, 2):
            with torch.no_grad():
                trainer.emb.weight[step, :5] += 1.0  # changes in the first name's first chunk alone
            scheme.send()
            assert torch.equal(replica.emb.weight, trainer.head.weight), step  # what a whole send leaves
        assert changes_alone[-1] is (track and trainer_tied), changes_alone
    finally:
        _stop(scheme, [worker])


def _second_copy_not_the_base(**kw) -> tuple:
    """Two workers that took version 1's changes; worker 1's copy of it is then no longer the sender's bytes, and
    the trainer takes a step (``kw``: the scheme's options)."""
    model, scheme, workers = _connected(2, checksum=True, **kw)
    _sparse_step(model, 1)
    scheme.send()
    workers[1].scheme._runtime.receiving.kept.buffer[0] ^= 0xFF
    _sparse_step(model, 2)
    return model, scheme, workers


def test_a_worker_that_refuses_changes_is_sent_whole_the_bytes_the_others_were_sent_changes_to(monkeypatch):
    """The trainer's tensors move on while a send waits for its acks (another thread steps): the worker that
    refused the changes is sent the version whole from the trainer's copy of it, the bytes the others hold, not
    from the moved tensors (which later changes, against the copy, would never mend)."""
    model, scheme, workers = _second_copy_not_the_base()
    sender = scheme._sending
    collect = sender.collect

    def stepped_meanwhile(expected, deadline, within=None):
        got = collect(expected, deadline, within)
        _sparse_step(model, 9)
        return got

    try:
        sent = _flat_bytes(model)
        monkeypatch.setattr(sender, "collect", stepped_meanwhile)
        scheme.send()  # version 2: worker 1 refuses its changes, and is sent it whole
        monkeypatch.undo()
        assert [w.scheme.version for w in workers] == [2, 2]
        assert torch.equal(_flat_bytes(workers[0].model), sent) and torch.equal(_flat_bytes(workers[1].model), sent)
        scheme.send()
        assert _all_hold(workers, model, 3)
    finally:
        _stop(scheme, workers)


def test_a_worker_that_refused_changes_and_then_stopped_on_the_whole_version_is_passed_by_until_it_acks(monkeypatch):
    """Worker 1 refuses version 2's changes, then stops (a debugger) before it acks the version sent whole: it is
    late on that version, and the next send passes it by at once. Its refusal had counted as the end of version 2's
    call, so the next send waited its whole timeout for it, and held another buffer (found by a review)."""
    model, scheme, workers = _second_copy_not_the_base()
    sender = scheme._sending
    whole_again = sender._send_whole_again

    def stopped_after_its_refusal(out, failures, deadline, within):
        workers[1].pause()
        return whole_again(out, failures, deadline, within)

    try:
        scheme.timeout = 1.0
        monkeypatch.setattr(sender, "_send_whole_again", stopped_after_its_refusal)
        with pytest.raises(ws.SyncTimeoutError, match=r"worker 1, version 2\] no ack for version 2"):
            scheme.send()
        monkeypatch.undo()
        _sparse_step(model, 3)
        began = time.monotonic()
        with pytest.raises(ws.SyncTimeoutError, match=r"version 3\] passed by: still no ack for version 2"):
            scheme.send()
        assert time.monotonic() - began < scheme.timeout
        assert _all_hold(workers[:1], model, 3)
    finally:
        monkeypatch.undo()
        workers[1].resume()
    try:
        scheme.wait_async()  # it takes version 2, sent whole
        _sparse_step(model, 4)
        scheme.send()
        assert _all_hold(workers, model, 4)
    finally:
        _stop(scheme, workers)


@pytest.mark.parametrize("flatten", [False, True], ids=["", "flatten_sender"])
def test_a_worker_sent_a_version_whole_gets_the_bytes_the_others_were_sent_changes_to(monkeypatch, flatten):
    """Worker 1 missed a version (sent to worker 0 alone), so the next send sends worker 0 changes and worker 1 the
    version whole; another thread steps the trainer's tensors between the copy's update and the staging. Worker 1
    gets the copy's bytes, the ones worker 0's changes make, not the stepped tensors: where a later step put a
    value back, changes made against the copy would never mend it (worker 1 differed for good)."""
    model, scheme, workers = _connected(flatten_sender=flatten)
    engine = scheme._sending.engine
    stage = engine.stage

    def stepped_meanwhile(out, deadline):
        with torch.no_grad():
            model.body[0].weight.view(-1)[7] += 1.0
        return stage(out, deadline)

    try:
        _sparse_step(model, 1)
        scheme.send(worker_ids=[0])  # version 1, to worker 0 alone
        _sparse_step(model, 2)
        sent = _flat_bytes(model)
        monkeypatch.setattr(engine, "stage", stepped_meanwhile)
        scheme.send()  # version 2: changes to worker 0, whole to worker 1
        monkeypatch.undo()
        assert sorted(scheme.last_send.changes) == [0]
        assert torch.equal(_flat_bytes(workers[0].model), sent) and torch.equal(_flat_bytes(workers[1].model), sent)
        with torch.no_grad():
            model.body[0].weight.view(-1)[7] -= 1.0  # (the value the copy holds, back)
        for step in (3, 4):
            _sparse_step(model, step)
            scheme.send()
            assert _all_hold(workers, model, step)
    finally:
        monkeypatch.undo()
        _stop(scheme, workers)


def test_an_async_send_whose_changes_a_worker_refuses_sends_it_whole_before_wait_async_returns():
    # The trainer's tensors may have moved on once send_async returned: the whole version is sent from the copy.
    model, scheme, workers = _second_copy_not_the_base()
    try:
        sent = ws.WeightStrategy().flat(model)
        sent = {k: v.clone() for k, v in sent.items()}
        scheme.send_async()
        record = scheme.last_send
        _sparse_step(model, 3)  # (the trainer's next step, before the acks are collected)
        scheme.wait_async(20)
        assert sorted(record.changes) == [0, 1] and scheme.stats()["changes_sent"] == 4  # (the sends, as made)
        for worker in workers:
            assert worker.scheme.version == 2
            got = {k: v.view(-1).view(torch.uint8) for k, v in ws.WeightStrategy().flat(worker.model).items()}
            assert all(torch.equal(got[k], v.view(-1).view(torch.uint8)) for k, v in sent.items())
        assert [type(e) for e in workers[1].errors] == [ws.DeltaBaseError]
    finally:
        _stop(scheme, workers)


def test_the_whole_resend_under_wait_async_waits_by_and_names_wait_asyncs_timeout(monkeypatch):
    """A version a worker refused the changes of is sent it whole within ``wait_async``'s own ``timeout``, and a
    time-out of that resend names it (it named the scheme's ``timeout``, 30 s, where ``wait_async`` said 20)."""
    model, scheme, workers = _second_copy_not_the_base()
    sender = scheme._sending
    collect, bounds = sender.collect, []

    def recorded(expected, deadline, within=None):
        bounds.append((sorted(expected), within))
        return collect(expected, deadline, within)

    try:
        monkeypatch.setattr(sender, "collect", recorded)
        scheme.send_async()
        scheme.wait_async(20)
        monkeypatch.undo()
        assert bounds == [([0, 1], 20), ([1], 20)]  # the wait, then worker 1's whole resend
        assert _all_hold(workers, model, 2)
    finally:
        _stop(scheme, workers)


def test_a_version_whose_refusers_are_all_gone_by_its_whole_resend_goes_to_no_one_and_they_are_named():
    # Sent to no one, the whole version would still be staged and submitted, and stand as the engine's newest
    # whole version: Ray's kept no bytes of it (a whole resend has none published), and its next rejoin failed.
    import types

    from weightsync.core.engine import Outgoing
    from weightsync.core.ledger import Ledger
    from weightsync.core.sender import Sender

    class Engine:
        submitted: list = []

        def stage(self, out, deadline):
            return out

        def submit(self, out, staged):
            self.submitted.append(out.version)

    ledger = Ledger("policy")
    gone = ws.WorkerDiedError("its actor died", model_id="policy", worker_idx=0)
    ledger.dead[0] = gone  # (it refused version 5's changes, then died)
    sender = types.SimpleNamespace(
        engine=Engine(), ledger=ledger, model_id="policy", collect=lambda expected, deadline, within: {}
    )
    failures: dict = {}
    Sender._send_whole_again(sender, Outgoing(5, {"w": torch.ones(4)}, None, [0]), failures, 1e18, None)  # type: ignore[arg-type]
    assert sender.engine.submitted == [] and list(failures) == [0]
    assert type(failures[0]) is ws.WorkerDiedError and str(failures[0]) == str(gone)  # (a copy, raised by this send)


def test_a_refusal_of_an_older_async_versions_changes_does_not_fail_the_send_that_sends_it_whole():
    model, scheme, workers = _second_copy_not_the_base()
    try:
        scheme.send_async()
        assert workers[1].erred.wait(20)  # (its refusal came back; nobody waited)
        assert [type(e) for e in workers[1].errors] == [ws.DeltaBaseError]
        _sparse_step(model, 3)
        scheme.send()  # version 3 goes whole to worker 1 (it acked version 1 only): version 2's refusal is moot
        assert _all_hold(workers, model, 3)
    finally:
        _stop(scheme, workers)


def test_a_refusal_of_an_async_versions_changes_whose_copy_a_send_to_others_moved_on_is_named_and_mended_next():
    """Worker 1 refuses an asynchronous send's changes and stops receiving (alive); a send to worker 0 alone moves
    the trainer's copy on before ``wait_async``. That send is not held by worker 1 (nor by a staging buffer a whole
    resend to it would take), the refused version can no longer be sent whole, and ``wait_async`` names worker 1's
    refusal; worker 1 holds the whole version before, and the next send to it goes whole. No ack of the refused
    version is waited for after that (a second ``wait_async`` waited for it until its timeout)."""
    model, scheme, workers = _second_copy_not_the_base(timeout=3.0)
    try:
        before = _flat_bytes(workers[1].model)
        scheme.send_async()  # version 2: worker 1 refuses its changes
        assert workers[1].erred.wait(20)
        workers[1].pause()
        _sparse_step(model, 3)
        scheme.send(worker_ids=[0])  # version 3, to worker 0 alone
        assert workers[0].scheme.version == 3 and _holds(workers[0].model, model)
        workers[1].resume()
        with pytest.raises(ws.ReceiverError, match="worker 1.*DeltaBaseError"):
            scheme.wait_async(20)
        assert workers[1].scheme.version == 1 and torch.equal(_flat_bytes(workers[1].model), before)
        began = time.monotonic()
        scheme.wait_async(20)
        assert time.monotonic() - began < 2.0
        _sparse_step(model, 4)
        scheme.send()
        assert _all_hold(workers, model, 4)
    finally:
        _stop(scheme, workers)


def test_a_worker_whose_config_has_delta_off_refuses_changes_once_then_keeps_a_copy(caplog):
    """A worker built from a receiver config edited to ``delta: false`` under a trainer with ``delta`` on refused
    every version's changes (it kept no copy): each version went twice, and its ``receive()`` raised each time.
    It now keeps a copy once changes came (said once), from the version sent whole next."""
    model = build("tiny")
    scheme = ws.DistributedWeightSyncScheme(connect_timeout=60, timeout=20, delta="auto")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    cfg = scheme.receiver_config(0)
    cfg["scheme"]["delta"] = False
    worker, replica = ws.from_config(cfg), build("tiny")
    worker.init_on_receiver(model_id="policy", model=replica, worker_idx=0)
    connect_pair(scheme, worker)
    errors: list[str] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                worker.receive(timeout=0.05)
            except ws.WeightSyncError as exc:
                errors.append(type(exc).__name__)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    changes = []
    try:
        with caplog.at_level(logging.WARNING, logger="weightsync"):
            for step in (1, 2, 3, 4):
                _sparse_step(model, step)
                scheme.send()
                changes.append(bool(scheme.last_send.changes))
                assert worker.version == step and _holds(replica, model), step
        assert changes == [False, True, True, True] and errors == ["DeltaBaseError"]
        assert sum("kept no copy" in r.getMessage() for r in caplog.records) == 1
    finally:
        stop.set()
        thread.join(5)
        worker.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize("bound", [None, 1], ids=["unbounded", "max_staleness"])
def test_a_refusal_of_an_older_async_versions_changes_does_not_fail_the_next_async_send_that_sends_it_whole(bound):
    """(Under ``max_staleness``, the bound's wait before version 3 found the refusal and raised it: version 3 went
    to no worker.)"""
    model, scheme, workers = _second_copy_not_the_base(max_staleness=bound)
    try:
        scheme.send_async()  # version 2: worker 1 refuses its changes
        assert workers[1].erred.wait(20)
        _sparse_step(model, 3)
        scheme.send_async()  # version 3 goes whole to worker 1 (it acked version 1 only): the refusal is moot
        scheme.wait_async(20)
        assert _all_hold(workers, model, 3)
    finally:
        _stop(scheme, workers)


@pytest.mark.parametrize("bound", [None, 2], ids=["unbounded", "max_staleness"])
def test_a_refusal_found_in_a_staleness_bounds_wait_after_a_later_version_went_whole_is_moot(bound):
    """Worker 1 refuses version 2's changes after version 3 went to it whole: under ``max_staleness=2``, the bound's
    wait before version 4 expected version 2 of it, found the refusal and raised it (version 4 went to no worker),
    where the refusal is moot (found by a review). The bound now waits for version 3's ack instead."""
    model, scheme, workers = _second_copy_not_the_base(max_staleness=bound, timeout=10.0)
    try:
        workers[1].pause()
        scheme.send_async()  # version 2: changes to both
        pending = workers[1].scheme.take(10)
        assert pending is not None and pending.version == 2
        _sparse_step(model, 3)
        scheme.send_async()  # version 3: whole to worker 1 (it acked 1 only)
        with pytest.raises(ws.DeltaBaseError):
            pending.apply()  # (its refusal of version 2 is acked now)
        _sparse_step(model, 4)
        threading.Timer(1.0, workers[1].resume).start()  # (it takes version 3 while the bound waits)
        scheme.send_async()  # version 4: the bound waits for worker 1's ack of version 3 (lag 3, at most 2)
        scheme.wait_async(20)
        assert _all_hold(workers, model, 4)
    finally:
        _stop(scheme, workers)


@TRACKED
def test_a_workers_own_change_to_its_model_is_gone_at_the_next_update_as_with_whole_versions(track):
    model, scheme, workers = _connected(track_writes=track)
    try:
        for step in (1, 2, 3, 4, 5):
            if step != 4:  # (version 4: nothing changed in the trainer, the worker's own write alone to undo)
                _sparse_step(model, step)
            with workers[0].scheme.weights_lock, torch.no_grad():
                last = list(workers[0].model.parameters())[-1]
                if step % 2:
                    last.add_(100.0)
                else:  # written where no version counter sees it
                    last.data.view(-1)[-1:].numpy()[:] = 7.0
            scheme.send()
            assert _holds(workers[0].model, model) and _holds(workers[1].model, model)
        assert scheme.stats()["changes_sent"] == 10
    finally:
        _stop(scheme, workers)


def test_delta_is_an_option_of_the_config_and_refuses_what_it_does_not_know():
    with pytest.raises(ConfigurationError, match="delta"):
        ws.DistributedWeightSyncScheme(delta="sometimes")
    assert ws.DistributedWeightSyncScheme(delta="auto").delta == "auto"
    scheme = ws.DistributedWeightSyncScheme(delta=True)
    scheme.init_on_sender(model_id="policy", model=build("tiny"), num_workers=1)
    try:
        assert scheme.receiver_config(0)["scheme"]["delta"] is True
    finally:
        scheme.shutdown()


def test_a_version_with_nothing_changed_is_an_empty_body_and_still_arrives():
    model = build("tiny")
    scheme = ws.DistributedWeightSyncScheme(timeout=20, connect_timeout=60, delta=True)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    import pickle

    receiver = pickle.loads(pickle.dumps(scheme))
    replica = build("tiny")
    receiver.init_on_receiver(model_id="policy", model=replica, worker_idx=0)
    connect_pair(scheme, receiver)
    from weightsync.transports.distributed.auth import NO_BYTES, PayloadMac

    keys: list[int] = []  # one-time keys derived, on either side (both are in this process)
    begin = PayloadMac.begin
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(PayloadMac, "begin", lambda self: keys.append(self.nbytes) or begin(self))
            _sparse_step(model, 1, fraction=0.0)  # nothing changed: an empty body
            scheme.send_async()
            assert receiver.receive(timeout=10) is not None
            scheme.wait_async()
        assert receiver.version == 1 and _holds(replica, model)
        assert scheme.stats()["changes_sent"] == 1
        assert keys == []  # no bytes, nothing to authenticate: the description is sealed in the announcement
        # Bytes under the digest that says there are none are refused.
        engine = receiver._runtime.receiving.engine
        some = engine.sealer.payload_mac(b"layout", torch.zeros(4, dtype=torch.uint8), 2, "aa", "hmac-sha256")
        assert isinstance(engine._verify(some, 2, 2, 1.0, NO_BYTES), ws.AuthenticationError)
        none = engine.sealer.payload_mac(b"layout", torch.zeros(0, dtype=torch.uint8), 2, "aa", "hmac-sha256")
        assert engine._verify(none, 2, 2, 1.0, NO_BYTES) is None
    finally:
        receiver.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize(("given", "held"), [("false", False), ("true", True), ("auto", "auto")])
def test_delta_is_one_command_line_override_away(given, held):
    from hydra import compose, initialize
    from hydra.utils import instantiate

    import weightsync.config  # noqa: F401 - registers the weightsync/... config groups

    with initialize(version_base="1.3"):
        cfg = compose(
            overrides=[
                "+weightsync/scheme=distributed",
                f"weightsync.scheme.delta={given}",
                f"weightsync.scheme.track_writes={given != 'false'}",
            ]
        )
    scheme = instantiate(cfg.weightsync.scheme)
    assert scheme.delta == held and scheme.track_writes is (given != "false")


def test_a_bitmap_that_marks_other_words_than_its_count_is_refused_before_anything_is_written():
    gen = torch.Generator().manual_seed(3)
    flat = {"a": torch.randn(100_000, generator=gen)}
    layout = FlatLayout.from_weights(flat)
    base = DeltaBase(layout)
    base.update(flat, 0)
    target = base.buffer.clone()
    delta = base.update(_change(flat, 0.2, gen), 1)
    assert delta is not None and delta.kinds == [BITMAP]
    broken = Delta(delta.base, delta.version, list(delta.kinds), list(delta.counts), delta.body.clone())
    broken.body[0] ^= 0xFF  # eight words marked otherwise
    before = target.clone()
    with pytest.raises(ConfigurationError, match="bitmap"):
        apply_delta(target, base.chunks, broken)
    assert torch.equal(target, before)
    # As many marks, one of them past the chunk's last word (in the bitmap's padding): refused, nothing written.
    past = Delta(delta.base, delta.version, list(delta.kinds), list(delta.counts), delta.body.clone())
    bits = past.body[:12_504].numpy()  # 100 000 words: 12 500 bytes of marks, padded to 8
    first = int(np.flatnonzero(bits)[0])
    bits[first] &= bits[first] - 1  # its lowest mark off ...
    bits[12_500] = 1  # ... and word 100 000 marked instead
    with pytest.raises(ConfigurationError, match="bitmap"):
        apply_delta(target, base.chunks, past)
    assert torch.equal(target, before)
    apply_delta(target, base.chunks, delta)
    assert torch.equal(target, base.buffer)


@pytest.mark.parametrize(
    ("kw", "inline"),
    [({}, True), ({"delta": False}, True), ({"delta": False}, False), ({"delta": False, "bucket_mb": 0.0003}, False)],
    ids=["changes", "whole-small", "whole-digest-after", "whole-in-buckets"],
)
def test_bytes_that_are_not_the_senders_are_refused_and_the_model_kept(monkeypatch, kw, inline):
    # Over `distributed` the keyed digest of changes, and of a small whole version, travels in their sealed
    # announcement; that of a larger version follows its bytes (`inline=False`: every version is larger): bytes
    # altered on the wire (or sent by a process that is not the trainer) do not hash to it.
    from weightsync.transports.distributed import sender
    from weightsync.transports.distributed.line import Line
    from weightsync.transports.distributed.messages import checked_announcement
    from weightsync.transports.distributed.transport import DistributedTransport

    if not inline:
        monkeypatch.setattr(sender, "INLINE_DIGEST_BYTES", -1)
    said_digests = []  # the digest each announcement carries (the initial weights have none: they are not announced)
    announce = DistributedTransport.announce

    def noted(self, *args, **kw):
        if not kw.get("initial"):
            said_digests.append(kw.get("digest"))
        return announce(self, *args, **kw)

    monkeypatch.setattr(DistributedTransport, "announce", noted)
    model, scheme, (worker,) = _connected(1, **kw)
    send_part = DistributedTransport.send_part

    def altered(self, part):
        if part.numel():
            part = part.clone()
            part[-1] ^= 0x01
        return send_part(self, part)

    write = Line.write

    def altered_on_the_line(self, chunks):  # (a small whole version's bytes follow its announcement there)
        if len(chunks) == 3:
            body = bytearray(memoryview(chunks[2]).cast("B"))
            body[-1] ^= 0x01
            chunks = [*chunks[:2], body]
        return write(self, chunks)

    try:
        _sparse_step(model, 1)
        scheme.send()
        held = _flat_bytes(worker.model)
        _sparse_step(model, 2)
        monkeypatch.setattr(DistributedTransport, "send_part", altered)
        monkeypatch.setattr(Line, "write", altered_on_the_line)
        with pytest.raises(ws.WeightSyncError, match="keyed digest"):
            scheme.send()
        assert worker.scheme.version == 1 and torch.equal(_flat_bytes(worker.model), held)
        assert worker.erred.wait(10)  # (the worker's thread records its refusal after acking it)
        assert [type(e) for e in worker.errors] == [ws.AuthenticationError]
    finally:
        worker.stop()
        scheme.shutdown()
    assert said_digests and all((d is not None) == inline for d in said_digests)
    said = b'{"version": 3, "nonce": "ab", "mac": "aes-gmac", "digest": 7}'  # a digest that is no string
    with pytest.raises(ws.TransportError, match="no announcement a sender makes"):
        checked_announcement(said, "msg/0/3")
    assert checked_announcement(said.replace(b"7", b'"00"'), "msg/0/3")["digest"] == "00"
