"""RPCWeightSyncScheme with real TensorPipe agents on loopback.

torch.distributed.rpc can start only once per process (pytorch/pytorch#46491), so each test runs its
trainer in a process of its own, forked from the tests' forkserver (which never starts RPC). That trainer
starts its own workers and reports back.
"""

from __future__ import annotations

import pytest

import weightsync as ws
from tests import _rpc_trainer
from tests.conftest import _CTX


def _in_trainer_process(scenario: str, timeout: float = 240.0, host_address: str | None = None) -> None:
    parent, child = _CTX.Pipe()
    proc = _CTX.Process(target=_rpc_trainer.run, args=(scenario, child, host_address))
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
        "worker_storage_switches_unless_kept",
        "worker_storage_switches_unless_kept::keep_storage=true",
        "shared_memory_worker_is_written_into",
        "flatten_sender_copies_one_buffer::flatten_sender=true",
        "bad_weights_fail_in_the_caller_and_send_nothing:tensordict",
        "killed_worker_is_named_and_the_others_are_served",
        "mismatching_worker_is_refused_by_name",
        "wire_dtype_halves_the_bytes_and_workers_hold_the_rounded_weights::wire_dtype=bfloat16",
        "corrupted_payload_is_refused_and_the_model_kept::checksum=true",
        "dropped_worker_is_named_and_the_others_go_on::on_failure=drop",
        "restarted_worker_is_refused_with_the_reason",
        "hung_worker_costs_one_timeout::on_failure=raise",
        "hung_worker_costs_one_timeout::on_failure=drop",
    ],
)
def test_rpc_scheme(scenario):
    _in_trainer_process(scenario)


def test_agents_stay_on_loopback_where_the_host_name_resolves_to_a_network_address():
    """TensorPipe listens where the host's name resolves; the scheme names the interface that reaches the
    sender instead. Without that, this trainer listened on the machine's network address too."""
    import os
    import socket

    import psutil

    addresses = [
        a.address
        for name, addrs in psutil.net_if_addrs().items()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    if not addresses or os.geteuid() != 0:
        pytest.skip("needs a non-loopback IPv4 address and root (a private mount namespace for /etc/hosts)")
    _in_trainer_process("agents_listen_on_loopback_only", host_address=addresses[0])


def test_bad_arguments_fail_before_anything_starts():
    with pytest.raises(ws.ConfigurationError, match="num_workers"):
        ws.RPCWeightSyncScheme().init_on_sender(model_id="policy", model=ws.WeightStrategy)
    with pytest.raises(ws.ConfigurationError, match="master_port"):
        ws.RPCWeightSyncScheme(master_port=70000)
    with pytest.raises(ws.ConfigurationError, match="rpc.init_rpc first"):
        import torch

        ws.RPCWeightSyncScheme().init_on_sender(model=torch.nn.Linear(2, 2), worker_names=["a"])


def test_a_network_address_needs_the_pickle_opt_in_on_both_sides():
    import torch

    sender = ws.RPCWeightSyncScheme(master_addr="10.255.255.1")
    with pytest.raises(ws.ConfigurationError, match="unpickles every message.*allow_pickle=True"):
        sender.init_on_sender(model_id="policy", model=torch.nn.Linear(2, 2), num_workers=1)
    assert sender.state == "new"  # refused before any store was served
    # Opted in, it goes on, and fails only because 10.255.255.1 is not this machine's.
    with pytest.raises(ws.ConfigurationError, match="cannot serve a TCP store on 10.255.255.1"):
        ws.RPCWeightSyncScheme(master_addr="10.255.255.1", allow_pickle=True).init_on_sender(
            model_id="policy", model=torch.nn.Linear(2, 2), num_workers=1
        )
    worker = ws.RPCWeightSyncScheme(connect_timeout=5)
    handoff = {"token": "t", "master_addr": "10.255.255.1", "master_port": 1, "world_size": 2, "counter": 0}
    worker._prepare_receiver(model_id="policy", worker_idx=0, connection=handoff)  # as from_config does
    worker.init_on_receiver(model_id="policy", model=torch.nn.Linear(2, 2), worker_idx=0)
    with pytest.raises(ws.ConfigurationError, match="allow_pickle=True") as info:
        worker.connect()
    assert info.value.worker_idx == 0
