"""The pieces of weightsync.integrations.torchrl (and the core's hold of a driven model) that need no TorchRL:
forward passes hold the weights lock, a collector is recognised by its module, refusals name what works."""

from __future__ import annotations

import threading

import pytest
import torch

import weightsync as ws
from weightsync.core.drivers import forward_lock_hooks
from weightsync.integrations.torchrl import client_of, is_torchrl_collector


class Probe(torch.nn.Module):
    def __init__(self, lock, fail=False):
        super().__init__()
        self.lock, self.fail, self.held = lock, fail, None
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x):
        self.held = self.lock._is_owned()
        if self.fail:
            raise RuntimeError("forward failed")
        return self.linear(x)


def test_forward_passes_hold_the_weights_lock_and_let_it_go_even_when_they_fail():
    lock = threading.RLock()
    model = Probe(lock)
    hooks = forward_lock_hooks(model, lock)
    model(torch.ones(2))
    assert model.held and not lock._is_owned()
    model.fail = True
    with pytest.raises(RuntimeError, match="forward failed"):
        model(torch.ones(2))
    assert model.held and not lock._is_owned()
    # Another thread waits while a forward pass runs.
    lock.acquire()
    got = []
    thread = threading.Thread(target=lambda: got.append(lock.acquire(timeout=0.2)))
    thread.start()
    thread.join(5)
    lock.release()
    assert got == [False]
    for hook in hooks:
        hook.remove()
    model.fail = False
    model(torch.ones(2))
    assert not model.held


def _fake(module: str, name: str, **attrs):
    cls = type(name, (), {"__module__": module, **attrs})
    return cls()


def test_a_collector_is_known_by_its_module_and_its_workers():
    assert not is_torchrl_collector(object()) and client_of(object()) is None
    assert client_of(_fake("torchrl.collectors._single", "Collector")) == {"in_process": True}
    multi = _fake("torchrl.collectors._multi_sync", "MultiSyncCollector", num_workers=2)
    assert client_of(multi) == {"applies_itself": True, "index_base": 0}
    ranked = _fake("torchrl.collectors.distributed.generic", "DistributedCollector", num_workers=2)
    assert client_of(ranked) == {"applies_itself": True, "index_base": 1}


def test_a_worker_handed_an_uninitialized_scheme_by_a_collector_is_refused_by_name():
    scheme = ws.MultiProcessWeightSyncScheme()
    collector = _fake("torchrl.collectors.distributed.rpc", "RPCCollector")
    with pytest.raises(ws.ConfigurationError, match="RPCCollector.*initialized on the sender first"):
        scheme.init_on_receiver(model_id="policy", model=torch.nn.Linear(2, 1), context=collector, worker_idx=0)
    assert scheme.state == "new"
