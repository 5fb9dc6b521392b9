"""Weights that live on a GPU: CUDA models over the CPU engines, and NCCL. Skipped where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

import weightsync as ws
from tests._bodies import optimizer_step, start
from tests._workers import build, checksum, serve

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
def test_cuda_models_on_both_sides_over_a_cpu_engine(workers, name):
    model = build("tiny").cuda()
    scheme = _cpu_engine(name)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    group, ready = start(workers, {"policy": scheme}, {"policy": "tiny@cuda:0"}, n=1)
    assert ready[0][2] == {} and ready[0][1] == [("policy", 0, checksum(model))]
    _sends_arrive_then_stop(scheme, model, group)


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
