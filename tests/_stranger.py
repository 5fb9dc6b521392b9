"""A process on a third host that was not invited, run by tests/test_two_hosts.py. It knows the trainer's address
and the store's port, and holds a copy of a worker's YAML receiver config (saved with the run's outputs, say), but
not the run key file that config names. Each mode prints what it could do.

    python -m tests._stranger store ADDR PORT            # reach the store; read what it can name
    python -m tests._stranger worker YAML                # be worker 0 with a key of its own
    python -m tests._stranger rejoin ADDR PORT PREFIX    # with the run's prefix (the YAML names it): claim worker 0
    python -m tests._stranger rpc YAML                   # an rpc run: read the world's keys, join as worker 0
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import weightsync as ws
from weightsync.transports.keyfiles import key_name, write_key_file


def store(addr: str, port: int) -> dist.Store:
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=10))


def main(mode: str, *args: str) -> None:
    if mode == "store":
        s = store(args[0], int(args[1]))
        print(f"store reached: {s.num_keys()} keys", flush=True)
        guess = f"weightsync/policy/{secrets.token_hex(8)}/layout"
        print(f"a guessed prefix holds the layout: {s.check([guess])}", flush=True)
    elif mode == "worker":
        cfg = OmegaConf.to_container(OmegaConf.load(args[0]))
        cfg["connection"]["authkey_file"] = write_key_file(key_name(), secrets.token_bytes(32))  # its own key
        del cfg["connection"]["run"]  # (which its own key does not give: a worker would refuse to start)
        cfg["scheme"]["connect_timeout"] = 4
        scheme = ws.from_config(cfg)
        scheme.init_on_receiver(model=torch.nn.Linear(2, 2))
        began = time.monotonic()
        try:
            scheme.connect()
            print("joined as worker 0", flush=True)
        except ws.WeightSyncError as exc:
            print(f"not joined after {time.monotonic() - began:.0f} s: {type(exc).__name__}: {exc}", flush=True)
    elif mode == "rpc":  # rpc has no run key: its world's keys have fixed names, and the YAML says the rest
        cfg = OmegaConf.to_container(OmegaConf.load(args[0]))
        where = cfg["connection"]
        s = store(where["master_addr"], int(where["master_port"]))
        print(f"store reached: {s.num_keys()} keys, worker 0 joined: {s.check(['weightsync-joined/1'])}", flush=True)
        scheme = ws.from_config(cfg, allow_store_peers_to_run_code=True)
        scheme.init_on_receiver(model=torch.nn.Linear(2, 2))
        try:
            scheme.connect()
            print("joined as worker 0", flush=True)
        except ws.WeightSyncError as exc:
            print(f"not joined: {type(exc).__name__}: {exc}", flush=True)
        finally:
            scheme.shutdown()
    elif mode == "rejoin":
        s = dist.PrefixStore(args[2], store(args[0], int(args[1])))
        gen = int(s.add("gen/0", 1))
        hello = {"ok": True, "process": {"pid": os.getpid(), "host": "stranger"}, "proof": secrets.token_hex(32)}
        s.set(f"rejoin/0/{gen}", json.dumps(hello))
        s.add("rejoins", 1)
        s.wait([f"verdict/0/{gen}"], timedelta(seconds=30))
        print(f"verdict: {s.get(f'verdict/0/{gen}').decode()}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
