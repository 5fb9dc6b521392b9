"""Another local user attacks a ``distributed`` run, run as uid 65534 by tests/test_strangers_distributed.py.

It holds no key and no config. It finds the trainer's store the way any local user can: the listening ports in
``/proc/net/tcp`` (it is told which one is this test's, and touches no other), and the run's prefix with
``TCPStore.list_keys()``. Each mode prints what it did and what it saw, one line each.

    python -m tests._attack_distributed plant PORT     # forged verdict and initial, then claim rank 0
    python -m tests._attack_distributed squat PORT     # claim rank 0 once the real verdict is out, send 666.0
    python -m tests._attack_distributed layout PORT reordered|deep
    python -m tests._attack_distributed hello PORT     # worker 0's hello, replaced by JSON 200,000 deep
    python -m tests._attack_distributed rejoin PORT    # a request to rejoin as worker 0, 200,000 deep
    python -m tests._attack_distributed counters PORT  # the rejoin counters, overwritten with words
    python -m tests._attack_distributed rollback PORT N  # worker 0's count of connections, set back to N
    python -m tests._attack_distributed line PORT      # the line port: a forged proof, and a flood of silent peers
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import select
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from weightsync.core.timing import deadline_after, wait_until

DEEP = "[" * 200_000 + "]" * 200_000
TAG_DATA, TAG_ACK = 1, 2  # what the engine's transport uses on the wire


def heard_back(sock: socket.socket) -> bytes:
    """The first byte the trainer says on ``sock`` after a refused answer; ``b""`` where it closed the connection
    without a word, whether it had read the answer (an end of file) or not (a reset: the workers' lines came first
    and the rendez-vous ended with the answer still unread)."""
    try:
        return sock.recv(1)
    except ConnectionResetError:
        return b""


def listening_ports() -> set[int]:
    """Every TCP port listening on this host (IPv4 and IPv6), as any user reads it."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def find_run(port: int) -> tuple[dist.Store, dist.Store, str]:
    """The store at ``port`` (found among the listeners), and the run's prefix (found among its keys)."""
    if port not in listening_ports():
        print(f"port {port} is not listening", flush=True)
        sys.exit(2)
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    prefixes: list[str] = []

    def listed() -> bool:  # the store has no event for a new key: its list is polled, bounded
        prefixes.extend(
            m.group(1) for k in base.list_keys() if (m := re.match(r"^(weightsync/[^/]+/[0-9a-f]{16})/layout$", k))
        )
        return bool(prefixes)

    if not wait_until(listed, deadline_after(10), 0.02):
        print("no run found in the store", flush=True)
        sys.exit(2)
    print(f"found the run's prefix {prefixes[0]}", flush=True)
    return base, dist.PrefixStore(prefixes[0], base), prefixes[0]


def wait_key(store: dist.Store, key: str, seconds: float) -> bool:
    return wait_until(lambda: store.check([key]), deadline_after(seconds), 0.01)


def layout_nbytes(store: dist.Store) -> int:
    from weightsync.tensors.layout import FlatLayout

    raw = store.get("layout")
    content = raw.partition(b":")[2] if raw[:1] != b"{" else raw  # a sealed value: mac ":" content
    return FlatLayout.from_plain(json.loads(content)).nbytes


