"""RPCWeightSyncScheme with real TensorPipe agents on loopback.

torch.distributed.rpc can start only once per process (pytorch/pytorch#46491), so each test runs its
trainer in a fresh process (which starts its own workers) and reports back.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

import weightsync as ws
from tests import _rpc_trainer


def _in_trainer_process(scenario: str, timeout: float = 240.0) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_rpc_trainer.run, args=(scenario, child))
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            pytest.fail(f"the RPC trainer did not finish {scenario} within {timeout:.0f}s")
        status, detail = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert status == "ok", f"{scenario} failed in the trainer process:\n{detail}"


@pytest.mark.parametrize(
    "scenario",
    [
        "every_send_reaches_every_targeted_worker:state_dict",
        "every_send_reaches_every_targeted_worker:tensordict",
        "trainer_changes_are_invisible_until_send",
        "bad_weights_fail_in_the_caller_and_send_nothing:tensordict",
        "killed_worker_is_named_and_the_others_are_served",
        "mismatching_worker_is_refused_by_name",
        "wire_dtype_halves_the_bytes_and_workers_hold_the_rounded_weights::wire_dtype=bfloat16",
        "corrupted_payload_is_refused_and_the_model_kept::checksum=1",
        "dropped_worker_is_named_and_the_others_go_on::on_failure=drop",
    ],
)
def test_rpc_scheme(scenario):
    _in_trainer_process(scenario)


def test_bad_arguments_fail_before_anything_starts():
    with pytest.raises(ws.ConfigurationError, match="num_workers"):
        ws.RPCWeightSyncScheme().init_on_sender(model_id="policy", model=ws.WeightStrategy)
    with pytest.raises(ws.ConfigurationError, match="master_port"):
        ws.RPCWeightSyncScheme(master_port=70000)
    with pytest.raises(ws.ConfigurationError, match="rpc.init_rpc first"):
        import torch

        ws.RPCWeightSyncScheme().init_on_sender(model=torch.nn.Linear(2, 2), worker_names=["a"])
