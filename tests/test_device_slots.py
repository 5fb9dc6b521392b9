"""The local schemes' GPU slots, as far as a machine without CUDA can check them: the plain data a device slot
travels as, a worker that cannot map one, and where the sender puts each worker's slots. tests/test_cuda.py
moves real weights through them where CUDA exists."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import weightsync as ws
from tests._bodies import optimizer_step, start
from tests._workers import build, checksum
from weightsync.errors import TransportError
from weightsync.tensors import cuda
from weightsync.tensors.layout import FlatLayout
from weightsync.transports.local.channel import connect_channel
from weightsync.transports.local.mp import MPTransport
from weightsync.transports.local.sender import LocalSender
from weightsync.transports.local.settings import MPSettings
from weightsync.transports.local.shared_mem import SharedMemTransport

# A share laid out as torch >= 2.5 writes it (what `_share_cuda_` returned on an H100 with torch 2.11): the memory
# handle is the caching allocator's record, a version byte, a type byte ('c': a cudaMalloc block) and the 64-byte
# cudaIpcMemHandle_t (66 bytes in all); the reference-counter file is named `/torch_<pid>_<random>_<n>` (23
# bytes); the event handle is a 64-byte cudaIpcEventHandle_t.
MEM_HANDLE = bytes([2]) + b"c" + bytes(range(64))
COUNTER = b"/torch_93811_3851275_17"
UUID = "8f6c5a94-3e0d-2b7a-91c4-5d2e7f1a0b36"
SHARE = {
    "device": 0,
    "uuid": UUID,
    "handle": MEM_HANDLE.hex(),
    "size": 4096,
    "offset": 0,
    "counter": COUNTER.hex(),
    "counter_offset": 0,
    "event": bytes(range(64, 128)).hex(),
    "event_sync": True,
}
EVENT = "cd" * 64


def test_a_share_as_torch_writes_it_is_accepted():
    assert len(MEM_HANDLE) == 66 and len(COUNTER) == 23
    assert cuda.check_share(dict(SHARE)) == SHARE
    # The memory handle is opaque (torch's `_new_shared_cuda` checks it): a later version byte, an expandable
    # segment's longer record, and a share without an event (event_sync false) all pass.
    later = bytes([3]) + b"c" + bytes(64)
    expandable = bytes([2]) + b"e" + bytes(16 + 4 * 50)
    for handle in (later, expandable):
        assert cuda.check_share({**SHARE, "handle": handle.hex()})["handle"] == handle.hex()
    assert cuda.check_share({**SHARE, "event": "", "event_sync": False})["event"] == ""


def test_a_share_is_checked_field_by_field():
    bad = {
        "must be a mapping": ["x"],
        "has fields": {**SHARE, "extra": 1},
        "device must be int": {**SHARE, "device": True},
        "size must be >= 0": {**SHARE, "size": -1},
        "handle must be 1 to 65536 bytes": {**SHARE, "handle": "zz" * 33},
        "handle must be 1 to": {**SHARE, "handle": ""},
        "handle must be 1 to ": {**SHARE, "handle": "ab" * (cuda.MAX_HANDLE_BYTES + 1)},
        "handle must be 1 to  ": {**SHARE, "handle": "abc"},
        "counter must be 1 to 256": {**SHARE, "counter": "ab" * 300},
        "event must be 64 bytes": {**SHARE, "event": "AB" * 64},
        "event must be 64 bytes ": {**SHARE, "event": "ab" * 63},
        "event_sync must be bool": {**SHARE, "event_sync": 1},
        "uuid must be a GPU UUID": {**SHARE, "uuid": "x" * 65},
        "uuid must be a GPU UUID ": {**SHARE, "uuid": "../etc"},
    }
    for reason, share in bad.items():
        with pytest.raises(TransportError, match=reason.strip()):
            cuda.check_share(share)


class _Channel:
    """Stands for a channel: records what the sender says to a worker."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.closed = False

    def fileno(self) -> int:
        return -1  # no socket: its peer process is unknown

    def send(self, msg: dict) -> None:
        self.sent.append(msg)

    def close(self) -> None:
        self.closed = True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a worker without CUDA")