def claim_rank0_and_send(store: dist.Store, seconds: float) -> None:
    """Form the run's group as its rank 0 with worker 0, send it 666.0 in every byte's place, and see what it acks."""
    from weightsync.transports.distributed.group import new_group

    nbytes = layout_nbytes(store)
    try:
        pg = new_group("gloo", store, 0, 2, seconds, "127.0.0.1")
    except Exception as exc:  # noqa: BLE001 - reported: the attack failed here
        print(f"rank 0 not claimed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return
    print("claimed rank 0", flush=True)
    store.set("initial", "0")
    payload = torch.full((nbytes // 4,), 666.0).view(torch.uint8)
    try:
        pg.send([payload], 1, TAG_DATA).wait(timedelta(seconds=seconds))
        print("sent 666.0", flush=True)
    except RuntimeError as exc:
        print(f"could not send 666.0 ({str(exc)[:120]})", flush=True)
    store.set("digest/0/0", "0" * 16)
    ack = torch.zeros(3, dtype=torch.int64)
    try:
        pg.recv([ack], 1, TAG_ACK).wait(timedelta(seconds=seconds))
        print(f"ack {ack.tolist()}", flush=True)
    except RuntimeError as exc:
        print(f"no ack ({str(exc)[:120]})", flush=True)


def line_port(store: dist.Store, flood: int) -> None:
    """Find the sender's line port (its address is sealed in the store, not hidden), hold ``flood`` connections
    that never answer the challenge, and answer it on one more as worker 0 with a proof under a key of its own."""
    content = store.get("line").partition(b":")[2]  # a sealed value: mac ":" content (readable by anyone)
    at = json.loads(content)
    address = (at["host"], int(at["port"]))
    print(f"line port {address[1]} listening: {address[1] in listening_ports()}", flush=True)
    silent = [socket.create_connection(address, timeout=10) for _ in range(flood)]
    liar = socket.create_connection(address, timeout=10)
    print(f"connected {flood + 1}", flush=True)
    try:
        liar.settimeout(30)
        nonce = liar.recv(16)  # the challenge, once the trainer takes lines
        if nonce:
            forged = hmac.new(b"x" * 32, nonce, hashlib.sha256).digest()
            liar.sendall((0).to_bytes(8, "big") + forged)
            said = heard_back(liar)
            print(f"liar: {'closed without a word' if said == b'' else f'heard {said!r}'}", flush=True)
        else:
            print("liar: closed before any challenge", flush=True)
    except OSError as exc:
        print(f"liar: {type(exc).__name__}", flush=True)
    ended, until = 0, time.monotonic() + 30
    for sock in silent:  # each is closed by the trainer, at the latest when its rendez-vous took the lines
        sock.setblocking(False)
        try:
            while select.select([sock], [], [], max(until - time.monotonic(), 0))[0]:
                if not sock.recv(64):
                    ended += 1
                    break
        except OSError:
            ended += 1
        sock.close()
    liar.close()
    print(f"silent: {ended} of {flood} closed", flush=True)


def main(mode: str, port: str, *args: str) -> None:
    base, store, _ = find_run(int(port))
    if mode == "plant":
        if not wait_key(store, "hello/0", 30):
            print("worker 0 never said hello", flush=True)
            return
        store.set("verdict", json.dumps({}))
        store.set("initial", "0")
        print("planted verdict and initial", flush=True)
        claim_rank0_and_send(store, 6)
    elif mode == "squat":
        if not wait_key(store, "verdict", 30):
            print("no verdict came", flush=True)
            return
        claim_rank0_and_send(store, 10)
    elif mode == "layout":
        raw = store.get("layout")
        mac, _, content = raw.partition(b":")
        if args[0] == "reordered":
            plain = json.loads(content)
            entries = plain["entries"]  # 0.weight and 1.weight: the same shape and dtype
            entries[0], entries[2] = entries[2], entries[0]
            store.set("layout", mac + b":" + json.dumps(plain).encode())  # the sender's MAC, kept
        else:
            store.set("layout", DEEP)
        print(f"layout replaced ({args[0]})", flush=True)
    elif mode == "hello":
        if not wait_key(store, "hello/0", 30):
            print("worker 0 never said hello", flush=True)
            return
        store.set("hello/0", DEEP)
        print("hello replaced", flush=True)
    elif mode == "rejoin":
        gen = int(store.add("gen/0", 1))
        store.set(f"rejoin/0/{gen}", DEEP)
        store.add("rejoins", 1)
        answered = wait_key(store, f"verdict/0/{gen}", 20)
        print(f"asked to rejoin as generation {gen}; answered: {answered}", flush=True)
        if answered:
            print(f"verdict: {store.get(f'verdict/0/{gen}').decode(errors='replace')[:300]}", flush=True)
    elif mode == "line":
        line_port(store, int(args[0]) if args else 72)
    elif mode == "rollback":  # the next process of worker 0 counts itself as the (N+1)th, as an earlier one did
        store.set("gen/0", args[0])
        print(f"gen/0 set back to {store.get('gen/0').decode()}", flush=True)
        if len(args) > 1:  # the count the trainer read last: it puts it back
            restored = wait_until(lambda: store.get("gen/0") == args[1].encode(), deadline_after(20), 0.02)
            print(f"gen/0 put back by the trainer: {restored}", flush=True)
    elif mode == "counters":
        store.set("rejoins", "not a number")  # an add to it makes the store's server drop the adding client
        restored = wait_until(lambda: store.get("rejoins").isdigit(), deadline_after(20), 0.02)
        print(f"rejoins overwritten; restored by the trainer: {restored}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
