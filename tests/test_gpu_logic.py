"""The GPU path's decisions, checked without a GPU: which GPU a share names, how many device slots fit, when memory a
worker maps may be given back, what a worker waits for before it acks, and how a failed pinning is cleaned up.
The data is shaped as torch and CUDA give it; tests/test_cuda.py runs the same path on a GPU."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import select
import subprocess
import sys
import threading
import time

import pytest
import torch

import weightsync as ws
from weightsync.core.engine import Delivery
from weightsync.core.receiver import Receiver
from weightsync.errors import SyncTimeoutError, TransportError
from weightsync.tensors import cuda
from weightsync.tensors.bound import BIND_HEADROOM, room_to_bind
from weightsync.tensors.copies import copy_tensors
from weightsync.tensors.layout import FlatLayout
from weightsync.transports.local.peers import PeerProcess
from weightsync.transports.local.sender import LocalSender
from weightsync.transports.local.slots import (
    DEVICE_HEADROOM,
    DEVICE_MAX_SLOTS,
    SharedSlot,
    SlotPool,
    device_pool_size,
    slot_kind,
)

GB = 10**9
# `str(torch.cuda.get_device_properties(i).uuid)` of two GPUs of one machine.
GPU0 = "8f6c5a94-3e0d-2b7a-91c4-5d2e7f1a0b36"
GPU1 = "0c2d4e6f-1a3b-5c7d-9e0f-a1b2c3d4e5f6"


# ------------------------------------------------------------------------------------ GPU identity (item 9)
def test_a_gpu_is_found_by_uuid_whatever_its_index_in_this_process():
    # The trainer sees both GPUs; a worker started with CUDA_VISIBLE_DEVICES=1 sees the second as cuda:0, and one
    # with CUDA_VISIBLE_DEVICES=1,0 sees them swapped. nvidia-smi spells UUIDs "GPU-<uuid>".
    assert cuda.local_index(GPU1, [GPU0, GPU1]) == 1
    assert cuda.local_index(GPU1, [GPU1]) == 0
    assert cuda.local_index(GPU0, [GPU1, GPU0]) == 1
    assert cuda.local_index("GPU-" + GPU1.upper(), [GPU0, GPU1]) == 1
    assert cuda.local_index(GPU0, [GPU1]) is None  # not visible here
    assert cuda.local_index(GPU0, []) is None  # no CUDA here


def test_a_share_of_a_gpu_this_process_does_not_see_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    share = {"uuid": GPU0}
    with pytest.raises(TransportError, match=f"the sender's GPU {GPU0} is not visible to this process"):
        cuda.open_share(share, [GPU1])
    with pytest.raises(TransportError, match=f"the sender's GPU {GPU0} is not visible"):
        cuda.SlotEvent.open(GPU0, "ab" * 64, [GPU1])


def test_device_slots_go_only_to_workers_on_the_trainers_gpu():
    assert slot_kind(GPU0, GPU0, checksum=False) == "cuda"
    assert slot_kind(GPU0, "GPU-" + GPU0, checksum=False) == "cuda"
    assert slot_kind(GPU0, GPU1, checksum=False) == "host"  # another GPU: pinned host slots, no peer copies
    assert slot_kind(GPU0, None, checksum=False) == "host"  # a CPU model, or one on several devices
    assert slot_kind(GPU0, GPU0, checksum=True) == "host"  # a checksum is computed in host memory
    assert slot_kind(None, GPU0, checksum=False) == "host"  # a CPU trainer
    assert slot_kind(GPU0, 0, checksum=False) == "host"  # an index is not a GPU's name


# ------------------------------------------------------------------------------------- memory (item 8)
def test_device_pools_are_bounded_by_count_and_by_the_gpus_free_memory():
    # A 20 GB model, 4 workers, on an 80 GB GPU that already holds the trainer's 20 GB copy: num_workers + 2 = 6
    # slots would be 120 GB. At most 3 slots; 2 where 3 do not fit.
    free = 80 * GB - 20 * GB
    assert device_pool_size(6, 20 * GB, free, pinning=True, per_worker=False) == 2
    assert device_pool_size(6, 20 * GB, 79 * GB, pinning=True, per_worker=False) == DEVICE_MAX_SLOTS == 3
    assert device_pool_size(6, 1 * GB, 70 * GB, pinning=False, per_worker=False) == 3
    assert device_pool_size(2, 1 * GB, 70 * GB, pinning=False, per_worker=False) == 2  # max_slots lower still
    assert device_pool_size(6, 1 * GB, 70 * GB, pinning=True, per_worker=True) == 2  # a pool per worker: 2 each
    # Workers that keep reading their version need a second slot for the next one: one that fits is not enough.
    assert device_pool_size(6, 20 * GB, 40 * GB + DEVICE_HEADROOM, pinning=True, per_worker=False) == 2
    assert device_pool_size(6, 20 * GB, 40 * GB, pinning=True, per_worker=False) == 0  # host slots instead
    assert device_pool_size(6, 20 * GB, 40 * GB, pinning=False, per_worker=False) == 1


def test_a_sender_whose_device_slots_do_not_fit_gives_its_gpu_workers_host_slots():
    layout = FlatLayout.from_weights({"w": torch.zeros(4)})
    sender = _sender(layout)
    sender.gpu, sender.gpu_uuid = torch.device("cuda", 0), GPU0
    fits = {"size": 3}
    sender._device_pool_size = lambda: fits["size"]
    try:
        assert sender._kind({"gpu": GPU0}) == "cuda"
        fits["size"] = 0
        assert sender._kind({"gpu": GPU0}) == "host"
    finally:
        sender.close(0.0)


def test_a_gpu_model_is_bound_to_a_second_buffer_only_where_it_fits():
    assert room_to_bind(20 * GB, 20 * GB + BIND_HEADROOM)
    assert not room_to_bind(20 * GB, 20 * GB)  # copied into its own tensors instead: no second buffer


# ---------------------------------------------------------------------------- release rules (item 4)
class _Process:
    """Stands for a worker process (:class:`PeerProcess`): alive until told otherwise."""

    def __init__(self, pid: int) -> None:
        self.pid, self.exited = pid, False

    def gone(self) -> bool:
        return self.exited

    def __repr__(self) -> str:
        return f"process {self.pid}"


def test_a_slot_read_by_a_worker_given_up_on_is_never_rewritten_while_its_process_lives():
    layout = FlatLayout.from_weights({"w": torch.zeros(1024)})
    pool = SlotPool(layout, 2, pinning=True, tag="t")
    try:
        first = pool.acquire()
        first.buffer.fill_(1)
        pool.publish(first, 1, [0, 1])
        pool.on_ack(0, 1, 1)
        pool.on_ack(1, 1, 1)  # both hold version 1 (shared_mem: their models are this slot)
        hung = _Process(4242)
        pool.drop_worker(1, hung)  # dropped after a timeout: still alive, its model still on this slot
        second = pool.acquire()
        assert second is not first
        pool.publish(second, 2, [0])
        pool.on_ack(0, 2, 2)  # worker 0 moved on; the slot it left is still read by the hung process
        third = pool.acquire()
        # The slot the hung process reads leaves the pool (the sender closes its side; the memory lives while the
        # process maps it) and a new one, with a new id, takes its place: nothing it reads is ever rewritten.
        assert pool.retired == [first] and third is not first and third.id == 2
        assert torch.all(first.buffer == 1)
        pool.drop_worker(0, None)  # a process unknown or gone frees its slots at once
        assert not second.readers and not second.holders and pool.acquire() is second
        gone = _Process(4343)
        gone.exited = True
        pool.publish(second, 3, [1])
        pool.drop_worker(1, gone)  # killed: its slots are free at once
        assert pool.acquire() is second
    finally:
        pool.close()


class _Transport:
    def __init__(self, shares: list[dict], process: _Process | None) -> None:
        self.shares, self.process = {0: shares}, process


def _sender(layout: FlatLayout) -> LocalSender:
    from weightsync.transports.local.settings import MPSettings

    class Sink:
        model_id = "policy"

        def is_dead(self, worker: int) -> bool:
            return False

    return LocalSender(Sink(), layout, 2, MPSettings())


def test_cuda_shares_are_released_only_for_processes_known_to_have_exited(monkeypatch):
    released: list[str] = []
    monkeypatch.setattr(cuda, "release_share", lambda share: released.append(share["counter"]))
    sender = _sender(FlatLayout.from_weights({"w": torch.zeros(4)}))
    try:
        alive, dead, unknown = _Process(1), _Process(2), None
        dead.exited = True
        sender._retire(_Transport([{"counter": "a"}], alive))  # replaced on rejoin, still running
        sender._retire(_Transport([{"counter": "b"}], dead))  # killed
        sender._retire(_Transport([{"counter": "c"}], unknown))  # never known: never released
        assert released == ["b"]
        alive.exited = True
        sender._release_departed()
        assert released == ["b", "a"]
    finally:
        sender.close(0.0)
    assert released == ["b", "a"]  # shutdown releases nothing of a process not known gone


def test_a_late_worker_on_device_slots_keeps_them_in_the_pool():
    """A late worker's host slots leave the pool (new ones take their place); its device slots do not: the pool
    was sized to the GPU's free memory, and the slots that left keep theirs while the worker maps them, so a new one
    would not fit. The engine says it could not set them aside (a send held up by it fails, naming it)."""
    from weightsync.transports.local.slots import SlotPool

    layout = FlatLayout.from_weights({"w": torch.zeros(4)})
    sender = _sender(layout)
    try:
        sender.kinds = {0: "cuda", 1: "host"}
        host = sender.pools[("host", None)] = SlotPool(layout, 2, pinning=False)
        device = sender.pools[("cuda", None)] = SlotPool(layout, 2, pinning=False)
        device.device = torch.device("cuda", 0)  # (stands for a pool on the trainer's GPU: nothing is allocated)
        assert sender.set_aside(1) and host.aside == {1}
        assert not sender.set_aside(0) and device.aside == set() and host.aside == {1}
    finally:
        sender.pools.clear()
        sender.close(0.0)


def test_a_peer_process_is_known_gone_only_once_it_exited():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    process = PeerProcess(child.pid)
    try:
        assert not process.gone()
        child.stdin.close()
        child.wait(10)
        assert process.gone()
    finally:
        process.close()
    assert not PeerProcess(None).gone()  # unknown: never released


def test_interprocess_events_are_kept_until_every_process_that_opened_them_exited():
    process, event = _Process(7), object()
    cuda.keep_until_gone([event], [process])
    assert any(event in objs for objs, _ in cuda._kept)
    process.exited = True
    cuda.keep_until_gone([], [])  # every call sweeps what is no longer needed
    assert not any(event in objs for objs, _ in cuda._kept)


# ----------------------------------------------------------------- bounded waits, ordering (items 5, 7)
def test_a_wait_on_an_event_that_never_completes_ends_at_its_deadline():
    began = time.monotonic()
    with pytest.raises(SyncTimeoutError, match="the sender's write of the slot was not done in time"):
        cuda.wait_done(lambda: False, began + 0.2, "the sender's write of the slot")
    assert 0.2 <= time.monotonic() - began < 1.0
    answers = iter([False, False, True])
    cuda.wait_done(lambda: next(answers), time.monotonic() + 5, "x")  # done: returns


def test_a_worker_whose_model_takes_the_slots_memory_waits_for_every_stream_before_it_acks():
    # Its old memory goes back to the sender with the ack, while inference queued on another stream may still read
    # it; a worker that copies into its own memory needs only the stream the copy ran on.
    assert cuda.settle_whole_device("share") and cuda.settle_whole_device("take")
    assert not cuda.settle_whole_device("load") and not cuda.settle_whole_device("write")


def _gpu_receiver(monkeypatch, calls: list[str]) -> Receiver:
    """A receiver whose model is taken for one on a GPU, over an engine that copies ("load"): each settle and ack
    is written to ``calls`` (a settle as ``settle whole=<whole_device>``)."""
    model = torch.nn.Linear(2, 2)

    class Engine:
        placement, pushes = "load", False
        layout = FlatLayout.from_weights(dict(model.state_dict()))

        def attach(self, apply) -> None: ...

        def ack(self, taken, held, error=None) -> None:
            calls.append(f"ack {type(error).__name__}")

    class Scheme:
        strategy = ws.WeightStrategy()
        weights_lock = threading.RLock()
        timeout = 5.0

    Scheme.model = model
    receiver = Receiver(Scheme(), Engine(), {"model_id": "policy", "worker_idx": 0})
    monkeypatch.setattr(receiver, "_gpus", lambda dst, held: {torch.device("cuda", 0)})  # a model on a GPU
    monkeypatch.setattr(
        cuda, "settle", lambda gpus, deadline, whole_device=False: calls.append(f"settle whole={whole_device}")
    )
    return receiver


def test_a_failed_apply_settles_its_gpu_work_before_it_acks(monkeypatch):
    # Copies queued before a failure may still read the slot, and the ack (of a failure too) frees it for rewriting.
    calls: list[str] = []
    receiver = _gpu_receiver(monkeypatch, calls)

    def place_fails(*args):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(receiver, "_place", place_fails)
    with pytest.raises(RuntimeError, match="copy failed"):
        receiver.apply([Delivery(1, [])])
    assert calls == ["settle whole=False", "ack RuntimeError"]


def test_a_lost_ack_moves_a_model_off_the_senders_gpu_memory_and_reports_its_own_tensors(monkeypatch):
    # A shared_mem worker on the trainer's GPU memory whose ack cannot reach its gone sender: the model gets memory
    # of its own at once (the sender's is undefined once it exited), and what receive() hands out from then on is
    # the model's tensors, not the views of that memory it had before.
    import types

    from weightsync.errors import ConnectionClosedError

    calls: list[str] = []
    receiver = _gpu_receiver(monkeypatch, calls)
    receiver.engine.placement = "share"
    receiver.bound = types.SimpleNamespace(
        storage=types.SimpleNamespace(device=torch.device("cuda", 0)), release=lambda: calls.append("release")
    )
    mine, view = torch.zeros(2), torch.ones(2)
    receiver._written = ({"w": mine}, {"w": view})

    def gone(taken, held, error=None):
        raise ConnectionClosedError("the sender went away (the test's)")

    monkeypatch.setattr(receiver.engine, "ack", gone)
    receiver._ack([Delivery(1, [])], 1)  # lost, no more
    assert calls == ["release"] and receiver._written == ({"w": mine}, None)


def test_a_worker_that_copies_into_its_model_waits_for_every_stream_before_it_writes(monkeypatch):
    # Inference queued earlier on another stream may still read the model's memory: the copy must not overwrite it
    # under those kernels. A worker whose model moves to the new memory instead writes nothing the model reads.
    assert cuda.settle_before_write("load", True) and cuda.settle_before_write("write", True)
    assert not cuda.settle_before_write("share", True) and not cuda.settle_before_write("take", True)
    assert not cuda.settle_before_write("load", False)  # receive() in the worker's own thread: its stream orders it
    calls: list[str] = []
    receiver = _gpu_receiver(monkeypatch, calls)
    monkeypatch.setattr(receiver, "_place", lambda *args: calls.append("write") or None)
    receiver.apply([Delivery(1, [])])  # from the worker's own thread
    assert calls == ["write", "settle whole=False", "ack NoneType"]
    calls.clear()
    receiver._thread = threading.current_thread()  # as the scheme's background thread applies it
    receiver.apply([Delivery(2, [])])
    assert calls == ["settle whole=True", "write", "settle whole=False", "ack NoneType"]


# ---------------------------------------------------------------------------- pinning (items 6, 10, 11)
class _Cudart:
    def __init__(self, code: int) -> None:
        self.code, self.calls = code, []

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - CUDA's name
        self.calls.append(("register", flags))
        return self.code

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister",))
        return 0


def test_a_failed_pinning_clears_the_runtimes_last_error_and_leaves_memory_pageable():
    cleared: list[bool] = []
    cudart = _Cudart(code=2)  # cudaErrorMemoryAllocation: over the locked-memory limit
    pinned = cuda.Pinned(torch.zeros(16), cudart=cudart, clear=lambda: cleared.append(True))
    assert not pinned.pinned and cleared == [True]  # else the next kernel launch reports this failure as its own
    pinned.release()
    assert cudart.calls == [("register", cuda.HOST_REGISTER_PORTABLE)]
    ok = _Cudart(code=0)
    pinned = cuda.Pinned(torch.zeros(16), read_only=True, cudart=ok, clear=lambda: cleared.append(True))
    assert pinned.pinned and cleared == [True]
    pinned.release()
    flags = cuda.HOST_REGISTER_PORTABLE | cuda.HOST_REGISTER_READ_ONLY  # a read-only mapping is pinned as one
    assert ok.calls == [("register", flags), ("unregister",)]


def test_one_piece_is_one_copy_and_gpu_copies_are_queued(monkeypatch):
    def no_foreach(*args, **kwargs):
        raise AssertionError("one piece goes through copy_, not _foreach_copy_")

    monkeypatch.setattr(torch, "_foreach_copy_", no_foreach)
    dst, src = torch.zeros(8), torch.arange(8.0)
    copy_tensors([dst], [src], non_blocking=True)
    assert torch.equal(dst, src)
    seen = {}
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s, non_blocking=False: seen.update(nb=non_blocking))
    copy_tensors([torch.zeros(2), torch.zeros(2)], [torch.ones(2), torch.ones(2)], non_blocking=True)
    assert seen == {"nb": True}  # a GPU copy from pinned memory without a stream wait per tensor


# ------------------------------------------------------------------------ sealed slots (issue 31, item 5)
@pytest.mark.parametrize("read_only", [True, False])
def test_a_slots_size_is_sealed_and_copying_workers_get_it_read_only(read_only):
    layout = FlatLayout.from_weights({"w": torch.zeros(1024)})
    slot = SharedSlot(0, layout, "t", read_only=read_only)
    try:
        seals = fcntl.fcntl(slot.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        # What a worker holding the descriptor it was handed can do, reopened read-write through /proc included:
        rw = os.open(f"/proc/self/fd/{slot.reader_fd}", os.O_RDWR)
        try:
            for size in (0, layout.nbytes // 2, layout.nbytes * 2):
                with pytest.raises(PermissionError):
                    os.ftruncate(rw, size)
            if read_only:
                assert fcntl.fcntl(slot.reader_fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
                with pytest.raises(PermissionError):  # no new writable mapping of the segment
                    mmap.mmap(rw, layout.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(rw)
        slot.buffer.fill_(7)  # the trainer's own mapping, made before the seals, still writes: no SIGBUS
        assert os.fstat(slot.fd).st_size == layout.nbytes
    finally:
        slot.close()


# ------------------------------------------------------------------------------ the leak check (item 2)
def test_the_leak_check_leaves_out_torchs_cuda_ipc_reference_counter_file_only():
    from tests.conftest import PRIVATE_SHM, _torch_ref_counter

    if not PRIVATE_SHM:
        pytest.skip(
            "needs this run's private /dev/shm (root, a mount namespace): it writes files where other programs "
            "keep theirs"
        )
    counter = "/dev/shm/torch_93811_3851275_0"  # what a process that shared CUDA memory keeps for its life
    other = "/dev/shm/torch_93811_3851275_1"  # a file of another size: a shared CPU tensor, still a leak
    try:
        with open(counter, "wb") as f:
            f.truncate(8 * 10000 + 64)
        with open(other, "wb") as f:
            f.truncate(4096)
        assert _torch_ref_counter(os.path.basename(counter))
        assert not _torch_ref_counter(os.path.basename(other))
        assert not _torch_ref_counter("weightsync-123")
    finally:
        os.unlink(counter)
        os.unlink(other)


def test_the_leak_check_leaves_out_the_cuda_drivers_event_file_of_a_live_process_only():
    # The CUDA driver names it after the process that exported an interprocess event (pid in hex; seen on an
    # H100: `cuda.shm.0.201.1` for pid 513), and keeps it for that process's life: the trainer's is CUDA's own.
    from tests.conftest import _cuda_or_torch_state

    assert _cuda_or_torch_state(f"cuda.shm.0.{os.getpid():x}.1")  # this process: alive, the trainer of a test
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    exited = select.poll()
    pidfd = os.pidfd_open(zombie.pid)
    try:
        exited.register(pidfd, select.POLLIN)  # readable once the child exited (it is not reaped by this)
        assert exited.poll(30_000), "the child did not exit"
    finally:
        os.close(pidfd)
    assert not _cuda_or_torch_state(f"cuda.shm.0.{zombie.pid:x}.1")  # exited (not reaped yet): a leak
    zombie.wait(10)
    assert not _cuda_or_torch_state(f"cuda.shm.0.{zombie.pid:x}.1")  # gone: a leak, weightsync's to explain
    for name in (f"cuda.shm.{os.getpid():x}", f"cuda.shm.0.{os.getpid()}z.1", "cuda.shm.0..1", "weightsync-1"):
        assert not _cuda_or_torch_state(name), name


# ------------------------------------------------------- a switching worker without the swap (torch < 2.12)
@pytest.mark.parametrize("cached", [True, False])
def test_a_switching_worker_that_cannot_swap_makes_the_views_of_each_slot_once(monkeypatch, cached):
    # On torch 2.11 a shared_mem worker binds its model to the slot of each update; making that slot's views
    # anew at every update cost ~0.5 ms of a 2.6 ms GPU send (120 tensors, H100). Measured: the views of a
    # slot's spare mapping are made once and reused while that mapping is the slot's spare.
    from tests._bodies import optimizer_step
    from tests._workers import build, checksum, in_process_receiver
    from weightsync.tensors.bound import BoundModel
    from weightsync.transports.local.receiver import LocalReceiver

    monkeypatch.setattr(BoundModel, "can_swap", False)
    if not cached:  # the check of this test: without the cache, one set of views per update
        monkeypatch.setattr(LocalReceiver, "_views_of_spare", lambda self, slot, storage: None)
    model = build("tiny")
    scheme = ws.WeightSyncScheme.from_backend("shared_mem", sync=False, timeout=10)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny")
    receiver = in_process_receiver(scheme, replica)
    made = []
    real_views = FlatLayout.views
    monkeypatch.setattr(FlatLayout, "views", lambda self, buffer: made.append(1) or real_views(self, buffer))
    try:
        for step in range(1, 9):
            optimizer_step(model, step)
            scheme.send_async()
            assert receiver.receive(timeout=5) is not None
            scheme.wait_async()
            assert receiver.version == step and checksum(replica) == checksum(model), step
    finally:
        receiver.shutdown()
        scheme.shutdown()
    assert (len(made) <= 4) == cached, made  # 2 slots in turn: 3 sets in all (10 when made at every update)


def test_the_shares_of_a_slot_a_worker_let_go_are_not_released_again_when_it_exits(monkeypatch):
    # The worker drops its own references of a retired slot when told to forget it; releasing them again once its
    # process is gone would take the references of another process that still maps that slot (item 4).
    from types import SimpleNamespace

    from weightsync.transports.local.mp import MPTransport

    released: list[str] = []
    monkeypatch.setattr(cuda, "release_share", lambda share: released.append(share["counter"]))
    sent: list[dict] = []
    transport = MPTransport(SimpleNamespace(send=sent.append), 0)
    transport.shares = {0: [{"counter": "retired"}], 1: [{"counter": "live"}]}
    transport.forget(SimpleNamespace(id=0))
    assert sent == [{"op": "forget", "slot": 0}]
    gone = _Process(7)
    gone.exited = True
    transport.process = gone
    sender = _sender(FlatLayout.from_weights({"w": torch.zeros(4)}))
    try:
        sender._retire(transport)
        assert released == ["live"]
    finally:
        sender.close(0.0)


def test_an_apply_whose_gpu_work_times_out_after_the_model_took_the_new_slot_acks_that_version_held(monkeypatch):
    # shared_mem, a GPU model (simulated: its GPU found, its settle timing out): once the model is bound to the new
    # slot, it holds that version whatever the settle says. Acked as holding the old one, the trainer freed the
    # slot the model reads, and its next send rewrote the model under it, with no update applied.
    from tests._workers import build, in_process_receiver

    scheme = ws.SharedMemWeightSyncScheme(timeout=3, connect_timeout=10, sync=False)
    model, replica = build("flat4"), build("flat4")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    receiver = in_process_receiver(scheme, replica)
    first = lambda m: float(next(m.parameters())[0])  # noqa: E731
    try:
        with monkeypatch.context() as patched, torch.no_grad():
            patched.setattr(Receiver, "_gpus", lambda self, dst, held: {torch.device("cuda", 0)})
            patched.setattr(cuda, "settle_before_write", lambda *a: False)

            def settle(*args, **kwargs):
                raise SyncTimeoutError("GPU work not done in time")

            patched.setattr(cuda, "settle", settle)
            for p in model.parameters():
                p.fill_(1.0)
            scheme.send()
            with pytest.raises(SyncTimeoutError):
                receiver.receive(2.0)
        assert receiver.version == 1 and first(replica) == 1.0
        deadline = time.monotonic() + 10
        while scheme.acked_versions.get(0) != 1 and time.monotonic() < deadline:
            with contextlib.suppress(ws.WeightSyncError):  # (the failure is reported once)
                scheme.wait_async(0.1)
        assert scheme.acked_versions.get(0) == 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(2.0)
        with contextlib.suppress(ws.WeightSyncError):
            scheme.send()  # (not taken by the worker; a shared_mem send has written its slot when it returns)
        assert receiver.version == 1 and first(replica) == 1.0  # its weights did not change under it
    finally:
        receiver.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize("device", ["cpu", "meta"], ids=["gloo", "nccl"])
def test_an_acks_receive_over_the_group_is_posted_before_the_parts_with_gloo_and_after_them_with_nccl(device):
    """gloo holds the worker's ack until the trainer posts its receive: posted as soon as the worker can ack (here
    the version announced with its digest), a Ctrl-C before the trainer expects the ack leaves it posted. NCCL
    runs a pair's operations in order on one stream: a receive posted before the parts would hold them behind an
    ack that only follows them (acks live on the GPU there: the meta device stands in for it)."""
    from weightsync.transports.distributed.group import Link
    from weightsync.transports.distributed.transport import DistributedTransport
    from weightsync.transports.distributed.worker_side import TAG_ACK, TAG_DATA

    calls: list[tuple[str, int]] = []

    class Work:
        def wait(self, *args: object) -> bool:
            return True

    class Group:
        def send(self, tensors: list, rank: int, tag: int) -> Work:
            calls.append(("send", tag))
            return Work()

        def recv(self, tensors: list, rank: int, tag: int) -> Work:
            calls.append(("recv", tag))
            return Work()

    transport = DistributedTransport(0, link=Link(Group(), object()), device=torch.device(device))  # type: ignore[arg-type]
    try:
        transport.announce(0, "nonce", "mac", initial=True, digest="its digest")  # (all the worker needs to ack)
        transport.send_part(torch.zeros(4, device=device))
        transport.expect_ack(0)
    finally:
        transport.stop_waiting(5)
    parts, ack = ("send", TAG_DATA), ("recv", TAG_ACK)
    assert calls == ([ack, parts] if device == "cpu" else [parts, ack])