@pytest.mark.parametrize("transport_class", [MPTransport, SharedMemTransport])
def test_a_worker_that_cannot_map_a_device_slot_refuses_updates_naming_why(transport_class):
    transport = transport_class(_Channel(), 0)
    count = 2 if transport_class.pinning else 1  # a worker that takes the slot's memory maps it twice
    transport._map_device_slot(0, 1024, {"shares": [dict(SHARE)] * count, "event": EVENT})
    transport._map_device_slot(1, 1024, {"shares": "nope", "event": ""})
    transport._map_device_slot(2, 1024, {"shares": [{**SHARE, "handle": "x"}] * count, "event": EVENT})
    transport._map_device_slot(3, 1024, {"shares": [dict(SHARE)] * 3, "event": EVENT})
    no_cuda = "the sender shares device memory, and this process has no CUDA device"
    assert transport.bad_slots[0] == (TransportError, no_cuda)  # a well-formed share: refused for want of CUDA only
    assert transport.bad_slots[1][1] == "a device slot is announced with its shares and its event"
    assert "handle must be 1 to 65536 bytes as lowercase hex digits" in transport.bad_slots[2][1]
    assert transport.bad_slots[3][1] == "a device slot is announced with 3 shares"
    assert transport.slot_buffers == {} and transport.events == {}
    transport.close()


def _sender(gpu: torch.device | None, checksum: bool = False, per_worker: bool = False) -> LocalSender:
    layout = FlatLayout.from_weights({"w": torch.zeros(4)})

    class Sink:
        model_id = "policy"

        def is_dead(self, worker: int) -> bool:
            return False

    return LocalSender(Sink(), layout, 3, MPSettings(), per_worker=per_worker, checksum=checksum, gpu=gpu)


OTHER_GPU = "0c2d4e6f-1a3b-5c7d-9e0f-a1b2c3d4e5f6"


@pytest.mark.parametrize(
    ("gpu", "checksum", "gpus", "kinds"),
    [
        # a trainer on a GPU: workers on that very GPU (named by UUID, with or without torch's "GPU-" prefix) read
        # device slots; a worker on another GPU, or on the CPU, pinned host slots
        ("cuda:0", False, [UUID, "GPU-" + UUID.upper(), OTHER_GPU], ["cuda", "cuda", "host"]),
        # a checksum is computed in host memory: host slots for everyone
        ("cuda:0", True, [UUID, None, UUID], ["host", "host", "host"]),
        # a trainer on the CPU: host slots, which GPU workers pin on their side
        (None, False, [UUID, None, OTHER_GPU], ["host", "host", "host"]),
        # a worker whose model is on several devices, or says something else, reads host slots
        ("cuda:0", False, [None, 7, ["x"]], ["host", "host", "host"]),
    ],
)
def test_the_sender_puts_each_workers_slots_where_its_model_is(gpu, checksum, gpus, kinds):
    sender = _sender(None if gpu is None else torch.device(gpu), checksum)
    sender.gpu_uuid = None if gpu is None else UUID  # what torch.cuda.get_device_properties(0).uuid would say
    sender._device_pool_size = lambda: 3  # the GPU has room (tests/test_gpu_logic.py: when it has not)
    try:
        for w, uuid in enumerate(gpus):
            # An index means nothing across processes (CUDA_VISIBLE_DEVICES): "cuda:0" here is not the trainer's.
            sender._take_over(_Channel(), {"worker_idx": w, "device": "cuda:0", "gpu": uuid})
        assert [sender.kinds[w] for w in range(3)] == kinds
        assert [sender._pool_key(w) for w in range(3)] == [(kind, None) for kind in kinds]
        assert sender._pool(("host", None)).pin == (gpu is not None)  # a GPU writes into host slots: pinned
    finally:
        sender.close(0.0)


