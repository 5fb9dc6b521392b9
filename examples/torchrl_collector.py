"""Train a small policy with a TorchRL collector whose workers get their weights from a weightsync scheme.

    pip install -e ".[examples]"     # or ".[torchrl]": TorchRL is all this one needs
    python examples/torchrl_collector.py                          # shared_mem, 2 worker processes
    python examples/torchrl_collector.py --scheme multiprocess --iters 60

The environment is a one-step task: the observation holds a target ``t`` in [-1, 1], the reward is
``-(action - 2 t)^2``. The policy is Gaussian (a linear layer gives its mean and scale) and learns by REINFORCE.
A ``MultiSyncCollector`` runs it in 2 worker processes; after every optimizer step
``collector.update_policy_weights_()`` sends the new weights through the weightsync scheme and returns once both
workers hold them, so each batch is collected with the weights of the step before it, and the example checks
so. The only weightsync line is the ``weight_sync_schemes`` argument.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torch.distributions import Normal
from torchrl.collectors import MultiSyncCollector
from torchrl.data import Categorical, Composite, Unbounded
from torchrl.envs import EnvBase
from torchrl.modules import ProbabilisticActor

import weightsync as ws


class TargetEnv(EnvBase):
    """One step: observe ``[t, 1]``, act, get ``-(action - 2 t)^2``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.observation_spec = Composite(observation=Unbounded((2,)), shape=())
        self.action_spec = Unbounded((1,))
        self.reward_spec = Unbounded((1,))
        self.done_spec = Composite(
            done=Categorical(2, dtype=torch.bool, shape=(1,)),
            terminated=Categorical(2, dtype=torch.bool, shape=(1,)),
            truncated=Categorical(2, dtype=torch.bool, shape=(1,)),
        )
        self.target = torch.zeros(1)

    def _set_seed(self, seed):
        torch.manual_seed(seed)
        return seed

    def _reset(self, tensordict=None, **kwargs):
        self.target = torch.rand(1) * 2 - 1
        no = torch.zeros(1, dtype=torch.bool)
        return TensorDict(
            observation=torch.cat([self.target, torch.ones(1)]), done=no, terminated=no.clone(), truncated=no.clone()
        )

    def _step(self, tensordict):
        reward = -((tensordict["action"] - 2 * self.target) ** 2)
        yes = torch.ones(1, dtype=torch.bool)
        return TensorDict(
            observation=torch.cat([self.target, torch.ones(1)]),
            reward=reward.detach(),
            done=yes,
            terminated=yes.clone(),
            truncated=torch.zeros(1, dtype=torch.bool),
        )


def make_env() -> TargetEnv:
    return TargetEnv()


def make_actor() -> ProbabilisticActor:
    net = nn.Sequential(nn.Linear(2, 2), NormalParamExtractor())
    with torch.no_grad():
        net[0].weight.zero_()
        net[0].bias.zero_()
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
    return ProbabilisticActor(module, in_keys=["loc", "scale"], distribution_class=Normal, return_log_prob=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default="shared_mem", choices=["shared_mem", "multiprocess"])
    parser.add_argument("--iters", type=int, default=40, help="optimizer steps (one batch each)")
    parser.add_argument("--frames", type=int, default=256, help="frames per batch")
    args = parser.parse_args()

    torch.manual_seed(0)
    actor = make_actor()
    optim = torch.optim.Adam(actor.parameters(), lr=0.05)
    scheme = ws.WeightSyncScheme.from_backend(args.scheme, timeout=60)
    collector = MultiSyncCollector(
        [make_env, make_env],
        policy=actor,
        frames_per_batch=args.frames,
        total_frames=args.frames * args.iters,
        weight_sync_schemes={"policy": scheme},  # the one weightsync line
    )
    rewards = []
    try:
        for i, batch in enumerate(collector):
            batch = batch.reshape(-1)
            # Each batch was collected with the weights sent after the previous step: check it on the log-probs.
            with torch.no_grad():
                replay = actor.get_dist(batch.select("observation").clone()).log_prob(batch["action"])
            stale = (replay.reshape(-1) - batch["action_log_prob"].reshape(-1)).abs().max().item()
            if stale > 1e-4:
                print(f"batch {i} was collected with other weights than the trainer's (log-prob gap {stale:.2e})")
                return 1
            reward = batch["next", "reward"].reshape(-1)
            advantage = reward - reward.mean()
            log_prob = actor.get_dist(batch.select("observation").clone()).log_prob(batch["action"]).reshape(-1)
            loss = -(log_prob * advantage).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            collector.update_policy_weights_()
            rewards.append(reward.mean().item())
            if i % 10 == 0:
                print(f"iter {i:3d}  mean reward {rewards[-1]:8.3f}  weights version {scheme.version}")
    finally:
        collector.shutdown()
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    print(f"mean reward: first 5 batches {first:.3f}, last 5 batches {last:.3f}; scheme {scheme.state}")
    learned = last > first + 0.2
    print(f"learned: {'yes' if learned else 'no'}")
    return 0 if learned else 1


if __name__ == "__main__":
    sys.exit(main())
