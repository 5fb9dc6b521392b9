"""A ``distributed`` run whose ``master_addr`` is a host name, in a mount namespace where that name gives ``::1``
before ``127.0.0.1`` (as ``localhost`` does on many hosts), run by tests/test_strangers_distributed.py while
another user listens on the same port of ``::1``.

    python -m tests._localhost_v6 PORT

The trainer serves its store at ``localhost:PORT``; a worker built from a receiver config that names
``localhost`` too (written by hand, as a user may) connects and takes a version. It prints where the trainer said
its store is served, then ``ok`` once the worker holds the trainer's weights.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import weightsync as ws
from tests._workers import connect_pair
from weightsync.config import from_config


def main(port: int) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    scheme = ws.DistributedWeightSyncScheme(master_addr="localhost", master_port=port, timeout=5, connect_timeout=20)
    scheme.init_on_sender(model=model, num_workers=1)
    try:
        config = scheme.receiver_config(0)
        print("served at", config["connection"]["master_addr"], flush=True)
        receiver = from_config({**config, "connection": {**config["connection"], "master_addr": "localhost"}})
        receiver.init_on_receiver(model=nn.Linear(4, 4), worker_idx=0)
        try:
            connect_pair(scheme, receiver)
            with torch.no_grad():
                model.weight.add_(1.0)
            scheme.send_async()
            receiver.receive(timeout=10)
            scheme.wait_async()
            held = receiver.model.weight
            print("ok" if receiver.version == 1 and torch.equal(held, model.weight) else "wrong weights", flush=True)
        finally:
            receiver.shutdown()
    finally:
        scheme.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]))
