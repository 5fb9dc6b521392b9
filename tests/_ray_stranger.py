"""A stranger on a third host tries to join a Ray cluster whose head it can reach: run by tests/test_two_hosts.py,
with a wrong token, or with none. Prints whether it got in."""

from __future__ import annotations

import sys
import time

import ray


def main(address: str) -> None:
    began = time.monotonic()
    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - what Ray says is the finding
        print(f"refused after {time.monotonic() - began:.1f} s: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return
    print(f"joined the cluster: {ray.cluster_resources()}", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
