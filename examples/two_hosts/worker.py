"""A worker of a two-host run, built from the receiver config the trainer wrote, and nothing else.

    python examples/two_hosts/worker.py run1/worker0.yaml [--allow-store-peers-to-run-code] [--hidden 256] [--key FILE]

Prints each version it holds with the checksum of its weights; exits (0) when the trainer shuts down, or when its
host stops answering (after four times the scheme's ``timeout``). A worker the trainer dropped (``on_failure=drop``:
its link was down, it stalled) connects again by itself with ``distributed``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import weightsync as ws

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import checksum, make_policy  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the receiver config (YAML) the trainer wrote for this worker")
    parser.add_argument(
        "--allow-store-peers-to-run-code",
        action="store_true",
        help="for rpc: accept that every process reaching the trainer's store can run code in this worker",
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--key", help="distributed: where this host keeps its copy of the run key file, if not "
                        "at the path the config names")  # fmt: skip
    args = parser.parse_args()

    torch.set_num_threads(1)
    policy = make_policy(args.hidden)
    opt_in = args.allow_store_peers_to_run_code
    # A Path: weightsync reads the file itself, strictly and bounded (OmegaConf.load would expand YAML aliases
    # first, and the file came from another host).
    scheme = ws.from_config(Path(args.config), allow_store_peers_to_run_code=opt_in)
    scheme.init_on_receiver(model=policy, **({"authkey_file": args.key} if args.key else {}))
    scheme.connect()
    print(f"worker {scheme.worker_idx} version {scheme.version} {checksum(policy)}", flush=True)
    try:
        while True:
            try:
                if scheme.receive(timeout=1.0) is not None:
                    print(f"worker {scheme.worker_idx} version {scheme.version} {checksum(policy)}", flush=True)
            except ws.SyncTimeoutError as exc:  # an update begun did not arrive whole in time: nothing applied
                print(f"worker {scheme.worker_idx} keeps version {scheme.version}: {exc}", file=sys.stderr, flush=True)
    except ws.ConnectionClosedError as exc:  # the trainer shut down, or its host is gone: done
        print(f"worker {scheme.worker_idx} done: {exc}", file=sys.stderr, flush=True)
        return 0
    finally:
        scheme.shutdown()


if __name__ == "__main__":
    sys.exit(main())
