"""Train a CartPole policy by random search; rollout workers act with the weights weightsync gives them.

    python examples/hydra_app/train.py
    python examples/hydra_app/train.py weightsync/scheme=shared_mem num_workers=3
    python examples/hydra_app/train.py weightsync.scheme.sync=false

Each iteration the trainer perturbs its policy, sends the candidate to every
worker, and the workers play CartPole with it and report their returns (with
the version they played). The trainer keeps the candidate if it did better.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import statistics

import gymnasium as gym
import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

import weightsync.config  # noqa: F401 - registers the weightsync/... config groups
from weightsync import ConnectionClosedError
from weightsync.config import from_config

# Hydra sends what is logged to the console and to the run's train.log.
log = logging.getLogger("train")


def make_policy() -> nn.Module:
    return nn.Linear(4, 2)


def rollout_worker(receiver_cfg: dict, episodes: int, seed: int, requests, results) -> None:
    """Play ``episodes`` episodes each time the trainer asks, with whatever weights we hold then."""
    torch.set_num_threads(1)
    policy = make_policy()
    # Plain data in, a receiver out: no access to the trainer's objects. The trainer that wrote the config is
    # this process's parent, and it runs rpc only if the user opted in to what an rpc world allows (every process
    # reaching its store can run code in its members): the worker takes the same risk. (The local schemes need
    # neither opt-in.)
    scheme = from_config(receiver_cfg, allow_pickle=True, allow_store_peers_to_run_code=True)
    scheme.init_on_receiver(model=policy)
    scheme.connect()
    env = gym.make("CartPole-v1")
    try:
        while True:
            # A synchronous send returns once this worker applied the update: wait for one, and for the
            # trainer's request, by turns, a few milliseconds each.
            try:
                scheme.receive(timeout=0.02)
            except ConnectionClosedError:
                return
            if requests.poll(0.02):
                if requests.recv() == "stop":
                    return
                returns = []
                for episode in range(episodes):
                    obs, _ = env.reset(seed=seed + episode)
                    total, done = 0.0, False
                    while not done:
                        with torch.no_grad():
                            action = int(policy(torch.as_tensor(obs)).argmax())
                        obs, reward, terminated, truncated, _ = env.step(action)
                        total += reward
                        done = terminated or truncated
                    returns.append(total)
                results.put((scheme.worker_idx, scheme.version, returns))
    finally:
        env.close()
        scheme.shutdown()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    torch.manual_seed(cfg.seed)
    policy = make_policy()
    best = {k: v.clone() for k, v in policy.state_dict().items()}
    scheme = instantiate(cfg.weightsync.scheme)
    scheme.init_on_sender(model_id="policy", model=policy, num_workers=cfg.num_workers)
    log.info("%s, %d workers, options %s", type(scheme).__name__, cfg.num_workers, scheme.option_values())
    # The workers fork from a server that imported this script, torch and gymnasium with it, once (forkserver's
    # default preload); spawned, each would import them itself.
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    results = ctx.Queue()
    pipes, procs = [], []
    for i in range(cfg.num_workers):
        mine, theirs = ctx.Pipe()
        args = (scheme.receiver_config(i), cfg.episodes_per_worker, cfg.seed + 1000 * i, theirs, results)
        procs.append(ctx.Process(target=rollout_worker, args=args, daemon=True))
        procs[-1].start()
        pipes.append(mine)
    best_score = -1.0
    try:
        scheme.connect(processes=procs)  # a worker that dies before it connects is named at once
        for it in range(cfg.iterations):
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    p.copy_(best[name] + cfg.noise * torch.randn_like(p))
            scheme.send()
            if not scheme.sync:
                scheme.wait_async()
            for pipe in pipes:
                pipe.send("play")
            reports = [results.get(timeout=60) for _ in pipes]
            assert all(version == scheme.version for _, version, _ in reports), "a worker played stale weights"
            score = statistics.mean(r for _, _, rs in reports for r in rs)
            if score > best_score:
                best_score = score
                best = {k: v.clone() for k, v in policy.state_dict().items()}
            log.info("iteration %2d  version %2d  mean return %6.1f  best %6.1f", it, scheme.version, score, best_score)
    finally:
        for pipe in pipes:
            pipe.send("stop")
        scheme.shutdown()
        for proc in procs:
            proc.join(30)
    log.info("scheme=%s workers=%d best mean return %.1f", type(scheme).__name__, cfg.num_workers, best_score)


if __name__ == "__main__":
    main()
