"""The local schemes' GPU slots, as far as a machine without CUDA can check them: the plain data a device slot
travels as, a worker that cannot map one, and where the sender puts each worker's slots. tests/test_cuda.py
moves real weights through them where CUDA exists."""

from __future__ import annotations

import pytest
import torch

import weightsync as ws
from weightsync.errors import TransportError
from weightsync.tensors import cuda
from weightsync.tensors.layout import FlatLayout
from weightsync.transports.local.mp import MPTransport
from weightsync.transports.local.sender import LocalSender
from weightsync.transports.local.shared_mem import SharedMemTransport

SHARE = {
    "device": 0,
    "handle": "ab" * 64,
    "size": 4096,
    "offset": 0,
    "counter": "2f746f7263685f31",  # "/torch_1"
    "counter_offset": 3,
    "event": "cd" * 64,
    "event_sync": True,
}


def test_a_share_is_checked_field_by_field():
    assert cuda.check_share(dict(SHARE)) == SHARE
    bad = {
        "must be a mapping": ["x"],
        "has fields": {**SHARE, "extra": 1},
        "device must be int": {**SHARE, "device": True},
        "size must be >= 0": {**SHARE, "size": -1},
        "handle must be at most": {**SHARE, "handle": "zz" * 64},
        "handle must be 128": {**SHARE, "handle": "ab" * 32},
        "counter must be at most": {**SHARE, "counter": "ab" * 300},
        "event must be at most": {**SHARE, "event": "AB" * 64},
        "event_sync must be bool": {**SHARE, "event_sync": 1},
    }
    for reason, share in bad.items():
        with pytest.raises(TransportError, match=reason):
            cuda.check_share(share)


class _Channel:
    """Stands for a channel: records what the sender says to a worker."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.closed = False

    def send(self, msg: dict) -> None:
        self.sent.append(msg)

    def close(self) -> None:
        self.closed = True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a worker without CUDA")
@pytest.mark.parametrize("transport_class", [MPTransport, SharedMemTransport])
def test_a_worker_that_cannot_map_a_device_slot_refuses_updates_naming_why(transport_class):
    transport = transport_class(_Channel(), 0)
    count = 2 if transport_class.pinning else 1  # a worker that takes the slot's memory maps it twice
    transport._map_device_slot(0, 1024, {"shares": [dict(SHARE)] * count, "event": "cd" * 64})
    transport._map_device_slot(1, 1024, {"shares": "nope", "event": ""})
    transport._map_device_slot(2, 1024, {"shares": [{**SHARE, "handle": "x"}] * count, "event": "cd" * 64})
    transport._map_device_slot(3, 1024, {"shares": [dict(SHARE)] * 3, "event": "cd" * 64})
    no_cuda = "the sender shares device memory, and this process has no CUDA device"
    assert transport.bad_slots[0] == (TransportError, no_cuda)
    assert transport.bad_slots[1][1] == "a device slot is announced with its shares and its event"
    assert "handle must be at most 128 lowercase hex digits" in transport.bad_slots[2][1]
    assert transport.bad_slots[3][1] == "a device slot is announced with 3 shares"
    assert transport.slot_buffers == {} and transport.events == {}
    transport.close()


def _sender(gpu: torch.device | None, checksum: bool = False, per_worker: bool = False) -> LocalSender:
    layout = FlatLayout.from_weights({"w": torch.zeros(4)})

    class Sink:
        model_id = "policy"

        def is_dead(self, worker: int) -> bool:
            return False

    return LocalSender(
        Sink(),
        layout,
        3,
        transport_class=MPTransport,
        max_slots=None,
        per_worker=per_worker,
        checksum=checksum,
        gpu=gpu,
    )


@pytest.mark.parametrize(
    ("gpu", "checksum", "devices", "kinds"),
    [
        # a trainer on a GPU: its GPU workers read device slots, its CPU workers pinned host slots
        ("cuda:0", False, ["cuda:0", "cuda:1", "cpu"], ["cuda", "cuda", "host"]),
        # a checksum is computed in host memory: host slots for everyone
        ("cuda:0", True, ["cuda:0", "cpu", "cuda:1"], ["host", "host", "host"]),
        # a trainer on the CPU: host slots, which GPU workers pin on their side
        (None, False, ["cuda:0", "cpu", None], ["host", "host", "host"]),
        # a worker whose model is on several devices, or says something else, reads host slots
        ("cuda:0", False, [None, 7, "meta"], ["host", "host", "host"]),
    ],
)
def test_the_sender_puts_each_workers_slots_where_its_model_is(gpu, checksum, devices, kinds):
    sender = _sender(None if gpu is None else torch.device(gpu), checksum)
    try:
        for w, device in enumerate(devices):
            sender._take_over(_Channel(), {"worker_idx": w, "device": device})
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
