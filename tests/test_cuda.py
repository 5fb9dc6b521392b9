"""Weights that live on a GPU: CUDA models over the CPU engines, and NCCL. Skipped where CUDA is absent."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import weightsync as ws
from tests import _bodies as bodies
from tests._bodies import on, optimizer_step, sparse_step, start
from tests._workers import build, checksum, serve
from weightsync.core.timing import deadline_after, wait_until

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has none")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cpu_engine(name: str) -> ws.WeightSyncScheme:
    if name == "distributed":
        return ws.DistributedWeightSyncScheme(timeout=20, connect_timeout=60)
    return ws.WeightSyncScheme.from_backend(name, timeout=20)


def _sends_arrive_then_stop(scheme, model, group) -> None:
    for step in (1, 2):
        optimizer_step(model, step)
        scheme.send()
        assert group.ask(0, "state")["policy"] == (step, checksum(model))
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem", "distributed"])
def test_cuda_models_on_both_sides(workers, name):
    model = build("tiny").cuda()
    scheme = _cpu_engine(name)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    group, ready = start(workers, {"policy": scheme}, {"policy": "tiny@cuda:0"}, n=1)
    assert ready[0][2] == {} and ready[0][1] == [("policy", 0, checksum(model))]
    if name != "distributed":  # the local schemes' slots are in the trainer's GPU memory
        slots = scheme.shared_transport.slots
        assert slots and all(
            slot.buffer.is_cuda and slot.buffer.device == model.body[0].weight.device for slot in slots
        )
    _sends_arrive_then_stop(scheme, model, group)


@pytest.mark.parametrize("track", [False, True], ids=["", "track_writes"])
@pytest.mark.parametrize(("trainer", "worker"), [("cuda:0", "cuda:0"), ("cuda:0", ""), ("", "cuda:0")])
def test_changes_alone_reach_models_on_gpus_bit_exact(workers, trainer, worker, track):
    # Over gloo (one GPU here): the trainer compares its GPU model with its host copy of the last version, the worker
    # applies the changes to its host copy and writes its GPU model from that; its own writes are undone.
    model = build(on("tiny", trainer))
    scheme = ws.DistributedWeightSyncScheme(
        timeout=20, connect_timeout=60, delta="auto", track_writes=track, checksum=True
    )
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, ready = start(workers, {"policy": scheme}, {"policy": on("tiny", worker)}, n=2)
    assert [r[2] for r in ready] == [{}, {}]
    for step in range(1, 7):
        if step == 3:
            assert group.ask(1, "scribble", "policy") == "written"
        sparse_step(ws.WeightStrategy().flat(model).values(), step, fraction=1.0 if step == 5 else 0.05)
        scheme.send()
        for w in range(2):
            assert group.ask(w, "state")["policy"] == (step, checksum(model)), (step, w)
    assert scheme.stats()["changes_sent"] == 2 * 6
    group.stop()
    scheme.shutdown()


def test_nccl_refuses_a_worker_on_the_senders_gpu_by_name(workers):
    # NCCL itself fails such a pair only at the first transfer, with "invalid usage".
    model = build("tiny").cuda()
    scheme = ws.DistributedWeightSyncScheme(backend="nccl", timeout=20, connect_timeout=60)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    group = workers(serve, 1, lambda i, conn: ({"policy": scheme}, i, {"policy": "tiny@cuda:0"}, conn))
    with pytest.raises(ws.ConfigurationError, match="worker 0 is on the same GPU as the sender.*backend='gloo'"):
        scheme.connect()
    _, log, errors = group.recv(0)
    assert log == [] and "same GPU as the sender" in errors["policy"]
    group.stop()
    scheme.shutdown()


@pytest.mark.skipif(GPUS < 2, reason=f"NCCL needs a GPU per rank: 2 here, {GPUS} on this machine")
def test_nccl_moves_weights_gpu_to_gpu(workers):
    model = build("tiny").cuda(0)
    scheme = ws.DistributedWeightSyncScheme(backend="nccl", timeout=20, connect_timeout=60)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    group, ready = start(workers, {"policy": scheme}, {"policy": "tiny@cuda:1"}, n=1)
    assert ready[0][2] == {}
    _sends_arrive_then_stop(scheme, model, group)


def test_checksum_is_refused_where_the_payload_stays_on_the_gpu():
    scheme = ws.DistributedWeightSyncScheme(backend="nccl", checksum=True, timeout=20, connect_timeout=60)
    with pytest.raises(ws.ConfigurationError, match="checksum=True needs the payload in CPU memory"):
        scheme.init_on_sender(model_id="policy", model=build("tiny").cuda(), num_workers=1)
    assert scheme.state == "new"


@pytest.mark.parametrize("name", ["multiprocess", "distributed"])
def test_checksum_and_check_finite_with_cuda_models(workers, name):
    model = build("tiny").cuda()
    scheme = _cpu_engine(name)
    scheme.checksum = scheme.check_finite = True
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    group, ready = start(workers, {"policy": scheme}, {"policy": "tiny@cuda:0"}, n=1)
    assert ready[0][2] == {}
    with torch.no_grad():
        model.body[0].weight[0, 0] = float("nan")
    with pytest.raises(ws.InvalidWeightsError, match="NaN or Inf"):
        scheme.send()
    with torch.no_grad():
        model.body[0].weight[0, 0] = 0.25
    _sends_arrive_then_stop(scheme, model, group)


# ----------------------------------------------------------------- the local schemes' device slots
LOCAL = ["multiprocess", "shared_mem"]


def _local(name: str, **kw) -> ws.WeightSyncScheme:
    return ws.WeightSyncScheme.from_backend(name, timeout=20, connect_timeout=60, **kw)


@pytest.mark.parametrize("name", LOCAL)
def test_a_trainer_step_on_the_gpu_is_invisible_before_send(workers, name):
    bodies.trainer_changes_are_invisible_until_send(_local(name), workers, device="cuda:0")


@pytest.mark.parametrize("name", LOCAL)
def test_no_torn_reads_on_the_gpu_under_alternating_async_sends(workers, name):
    # 64 MiB models: a copy long enough (tens of microseconds on an H100) that a read not fenced by the sender's
    # event, or an ack not waiting for the copy, would see a mix (1 MiB copies end before a reader can look).
    scheme = _local(name, sync=False)
    bodies.no_torn_reads_under_alternating_sends(scheme, workers, 100, device="cuda:0", kind="flat4_64mb")


@pytest.mark.parametrize("name", LOCAL)
def test_a_mismatching_gpu_worker_is_refused_with_nothing_applied(workers, name):
    bodies.mismatching_worker_is_refused_by_name(_local(name), workers, device="cuda:0")


@pytest.mark.parametrize("name", LOCAL)
def test_a_killed_gpu_worker_is_named(workers, name):
    bodies.killed_worker_is_named_and_the_others_are_served(_local(name), workers, device="cuda:0")


@pytest.mark.parametrize("name", LOCAL)
def test_a_hung_gpu_worker_costs_one_timeout(workers, name):
    bodies.hung_worker_costs_one_timeout(_local(name), workers, device="cuda:0")


@pytest.mark.parametrize("name", LOCAL)
def test_a_gpu_worker_killed_and_started_again_rejoins_with_the_newest_version(workers, name):
    model = build("tiny@cuda:0")
    scheme = _local(name)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start(workers, {"policy": scheme}, {"policy": "tiny@cuda:0"})
    os.kill(group.procs[1].pid, signal.SIGKILL)
    group.procs[1].join(10)
    optimizer_step(model, 1)
    with pytest.raises(ws.WorkerDiedError):
        scheme.send()
    again = workers(serve, 1, lambda i, conn: ({"policy": scheme}, 1, {"policy": "tiny@cuda:0"}, conn))
    _, log, errors = again.recv(0)
    assert errors == {} and log == [("policy", 1, checksum(model))]  # the newest version, at once
    optimizer_step(model, 2)
    scheme.send()
    assert again.ask(0, "state")["policy"] == (2, checksum(model))
    assert group.ask(0, "state")["policy"] == (2, checksum(model))
    again.stop()
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("name", LOCAL)
@pytest.mark.parametrize(("trainer", "worker"), [("cuda:0", "cpu"), ("cpu", "cuda:0")])
def test_mixed_devices_go_through_pinned_host_slots(workers, name, trainer, worker):
    model = build(bodies.on("tiny", "" if trainer == "cpu" else trainer))
    scheme = _local(name)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    group, ready = start(
        workers, {"policy": scheme}, {"policy": bodies.on("tiny", "" if worker == "cpu" else worker)}, n=1
    )
    assert ready[0][2] == {}
    slots = scheme.shared_transport.slots
    assert slots and not any(slot.buffer.is_cuda for slot in slots)
    if trainer != "cpu":
        assert all(slot.pinned is not None and slot.pinned.pinned for slot in slots)
    if worker != "cpu":  # the worker pinned the host slots it copies from (read-only ones, for multiprocess)
        pins = group.ask(0, "pinned", "policy")
        assert pins and all(pins), pins
    _sends_arrive_then_stop(scheme, model, group)


@pytest.mark.parametrize("name", LOCAL)
def test_gpu_slots_leave_no_device_memory_behind(workers, name):
    # This process's allocator only: mem_get_info() measures the whole GPU, which another test's processes share
    # under -n 2. The model is made first: the scheme keeps it after shutdown (it is the caller's).
    model = build("flat4@cuda:0")
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    allocated_before = torch.cuda.memory_allocated()
    scheme = _local(name)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start(workers, {"policy": scheme}, {"policy": "flat4@cuda:0"})
    assert torch.cuda.memory_allocated() > allocated_before  # the device slots
    for step in range(1, 6):
        optimizer_step(model, step)
        scheme.send()
    for w in range(2):
        status, _, left = group.ask(w, "stop")
        assert status == "stopped" and not left["threads"], left
    group.stop()
    scheme.shutdown()

    def freed() -> bool:  # torch frees a shared block once the workers' mappings are gone; no event says when
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        return torch.cuda.memory_allocated() == allocated_before

    assert wait_until(freed, deadline_after(10), 0.1), torch.cuda.memory_allocated()


def test_a_shared_mem_gpu_worker_keeps_its_weights_after_the_trainer_shuts_down(workers):
    # Its model ran on the trainer's GPU memory: on the goodbye it takes private memory, while the trainer still
    # keeps that memory for it; reading it later (after the trainer exited) would be undefined.
    model = build("tiny@cuda:0")
    scheme = _local("shared_mem")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    group, _ = start(workers, {"policy": scheme}, {"policy": "tiny@cuda:0"}, n=1)
    optimizer_step(model, 1)
    scheme.send()
    expected = checksum(model)
    on_slot = group.ask(0, "storage", "policy")[0]  # the model's memory: the trainer's slot, mapped
    scheme.shutdown()
    # The worker moves in its own process; the test can only ask it (bounded).
    moved = wait_until(lambda: group.ask(0, "storage", "policy")[0] != on_slot, deadline_after(10), 0.05)
    assert moved  # private memory now
    assert group.ask(0, "state")["policy"] == (1, expected)
    status, _, left = group.ask(0, "stop")
    assert status == "stopped" and not left["threads"], left
    group.stop()
