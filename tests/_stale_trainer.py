"""A trainer that writes worker 0's receiver config as YAML for each engine named on its command line, says so,
and waits to be killed (tests/test_timeouts.py): what its workers find is a config whose sender is gone. It ends
by itself when its input closes (the test went away), or after five minutes."""

from __future__ import annotations

import select
import sys

from omegaconf import OmegaConf
from torch import nn

import weightsync as ws

if __name__ == "__main__":
    out, backends = sys.argv[1], sys.argv[2:]
    schemes = []
    for backend in backends:
        # rpc runs only for a user who accepts what its world allows (every local user can run code in it).
        opt_in = {"allow_store_peers_to_run_code": True} if backend == "rpc" else {}
        scheme = ws.WeightSyncScheme.from_backend(backend, **opt_in)
        scheme.init_on_sender(model_id=backend, model=nn.Linear(2, 2), num_workers=1)
        OmegaConf.save(OmegaConf.create(scheme.receiver_config(0)), f"{out}/{backend}.yaml")
        schemes.append(scheme)
    print("written", flush=True)
    select.select([sys.stdin], [], [], 300)  # until the test kills it, or closes its input