def test_a_scheme_with_a_cpu_model_hands_its_engines_the_cpu():
    model = torch.nn.Linear(2, 2)
    scheme = ws.MultiProcessWeightSyncScheme()
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    try:
        assert scheme._sending.engine.gpu is None
        assert scheme.model_device == torch.device("cpu")
    finally:
        scheme.shutdown()


# ------------------------------------------------------------------ a key holder resizing its slot (issue 31)
def _key_holder(handoff: dict, got: dict, stop: threading.Event) -> None:
    """A worker holding the key, speaking the protocol by hand: it keeps the slot descriptors it is handed (for the
    test to attack) and acks every update."""
    channel = connect_channel(
        handoff["address"],
        bytes.fromhex(handoff["authkey"]),
        {"worker_idx": 0, "pid": os.getpid(), "model_id": "policy", "device": None},
        20,
    )
    try:
        assert channel.recv(20)["op"] == "welcome"
        while not stop.is_set():
            msg = channel.recv(0.05)
            if msg is None:
                continue
            if msg["op"] == "slot":
                got.setdefault("fds", []).extend(channel.recv_fds(1, timeout=5))
            elif msg["op"] == "update":
                got["version"] = msg["version"]
                channel.send({"op": "ack", "version": msg["version"], "held": msg["version"]})
            elif msg["op"] == "bye":
                return
    except ws.ConnectionClosedError:
        return
    finally:
        for fd in got.get("fds", []):
            os.close(fd)
        channel.close()


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem"])
def test_a_worker_that_resizes_its_slot_is_refused_by_the_kernel_and_the_trainer_survives(name):
    model = torch.nn.Linear(64, 64)
    scheme = ws.WeightSyncScheme.from_backend(name, timeout=20, connect_timeout=30)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    got: dict = {}
    stop = threading.Event()
    holder = threading.Thread(target=_key_holder, args=(scheme._sending.engine.handoff(), got, stop), daemon=True)
    holder.start()
    try:
        scheme.connect()
        (fd,) = got["fds"]
        size = os.fstat(fd).st_size
        writable = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # what the worker can reopen its descriptor as
        try:
            for target in (0, size // 2, size * 2):  # shrink (SIGBUS for the trainer's next write), grow
                with pytest.raises(OSError):
                    os.ftruncate(fd, target)
                with pytest.raises(PermissionError):  # the seals, whatever the descriptor's mode
                    os.ftruncate(writable, target)
        finally:
            os.close(writable)
        assert os.fstat(fd).st_size == size
        with torch.no_grad():
            model.weight.fill_(0.5)
        scheme.send()  # the trainer writes the slot again: alive, and the worker acked
        assert got["version"] == 1 and scheme.acked_versions == {0: 1}
    finally:
        stop.set()
        holder.join(10)
        scheme.shutdown()


# --------------------------------------------------------- a worker given up on but alive (issue 32, item 4)
def test_the_slot_a_dropped_but_living_worker_runs_on_is_never_rewritten(workers):
    # shared_mem: the worker's model *is* the slot. Dropped after a timeout (SIGSTOP), it lives on: the slot it
    # holds must not be rewritten, however many sends follow with a pool of 2 slots.
    model = build("tiny")
    scheme = ws.SharedMemWeightSyncScheme(timeout=2, connect_timeout=60, on_failure="drop", max_slots=2)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start(workers, {"policy": scheme}, {"policy": "tiny"})
    versions = [(0, checksum(model))]
    os.kill(group.procs[1].pid, signal.SIGSTOP)
    try:
        for step in range(1, 5):
            optimizer_step(model, step)
            scheme.send()  # drops worker 1 at the first, then goes on without it
            versions.append((step, checksum(model)))
            assert group.ask(0, "state")["policy"] == versions[-1]
    finally:
        os.kill(group.procs[1].pid, signal.SIGCONT)
    assert "SyncTimeoutError" in scheme.stats()["dropped_workers"][1]
    # Woken, it may still apply version 1 (announced before it was dropped); its model's memory then holds that
    # version, whole: never a later one written over it.
    assert group.ask(1, "state")["policy"] in versions[:2]
    group.stop()
    scheme.shutdown()
