"""The kernel's record of written pages (``track_writes``): every way a process writes its memory shows, nothing
else does, and where the record cannot be trusted the answer is "all of it".

The schemes' use of it (the trainer compares, a worker rewrites, only what was written) runs in
``tests/test_delta.py`` with ``track_writes`` on.
"""

from __future__ import annotations

import os

import pytest
import torch

from weightsync.tensors import written as written_module
from weightsync.tensors.delta import SAME, apply_delta
from weightsync.tensors.delta_base import DeltaBase
from weightsync.tensors.layout import FlatLayout
from weightsync.tensors.written import PAGE, open_tracker

pytestmark = pytest.mark.skipif(
    open_tracker() is None, reason="this kernel keeps no record of written pages (Linux 6.7+, userfaultfd allowed)"
)


@pytest.fixture
def tracker():
    made = open_tracker()
    assert made is not None
    yield made
    made.close()


def _own_pages(numel: int) -> torch.Tensor:
    """Zeros (float32) on pages no other memory shares: no write elsewhere marks them (the record is by page)."""
    per_page = PAGE // 4
    room = torch.zeros(numel + 2 * per_page)
    skip = (-room.data_ptr() % PAGE) // 4
    return room[skip : skip + -(-numel // per_page) * per_page]


def _pages_of(tensor: torch.Tensor, first: int, last: int) -> tuple[int, int]:
    """The byte range, from ``tensor``'s first byte, of the pages holding its bytes ``first`` to ``last``."""
    start = tensor.data_ptr()
    lo = (start + first) // PAGE * PAGE - start
    hi = -(-(start + last + 1) // PAGE) * PAGE - start
    return max(lo, 0), min(hi, tensor.numel() * tensor.element_size())


def test_every_way_of_writing_shows_and_nothing_else_does(tracker, tmp_path):
    big, other = _own_pages(1 << 20), torch.zeros(1 << 20)
    assert tracker.written({"big": big}) == {"big": None}  # first seen: all of it
    assert tracker.written({"big": big}) == {"big": []}
    other.add_(1.0)  # memory it was not asked about
    _ = big.sum()  # reads
    assert tracker.written({"big": big}) == {"big": []}

    big[10] = 1.0  # an in-place op
    big.data[300_000] = 2.0  # through .data, where torch's version counter does not see it
    big.numpy()[600_000] = 3.0  # through numpy
    path = tmp_path / "blob"
    path.write_bytes(b"\x01" * 8)
    with open(path, "rb") as f:  # by the kernel, in a system call
        f.readinto(big.numpy().view("uint8")[3_600_000:3_600_008])
    expected = [_pages_of(big, 40, 43), _pages_of(big, 1_200_000, 1_200_003)]
    expected += [_pages_of(big, 2_400_000, 2_400_003), _pages_of(big, 3_600_000, 3_600_007)]
    assert tracker.written({"big": big}) == {"big": expected}
    assert tracker.written({"big": big}) == {"big": []}  # protected again


#: Run in a process of its own: the ring's pin stays counted (``VmPin``) until the kernel tears the ring down, and
#: every tensor of the process that pins counts as written whole meanwhile.
_WRITTEN_THROUGH_A_PIN = """
import tempfile, torch
from tests._uring import FixedBuffer
from weightsync.tensors.written import open_tracker
model = torch.zeros(8 * 4096, dtype=torch.uint8)
try:
    ring = FixedBuffer(model)  # (pinned before any tracking: the pages carry no write-protect mark)
except OSError as exc:
    raise SystemExit(f"skip: io_uring is not allowed here ({exc})")
tracker = open_tracker()
tracker.written({"model": model}), tracker.written({"model": model})  # (seen, then protected)
with tempfile.TemporaryFile() as source:
    source.write(bytes(range(1, 256)) * 129)
    source.flush()
    assert ring.read_into(source.fileno(), model.numel()) == model.numel()
changed = set(model.nonzero().flatten().tolist())
found = tracker.written({"model": model})["model"]
missed = changed if found is None else changed - {i for lo, hi in found for i in range(lo, hi)}
print("missed none" if found is None or not missed else f"missed {len(missed)} of {len(changed)} bytes written")
ring.close()
"""


def test_a_write_the_kernel_makes_through_pages_pinned_for_it_is_not_missed():
    """The kernel writes through its own mapping of pages pinned for it (an io_uring fixed buffer's read; a
    device's DMA into host memory registered for it, an RDMA registration), so such a write makes no fault and
    leaves no mark: of a buffer pinned before it was tracked, a kernel read into it was missed on 3 pages of 4 and
    the trainer sent nothing of it (a review: workers acked versions whose bytes they never got). While the process
    pins memory (``VmPin``) every tensor is written whole."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(
        [sys.executable, "-c", _WRITTEN_THROUGH_A_PIN], cwd=root, capture_output=True, text=True, timeout=120
    )
    said = run.stderr.strip().splitlines()
    if run.returncode == 1 and said and said[-1].startswith("skip:"):
        pytest.skip(said[-1])
    assert run.returncode == 0 and run.stdout.strip() == "missed none", run.stdout + run.stderr


def test_a_tensor_page_locked_for_a_device_is_never_tracked(tracker, monkeypatch):
    """A GPU's copies into host memory page-locked for it are DMA, which leaves no mark: such a tensor is written
    whole at every call, and so is one whose question fails (a process forked from one that ran CUDA). (No GPU
    here: torch's answer is what is put in its place.)"""
    pinned, asked = _own_pages(4096), _own_pages(4096)
    tracker.written({"pinned": pinned, "asked": asked})
    assert tracker.written({"pinned": pinned, "asked": asked}) == {"pinned": [], "asked": []}

    def is_pinned(tensor: torch.Tensor) -> bool:
        if tensor.data_ptr() == asked.data_ptr():
            raise RuntimeError("CUDA error: initialization error")
        return tensor.data_ptr() == pinned.data_ptr()

    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    for _ in range(2):
        assert tracker.written({"pinned": pinned, "asked": asked}) == {"pinned": None, "asked": None}


def test_a_tensor_moved_resized_or_in_memory_the_kernel_will_not_protect_is_written_whole(tracker):
    a, b = _own_pages(100_000), _own_pages(100_000)  # (a page shared with the heap shows its other writes)
    tracker.written({"w": a})
    assert tracker.written({"w": a}) == {"w": []}
    assert tracker.written({"w": b}) == {"w": None}  # another tensor under the key
    assert tracker.written({"w": b[:50_000]}) == {"w": None}  # resized
    shared = torch.zeros(100_000).share_memory_()  # another process may write it: never trusted
    strided = torch.zeros(100, 100).t()
    for _ in range(2):
        assert tracker.written({"shared": shared, "strided": strided}) == {"shared": None, "strided": None}


def test_memory_one_owner_tracks_is_all_written_to_another_until_it_lets_go():
    # One owner's scan clears the marks of the pages it scans: a second owner of those pages would miss writes.
    first, second = open_tracker(), open_tracker()
    assert first is not None and second is not None
    try:
        t = _own_pages(1 << 20)
        first.written({"t": t})
        for _ in range(2):
            assert second.written({"t": t}) == {"t": None}
        t[0] = 1.0
        assert first.written({"t": t}) == {"t": [_pages_of(t, 0, 3)]}
        first.close()
        second.written({"t": t})
        t[0] = 2.0
        assert second.written({"t": t}) == {"t": [_pages_of(t, 0, 3)]}
    finally:
        first.close()
        second.close()


def test_the_trainers_copy_compares_only_what_was_written_and_misses_no_write():
    flat = {"w": torch.randn(3_000_000), "h": torch.randn(5000).to(torch.bfloat16), "i": torch.arange(999)}
    layout = FlatLayout.from_weights(flat)
    base = DeltaBase(layout, track_writes=True)
    replica = torch.zeros(layout.nbytes, dtype=torch.uint8)
    try:
        assert base.tracks_writes
        assert base.update(flat, 0) is None
        replica.copy_(base.buffer)

        def step(version: int) -> list[int]:
            delta = base.update(flat, version)
            assert delta is not None
            apply_delta(replica, base.chunks, delta)
            views = layout.views(replica)
            assert all(torch.equal(views[k], flat[k]) for k in flat)
            return delta.kinds

        assert set(step(1)) == {SAME}  # nothing written
        flat["w"].data.view(torch.int32)[2_999_999] ^= 1  # one bit, through .data
        flat["i"].numpy()[5] = -1
        kinds = step(2)
        assert sum(k != SAME for k in kinds) == 2
        flat["h"][:] = flat["h"]  # written, not changed
        assert set(step(3)) == {SAME}
        base.forget()  # (a version not sent: the next fills the copy whole)
        flat["w"][7] = 0.5
        assert base.update(flat, 4) is None and torch.equal(base.buffer, _bytes(layout, flat))
        replica.copy_(base.buffer)
        flat["w"][8] = 0.25
        assert sum(k != SAME for k in step(5)) == 1
    finally:
        base.close()


def _bytes(layout: FlatLayout, flat: dict[str, torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for key, view in layout.views(out).items():
        view.copy_(flat[key])
    return out


def test_where_the_kernel_keeps_no_record_everything_is_compared(monkeypatch):
    def refused(self: object) -> None:
        raise OSError(1, "userfaultfd: Operation not permitted")  # (a seccomp profile that refuses it)

    monkeypatch.setattr(written_module._Kernel, "__init__", refused)
    monkeypatch.setattr(written_module, "_kernels", {})
    assert open_tracker() is None
    flat = {"w": torch.randn(100_000)}
    layout = FlatLayout.from_weights(flat)
    base = DeltaBase(layout, track_writes=True)
    assert not base.tracks_writes
    base.update(flat, 0)
    flat["w"].data[5] = 1.0
    delta = base.update(flat, 1)
    assert delta is not None and sum(k != SAME for k in delta.kinds) == 1
    assert os.getpid() in written_module._kernels


def test_pages_unprotected_before_a_write_count_as_written_until_protected_again(tracker):
    t, elsewhere = _own_pages(1 << 20), torch.zeros(1 << 16)
    tracker.written({"t": t})
    assert tracker.written({"t": t}) == {"t": []}
    tracker.unprotect([t[: 2 * PAGE // 4], elsewhere])  # two pages of it; memory it does not track: nothing
    assert tracker.written({"t": t}) == {"t": [(0, 2 * PAGE)]}
    assert tracker.written({"t": t}) == {"t": []}


def test_pages_protected_after_a_write_forget_it_and_the_others_keep_theirs(tracker):
    t = _own_pages(1 << 20)
    tracker.written({"t": t})
    tracker.written({"t": t})
    t[0] = 1.0  # the update's write ...
    t[5 * PAGE // 4] = 1.0  # ... and the program's, elsewhere
    tracker.protect([t[:1], t[1:2]])
    assert tracker.written({"t": t}) == {"t": [(5 * PAGE, 6 * PAGE)]}


def test_a_tracker_made_before_a_fork_knows_nothing_in_the_child_and_touches_nothing_of_the_parent(tracker):
    import multiprocessing

    t = _own_pages(1 << 16)
    tracker.written({"t": t})
    assert tracker.written({"t": t}) == {"t": []}
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_in_child, args=(tracker, t))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    t[0] = 1.0  # the parent's record is its own still: the child's calls changed nothing of it
    assert tracker.written({"t": t}) == {"t": [_pages_of(t, 0, 3)]}


def _in_child(tracker, t) -> None:
    assert tracker.written({"t": t}) == {"t": None}
    tracker.unprotect([t])
    tracker.protect([t])
