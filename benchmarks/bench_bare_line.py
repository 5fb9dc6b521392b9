"""The bare steps of a small ``distributed`` sync on its lines, against gloo's raw round trip, in one run.

    unshare -n sh -c 'ip link set lo up && python benchmarks/bench_bare_line.py --mb 1 --workers 2 --rounds 200'

What weightsync's send does per update of a small model, and nothing else: the trainer copies the model into a
staging buffer, derives the one-time key and hashes the copy (weightsync's own :class:`PayloadMac`, the MAC
:func:`fastest_mac` picks), seals the announcement with the run key (:class:`Sealer`), writes it and the bytes
on each worker's TCP connection, and reads each worker's tagged ack; a worker waits on its socket, opens the
announcement, reads the bytes into its staging buffer while hashing them, checks the digest, copies them into its
model and sends its tagged ack. No scheme, no core, no bookkeeping: the bound that a leaner implementation of the
same wire and the same checks could reach on this host (the issue 35 target is 2x the raw round trip). The raw
round trip and the pauses are those of ``bench_engines.py --round-trip`` (one gloo broadcast and a small send back
from each worker, 20 to 60 ms of idle before each round), alternated with the bare sync per round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import platform
import random
import secrets
import select
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engines import WORKER_IDLE_S  # noqa: E402
from bench_local import make_model, passive_openmp, processes  # noqa: E402

from weightsync.transports.distributed import new_group  # noqa: E402
from weightsync.transports.distributed.auth import Sealer, fastest_mac, new_nonce  # noqa: E402
from weightsync.transports.store import open_store  # noqa: E402

FRAME = struct.Struct(">I")
ACK = struct.Struct(">7q")  # seq, held, status and the 4 words of the ack's tag
PREFIX = "bench/bare"
LAYOUT_TAG = b"\0" * 32
TIMEOUT_S = 30.0


def _read(sock: socket.socket, view: memoryview, arrived=None) -> None:
    """Fill ``view`` from ``sock`` (``arrived(n)`` after each read: the bytes in so far)."""
    at = 0
    while at < len(view):
        if not select.select([sock], [], [], TIMEOUT_S)[0]:
            raise TimeoutError("the peer sent too little in time")
        got = sock.recv_into(view[at:])
        if not got:
            raise ConnectionError("the peer closed its end")
        at += got
        if arrived is not None:
            arrived(at)


def _worker(idx: int, workers: int, mb: float, key: bytes, port: int, line_port: int, cmd) -> None:
    torch.set_num_threads(1)
    model = make_model(mb)
    params = [p.detach().view(-1) for p in model.parameters()]
    n = sum(p.numel() for p in params)
    store = dist.PrefixStore("raw", dist.TCPStore("127.0.0.1", port, is_master=False))
    pg = new_group("gloo", store, idx + 1, workers + 1, 120, "127.0.0.1")
    flat = torch.empty(n)
    sock = socket.create_connection(("127.0.0.1", line_port), timeout=TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(struct.pack(">q", idx))
    sealer = Sealer(key, PREFIX)
    staging = torch.empty(n * 4, dtype=torch.uint8)
    bytes_view = memoryview(staging.numpy()).cast("B")
    typed = list(staging.view(torch.float32).split([p.numel() for p in params]))
    size = bytearray(FRAME.size)
    seq = 0
    while True:
        op = cmd.recv()
        if op == "raw":
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            pg.broadcast([flat], opts).wait()
            pg.send([torch.ones(1)], 0, 0).wait()
        elif op == "send":
            seq += 1
            _read(sock, memoryview(size))
            raw = bytearray(FRAME.unpack(size)[0])
            _read(sock, memoryview(raw))
            said = json.loads(sealer.open(bytes(raw), f"msg/{idx}/{seq}"))
            mac = sealer.payload_mac(LAYOUT_TAG, staging, said["version"], said["nonce"], said["mac"])
            mac.begin()
            _read(sock, bytes_view, mac.ready)
            if not secrets.compare_digest(mac.hexdigest(), said["digest"]):
                raise RuntimeError("the bytes do not match their digest")
            with torch.no_grad():
                torch._foreach_copy_(params, typed)
            words = [seq, said["version"], 0]
            sock.sendall(ACK.pack(*words, *sealer.ack_tag(idx, *words)))
        else:
            sock.close()
            return


def bench(mb: float, workers: int, rounds: int, idle: tuple[float, float]) -> tuple[list[float], list[float]]:
    """Per round: the raw round trip, then the bare sync (seconds each, the first round left out)."""
    model = make_model(mb)
    params = [p.detach().view(-1) for p in model.parameters()]
    n = sum(p.numel() for p in params)
    key = secrets.token_bytes(32)
    sealer, alg = Sealer(key, PREFIX), fastest_mac(n * 4)
    store, (_, port), _ = open_store("127.0.0.1", 0, 120)
    listener = socket.create_server(("127.0.0.1", 0))
    ctx = processes()
    pipes = [ctx.Pipe() for _ in range(workers)]
    line_port = listener.getsockname()[1]
    procs = [
        ctx.Process(target=_worker, args=(i, workers, mb, key, port, line_port, pipes[i][1])) for i in range(workers)
    ]
    try:
        for proc in procs:
            proc.start()
        pg = new_group("gloo", dist.PrefixStore("raw", store), 0, workers + 1, 120, "127.0.0.1")
        listener.settimeout(120)
        lines: dict[int, socket.socket] = {}
        for _ in range(workers):
            sock, _ = listener.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            lines[struct.unpack(">q", sock.recv(8, socket.MSG_WAITALL))[0]] = sock
        flat = torch.randn(n)
        replies = [torch.zeros(1) for _ in range(workers)]
        staging = torch.empty(n * 4, dtype=torch.uint8)
        typed = list(staging.view(torch.float32).split([p.numel() for p in params]))
        ack = bytearray(ACK.size)
        draws = random.Random(0)
        raw, sends = [], []
        for r in range(rounds + 1):
            pause = draws.uniform(*idle)
            for parent, _ in pipes:
                parent.send("raw")
            time.sleep(pause)
            start = time.perf_counter()
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            pg.broadcast([flat], opts).wait()
            for work in [pg.recv([replies[i]], i + 1, 0) for i in range(workers)]:
                work.wait()
            raw.append(time.perf_counter() - start)
            with torch.no_grad():
                for p in params:
                    p.add_(1e-3)
            for parent, _ in pipes:
                parent.send("send")
            time.sleep(pause)
            start = time.perf_counter()
            with torch.no_grad():
                torch._foreach_copy_(typed, params)
            nonce = new_nonce()
            digest = sealer.payload_mac(LAYOUT_TAG, staging, r, nonce, alg).hexdigest()
            body = memoryview(staging.numpy()).cast("B")
            announced = json.dumps({"version": r, "nonce": nonce, "mac": alg, "digest": digest})
            for w, sock in lines.items():
                said = sealer.seal(f"msg/{w}/{r + 1}", announced)
                sock.sendall(FRAME.pack(len(said)) + said)
                sock.sendall(body)
            for w, sock in lines.items():
                _read(sock, memoryview(ack))
                seq, held, status, *tag = ACK.unpack(ack)
                if tag != sealer.ack_tag(w, seq, held, status) or held != r:
                    raise RuntimeError(f"worker {w}'s ack does not check")
            sends.append(time.perf_counter() - start)
    finally:  # the workers stop, whatever failed
        for parent, _ in pipes:
            with contextlib.suppress(OSError):
                parent.send("stop")
        for proc in procs:
            if proc.pid is None:  # (not started)
                continue
            proc.join(60)
            if proc.is_alive():
                proc.kill()
        listener.close()
    return raw[1:], sends[1:]


def _run(mb: float, workers: int, rounds: int, out) -> None:
    try:
        out.send(bench(mb, workers, rounds, WORKER_IDLE_S))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        out.send(f"{type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args(argv)
    policy = passive_openmp()  # for the processes started from now on: the trainer runs in one of them too
    ctx = processes()
    parent, child = ctx.Pipe()
    trainer = ctx.Process(target=_run, args=(args.mb, args.workers, args.rounds, child))
    trainer.start()
    result = parent.recv() if parent.poll(900) else "timed out after 900 s"
    trainer.join(60)
    if isinstance(result, str):
        print(f"failed: {result}")
        return 1
    raw, sends = (statistics.median(x) * 1e3 for x in result)
    nbytes = sum(p.numel() * p.element_size() for p in make_model(args.mb).parameters())
    print(
        f"{nbytes / 1e6:.1f} MB float32, {args.workers} workers, median of {args.rounds} rounds, "
        f"{platform.machine()} / {mp.cpu_count()} cores, torch {torch.__version__}, OMP_WAIT_POLICY={policy}\n\n"
        "| sync | time | raw round trip | ratio |\n|---|---:|---:|---:|\n"
        f"| bare steps on the lines | {sends:.2f} ms | {raw:.2f} ms | {sends / raw:.2f}x |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
