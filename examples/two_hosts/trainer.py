"""The trainer of a two-host run: a Hydra app that writes each worker's receiver config as YAML, then sends.

    # host A (reachable from host B as 10.0.0.1)
    python examples/two_hosts/trainer.py out=run1 weightsync.scheme.master_addr=10.0.0.1
    # copy run1/worker0.yaml, run1/worker1.yaml and the run key file they name to host B, then there:
    python examples/two_hosts/worker.py run1/worker0.yaml [--key where/B/keeps/the/key/file]
    python examples/two_hosts/worker.py run1/worker1.yaml

``weightsync/scheme=rpc`` (with ``weightsync.scheme.allow_store_peers_to_run_code=true``, and
``--allow-store-peers-to-run-code`` on the workers: every process that can reach the trainer's store can run code
in the trainer and the workers) swaps the engine. Each version the trainer sends is printed with its checksum, as
each worker prints what it received: the two lists must agree. The YAML holds the scheme's options and where to
connect, no secret and nothing to unpickle; the run key travels apart, as a file (docs/multinode.md).
``weightsync.scheme.on_failure=drop`` lets the trainer go on without a worker whose link is down; it connects
again by itself once the link is back.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

import weightsync as ws
import weightsync.config  # noqa: F401 - registers weightsync's groups

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import checksum, make_policy  # noqa: E402


@dataclass
class TwoHosts:
    defaults: list[Any] = field(default_factory=lambda: [{"weightsync/scheme": "distributed"}, "_self_"])
    out: str = "two_hosts_run"  # where the workers' receiver configs are written
    workers: int = 2
    versions: int = 5
    hidden: int = 256
    every: float = 0.0  # seconds between two versions
    linger: float = 0.0  # seconds to stay connected after the last send (to look at the sockets of a run)


ConfigStore.instance().store(name="two_hosts", node=TwoHosts)


@hydra.main(version_base=None, config_name="two_hosts")
def main(cfg: Any) -> None:
    torch.manual_seed(0)
    policy = make_policy(cfg.hidden)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.01)
    scheme = hydra.utils.instantiate(cfg.weightsync.scheme)
    scheme.init_on_sender(model_id="policy", model=policy, num_workers=cfg.workers)
    out = Path(hydra.utils.to_absolute_path(cfg.out))
    out.mkdir(parents=True, exist_ok=True)
    for i in range(cfg.workers):  # written whole, then renamed: a worker never reads half a file
        part = out / f"worker{i}.yaml.part"
        part.write_text(OmegaConf.to_yaml(scheme.receiver_config(i)))
        part.rename(out / f"worker{i}.yaml")
    try:
        scheme.connect()  # waits for every worker (connect_timeout)
        print(f"sent version 0 {checksum(policy)}", flush=True)
        for version in range(1, cfg.versions + 1):
            loss = policy(torch.randn(64, 32)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"sending version {version} {checksum(policy)}", flush=True)
            began = time.monotonic()
            try:
                scheme.send()  # returns once every worker holds it
            except ws.WeightSyncError as exc:  # a worker died, hung or could not be reached: named in exc
                print(f"send of version {version} failed after {time.monotonic() - began:.1f} s: {exc!r}", flush=True)
                raise
            held = sorted(w for w, v in scheme.acked_versions.items() if v == version)  # on_failure=drop: who has it
            print(f"sent version {version} {checksum(policy)} held by {held}", flush=True)
            time.sleep(cfg.every)
        time.sleep(cfg.linger)
    finally:
        scheme.shutdown()


if __name__ == "__main__":
    main()
