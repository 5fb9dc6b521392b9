"""A worker of a two-host run, built from the receiver config the trainer wrote, and nothing else.

    python examples/two_hosts/worker.py run1/worker0.yaml [--allow-pickle] [--hidden 256]

Prints each version it holds with the checksum of its weights; exits when the trainer shuts down.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

import weightsync as ws

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import checksum, make_policy  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the receiver config (YAML) the trainer wrote for this worker")
    parser.add_argument("--allow-pickle", action="store_true", help="for rpc: trust the trainer to send pickles")
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()

    torch.set_num_threads(1)
    policy = make_policy(args.hidden)
    scheme = ws.from_config(OmegaConf.load(args.config), allow_pickle=args.allow_pickle)
    scheme.init_on_receiver(model=policy)
    scheme.connect()
    print(f"worker {scheme.worker_idx} version {scheme.version} {checksum(policy)}", flush=True)
    try:
        while True:
            if scheme.receive(timeout=1.0) is not None:
                print(f"worker {scheme.worker_idx} version {scheme.version} {checksum(policy)}", flush=True)
    except ws.ConnectionClosedError:  # the trainer shut down: done
        return 0
    finally:
        scheme.shutdown()


if __name__ == "__main__":
    sys.exit(main())
