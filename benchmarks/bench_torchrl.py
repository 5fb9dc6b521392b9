"""``collector.update_policy_weights_()`` of a TorchRL ``MultiSyncCollector``: weightsync's schemes against
TorchRL's own, in the same run.

    pip install -e ".[torchrl]"
    python benchmarks/bench_torchrl.py                  # a 100 MB policy, 2 workers, 10 timed updates per scheme
    python benchmarks/bench_torchrl.py --write          # ... and rewrites the TorchRL section of docs/benchmarks.md
    python benchmarks/bench_torchrl.py --mb 10 --rounds 3   # a quick look

Each round: an optimizer-like step changes every weight of the trainer's policy in place, the collector
collects a batch, then ``update_policy_weights_()`` is timed; after the last round every worker's actions are
checked against the trainer's policy (the policy's last layer reads the weights everywhere: a worker that
missed an update acts differently). TorchRL's ``SharedMemWeightSyncScheme`` keeps the trainer's policy in
shared memory that its workers read: its update only signals, and its workers see every trainer step at once
(no isolation); the table says so.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tensordict.nn import TensorDictModule
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_local  # noqa: E402
from _doc import replace_section  # noqa: E402

from tests._torchrl_env import make_env  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def make_policy(mb: float) -> TensorDictModule:
    """An MLP of about ``mb`` megabytes of float32 weights whose action depends on every layer."""
    width = max(16, int((mb * 2**20 / 4) ** 0.5))
    net = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
    return TensorDictModule(net, in_keys=["observation"], out_keys=["action"])


def schemes() -> dict[str, object]:
    import torchrl.weight_update as trl

    import weightsync as ws

    return {
        "weightsync multiprocess": lambda: ws.MultiProcessWeightSyncScheme(timeout=120),
        "TorchRL multiprocess": lambda: trl.MultiProcessWeightSyncScheme(),
        "weightsync shared_mem": lambda: ws.SharedMemWeightSyncScheme(timeout=120),
        "TorchRL shared_mem": lambda: trl.SharedMemWeightSyncScheme(),
    }


def run_one(make_scheme, mb: float, rounds: int) -> dict[str, float]:
    from torchrl.collectors import MultiSyncCollector

    torch.manual_seed(0)
    policy = make_policy(mb)
    nbytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    began = time.perf_counter()
    collector = MultiSyncCollector(
        [make_env, make_env],
        policy=policy,
        frames_per_batch=8,
        total_frames=-1,
        weight_sync_schemes={"policy": make_scheme()},
    )
    built = time.perf_counter() - began
    times = []
    try:
        batches = iter(collector)
        next(batches)
        isolated = None
        for _ in range(rounds):
            before = copy.deepcopy(policy) if isolated is None else None
            with torch.no_grad():
                for p in policy.parameters():
                    p.mul_(0.999).add_(1e-4)
            batch = next(batches)
            if before is not None:  # collected after the step, before the update: with which weights?
                isolated = acts_as(before, batch) and not acts_as(policy, batch)
            start = time.perf_counter()
            collector.update_policy_weights_()
            times.append(time.perf_counter() - start)
        agree = acts_as(policy, next(batches))
    finally:
        collector.shutdown()
    median = statistics.median(times)
    return {"built": built, "median": median, "gbs": nbytes / median / 1e9, "agree": agree, "isolated": isolated}


def acts_as(policy: TensorDictModule, batch) -> bool:
    """Whether every action of ``batch`` is what ``policy`` does."""
    with torch.no_grad():
        expected = policy(batch.select("observation").clone())["action"]
    return torch.allclose(batch["action"], expected, atol=1e-5)


def copy_floor(mb: float, rounds: int) -> float:
    """Median seconds of one ``copy_`` of the policy's bytes: what any update that leaves the workers a copy of
    their own costs at least (weightsync's ``shared_mem`` makes one; ``multiprocess`` one, then one per worker)."""
    src = torch.cat([p.detach().reshape(-1) for p in make_policy(mb).parameters()])
    dst = torch.empty_like(src)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def table(rows: dict[str, dict[str, float]], mb: float, rounds: int, seconds: float, floor: float) -> str:
    lines = [
        f"`update_policy_weights_()` of a `MultiSyncCollector`, 2 workers, a {mb:g} MB float32 policy, median of "
        f"{rounds} updates per scheme, one run of `benchmarks/bench_torchrl.py` ({seconds:.0f} s, torch "
        f"{torch.__version__}, {os.cpu_count()} cores).",
        "",
        "| scheme | median update (ms) | GB/s | workers act as the trainer after it | a trainer step reaches the "
        "workers before it | collector built in (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        agree, leaks = ("yes" if row["agree"] else "no"), ("no" if row["isolated"] else "yes")
        lines.append(
            f"| {name} | {row['median'] * 1e3:.1f} | {row['gbs']:.2f} | {agree} | {leaks} | {row['built']:.1f} |"
        )
    lines += [
        "",
        f"One `copy_` of the policy's bytes, the floor of an update that leaves the workers their own "
        f"copy, measured in the same run: {floor * 1e3:.1f} ms.",
    ]
    for kind in ("multiprocess", "shared_mem"):
        ours, theirs = rows.get(f"weightsync {kind}"), rows.get(f"TorchRL {kind}")
        if ours and theirs:
            lines.append(
                f"{kind}: weightsync {ours['median'] / floor:.2f}x the copy floor, "
                f"{ours['median'] / theirs['median']:.2f}x TorchRL's time."
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--only", nargs="*", help="run only these schemes (names as in the table)")
    parser.add_argument("--write", action="store_true", help="rewrite the TorchRL section of docs/benchmarks.md")
    args = parser.parse_args()
    bench_local.passive_openmp()
    began = time.perf_counter()
    rows = {}
    for name, make_scheme in schemes().items():
        if args.only and name not in args.only:
            continue
        rows[name] = run_one(make_scheme, args.mb, args.rounds)
        print(f"{name}: {rows[name]['median'] * 1e3:.1f} ms", flush=True)
    floor = copy_floor(args.mb, args.rounds)
    text = table(rows, args.mb, args.rounds, time.perf_counter() - began, floor)
    print(text)
    if args.write:
        replace_section(DOC, "torchrl", text)


if __name__ == "__main__":
    main()
