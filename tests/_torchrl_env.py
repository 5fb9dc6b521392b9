"""A TorchRL environment and policy for the collector tests, importable by the collectors' worker processes.

The policy is ``Linear(2, 1)`` with its weight zero, so every action it takes equals its bias: a batch's actions
say which weights the worker that collected it held.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import Categorical, Composite, Unbounded
from torchrl.envs import EnvBase


class TinyEnv(EnvBase):
    """Observation ``[1, 1]``, one unbounded action, reward = action, done after ``max_steps`` steps."""

    def __init__(self, max_steps: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.max_steps = max_steps
        self.observation_spec = Composite(observation=Unbounded((2,)), shape=())
        self.action_spec = Unbounded((1,))
        self.reward_spec = Unbounded((1,))
        self.done_spec = Composite(
            done=Categorical(2, dtype=torch.bool, shape=(1,)),
            terminated=Categorical(2, dtype=torch.bool, shape=(1,)),
            truncated=Categorical(2, dtype=torch.bool, shape=(1,)),
        )
        self.count = 0

    def _set_seed(self, seed):
        return seed

    def _reset(self, tensordict=None, **kwargs):
        self.count = 0
        no = torch.zeros(1, dtype=torch.bool)
        return TensorDict(observation=torch.ones(2), done=no, terminated=no.clone(), truncated=no.clone())

    def _step(self, tensordict):
        self.count += 1
        done = torch.tensor([self.count >= self.max_steps])
        return TensorDict(
            observation=torch.ones(2),
            reward=tensordict["action"].detach().clone(),
            done=done,
            terminated=done.clone(),
            truncated=torch.zeros(1, dtype=torch.bool),
        )


def make_env() -> TinyEnv:
    return TinyEnv()


def make_policy(bias: float = 0.0) -> TensorDictModule:
    """A policy whose every action is ``bias``."""
    linear = nn.Linear(2, 1)
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.fill_(bias)
    return TensorDictModule(linear, in_keys=["observation"], out_keys=["action"])


def factory_policy() -> TensorDictModule:
    """A ``policy_factory``: its policy acts 9 until the trainer sends weights."""
    return make_policy(9.0)


def actions(batch) -> set[float]:
    """The distinct actions of a batch, rounded."""
    return {round(float(a), 3) for a in batch["action"].flatten()}


def make_env_that_fails_in_a_worker() -> TinyEnv:
    """An environment that cannot be built in a collector's worker process (a missing ROM, say)."""
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        raise RuntimeError("this env cannot be built in a worker: missing ROM")
    return make_env()


def make_recurrent_policy(offset: float = 0.0) -> TensorDictModule:
    from tests._workers import Recurrent

    return TensorDictModule(Recurrent(offset), in_keys=["observation"], out_keys=["action"])


def action_of(policy: TensorDictModule) -> float:
    """The action ``policy`` takes on the environment's observation, rounded as :func:`actions` rounds."""
    with torch.no_grad():
        return round(float(policy(TensorDict(observation=torch.ones(2)))["action"]), 3)
