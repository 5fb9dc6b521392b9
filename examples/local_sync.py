"""Sync a policy from a trainer to worker processes and check every worker holds every version.

    python examples/local_sync.py                       # multiprocess scheme, 2 workers
    python examples/local_sync.py --scheme shared_mem --workers 4 --rounds 20

Each round does an optimizer step in the trainer, then ``send()``; each worker
applies the update in its loop and reports a checksum of its weights, which
must equal the trainer's for that version.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import statistics
import time

import torch
from torch import nn

import weightsync as ws


def make_policy(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 8))


def checksum(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(key.encode() + tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def worker(scheme: ws.WeightSyncScheme, worker_idx: int, hidden: int, reports) -> None:
    torch.set_num_threads(1)  # several workers share the machine's cores
    policy = make_policy(hidden)
    scheme.init_on_receiver(model_id="policy", model=policy, worker_idx=worker_idx)
    scheme.connect()
    reports.put((worker_idx, scheme.version, checksum(policy)))
    while True:
        try:
            if scheme.receive(timeout=1.0) is not None:
                reports.put((worker_idx, scheme.version, checksum(policy)))
        except ws.ConnectionClosedError:  # the trainer shut the scheme down
            break
        with torch.no_grad():
            policy(torch.randn(16, 64))  # act with the weights we hold
    scheme.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scheme", default="multiprocess", choices=["multiprocess", "shared_mem"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    policy = make_policy(args.hidden)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.01)
    scheme = ws.WeightSyncScheme.from_backend(args.scheme, timeout=30)
    scheme.init_on_sender(model_id="policy", model=policy, num_workers=args.workers)
    reports = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(scheme, i, args.hidden, reports)) for i in range(args.workers)]
    for proc in procs:
        proc.start()
    expected, times = {}, []
    try:
        scheme.connect()
        expected[0] = checksum(policy)
        for version in range(1, args.rounds + 1):
            loss = policy(torch.randn(32, 64)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            expected[version] = checksum(policy)
            start = time.perf_counter()
            scheme.send()
            times.append(time.perf_counter() - start)
        seen = [reports.get(timeout=30) for _ in range(args.workers * (args.rounds + 1))]
    finally:
        scheme.shutdown()
        for proc in procs:
            proc.join(30)
    wrong = [(w, v) for w, v, digest in seen if expected[v] != digest]
    nbytes = sum(t.numel() * t.element_size() for t in policy.state_dict().values())
    print(f"scheme={args.scheme} workers={args.workers} rounds={args.rounds} model={nbytes / 1e6:.2f} MB")
    print(f"send median {statistics.median(times) * 1e3:.3f} ms, max {max(times) * 1e3:.3f} ms")
    print(
        f"verified: {'yes' if not wrong else f'NO, mismatches {wrong}'} "
        f"({len(seen)} worker reports, every version in every worker)"
    )
    if wrong or any(p.exitcode != 0 for p in procs):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
