"""A TorchRL app whose collector takes its weight sync scheme from TorchRL's Hydra group ``weight_sync_scheme``.

    pip install "torch==2.13.0" -e ".[torchrl]"   # in the clone: TorchRL (or ".[examples]")
    python examples/torchrl_app/train.py       # TorchRL's own SharedMemWeightSyncScheme (the defaults list's)
    python examples/torchrl_app/train.py weight_sync_scheme@collector.weight_sync_schemes.policy=weightsync_shared_mem

``import weightsync.config`` puts weightsync's schemes in that group as ``weightsync_<name>``, so one override
switches the app to weightsync, and ``collector.weight_sync_schemes.policy.<option>=...`` sets their options. The
task and the policy are those of ``examples/torchrl_collector.py``: a ``MultiSyncCollector`` with 2 worker
processes, a REINFORCE step per batch, then ``collector.update_policy_weights_()``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
import torch
import torchrl.trainers.algorithms.configs  # noqa: F401 - registers TorchRL's groups, weight_sync_scheme among them
from hydra.utils import instantiate
from omegaconf import DictConfig
from torchrl.collectors import MultiSyncCollector

import weightsync.config  # noqa: F401 - adds weightsync's schemes to that group

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from torchrl_collector import make_actor, make_env  # noqa: E402 - the one-step task and the Gaussian policy

log = logging.getLogger("train")


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    torch.manual_seed(cfg.seed)
    scheme = instantiate(cfg.collector.weight_sync_schemes.policy)
    options = scheme.option_values() if hasattr(scheme, "option_values") else {}  # weightsync's schemes have it
    log.info("scheme: %s.%s %s", type(scheme).__module__, type(scheme).__qualname__, options)
    actor = make_actor()
    optim = torch.optim.Adam(actor.parameters(), lr=0.05)
    frames = cfg.collector.frames_per_batch
    collector = MultiSyncCollector(
        [make_env, make_env],
        policy=actor,
        frames_per_batch=frames,
        total_frames=frames * cfg.iterations,
        weight_sync_schemes={"policy": scheme},
    )
    try:
        for i, batch in enumerate(collector):
            batch = batch.reshape(-1)
            reward = batch["next", "reward"].reshape(-1)
            log_prob = actor.get_dist(batch.select("observation").clone()).log_prob(batch["action"]).reshape(-1)
            loss = -(log_prob * (reward - reward.mean())).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            collector.update_policy_weights_()
            log.info("iteration %d: mean reward %.3f", i, reward.mean().item())
    finally:
        collector.shutdown()


if __name__ == "__main__":
    main()
