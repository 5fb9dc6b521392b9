"""What authenticating the ``distributed`` scheme's updates costs: the keyed digest (MAC) of every update.

    python benchmarks/bench_auth.py                          # 1, 100 and 1000 MB; writes nothing
    python benchmarks/bench_auth.py --mb 1 100 --markdown    # and writes docs/benchmarks.md, "Authentication cost"

Two parts, in one run:

1. MACs over 100 MB, each keyed with a 32-byte key: HMAC-SHA256, HMAC-SHA512, keyed BLAKE2b and BLAKE2s from
   hashlib, Poly1305 and AES-GMAC from cryptography (XXH3, not a MAC, for reference), on one thread.
2. ``send()`` of the scheme (one worker process, gloo on loopback, ``sync=True``: until the worker checked the
   MAC, applied and acked) with the MAC the engine computes (under a one-time key, bucket by bucket, while
   buckets are on the wire: AES-GMAC or Poly1305, whichever ``auth.fastest_mac`` finds cheaper here), against
   the same scheme with the MAC replaced by a constant on both sides
   (what a send would cost without it): both connected at once, their sends alternating, medians.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import xxhash
from cryptography.hazmat.primitives.poly1305 import Poly1305
from torch import nn

import weightsync as ws
from weightsync.transports.distributed import auth

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import replace_section  # noqa: E402
from bench_local import serve_until, served  # noqa: E402

KEY = os.urandom(32)
MACS = {
    "HMAC-SHA256": lambda: hmac.new(KEY, digestmod=hashlib.sha256),
    "HMAC-SHA512": lambda: hmac.new(KEY, digestmod=hashlib.sha512),
    "BLAKE2b (keyed)": lambda: hashlib.blake2b(key=KEY),
    "BLAKE2s (keyed)": lambda: hashlib.blake2s(key=KEY),
    "Poly1305 (cryptography)": lambda: Poly1305(KEY),
    "AES-GMAC (cryptography)": lambda: auth._Gmac(KEY),  # (built as the engine builds it)
    "XXH3-64 (not a MAC)": lambda: xxhash.xxh3_64(),
}


class _NoMac:
    """Stands for :class:`~weightsync.transports.distributed.auth.PayloadMac` where the MAC is left out."""

    def begin(self) -> None:
        return None

    def ready(self, upto: int) -> None:
        return None

    def hexdigest(self) -> str:
        return "0" * 64


def _without_mac(sealer: auth.Sealer) -> None:
    """This engine's updates go without their MAC (a constant stands for it)."""
    sealer.payload_mac = lambda *args: _NoMac()  # type: ignore[method-assign]


def make_model(mb: float) -> nn.Module:
    """About ``mb`` MB of float32, in tensors of at most 64 MB."""
    left, params = int(mb * 1e6) // 4, []
    while left > 0:
        n = min(left, 16 * 2**20)
        params.append(nn.Parameter(torch.randn(n)))
        left -= n
    return nn.ParameterList(params)


def worker(scheme: ws.WeightSyncScheme, mb: float, mac: bool, stop) -> None:
    torch.set_num_threads(1)
    scheme.init_on_receiver(model_id="policy" if mac else "plain", model=make_model(mb), worker_idx=0)
    if not mac:
        _without_mac(scheme._runtime.receiving.engine.sealer)
    scheme.connect()
    serve_until(scheme, stop)


@contextlib.contextmanager
def connected(model: nn.Module, mb: float, mac: bool, bucket_mb: float | None) -> Iterator[ws.WeightSyncScheme]:
    ctx = mp.get_context("forkserver")
    scheme = ws.DistributedWeightSyncScheme(timeout=120, connect_timeout=120, bucket_mb=bucket_mb)
    scheme.init_on_sender(model_id="policy" if mac else "plain", model=model, num_workers=1)
    if not mac:
        _without_mac(scheme._runtime.sending.engine.sealer)
    stop = ctx.Event()
    with served(scheme, [ctx.Process(target=worker, args=(scheme, mb, mac, stop))], stop):
        yield scheme


def timed_send(scheme: ws.WeightSyncScheme, model: nn.Module) -> float:
    with torch.no_grad():
        model[-1].add_(1.0)
    start = time.perf_counter()
    scheme.send()
    return time.perf_counter() - start


def mac_rates(mb: float, rounds: int) -> list[tuple[str, float]]:
    """(name, ms on one thread) for ``mb`` MB."""
    view = memoryview(torch.randint(0, 255, (int(mb * 1e6),), dtype=torch.uint8).numpy())
    return [(name, _median_ms(lambda make=make: make().update(view), rounds)) for name, make in MACS.items()]


def _median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _bucket(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[1, 100, 1000])
    parser.add_argument("--rounds", type=int, nargs="+", default=[20, 10, 4], help="per size, in order")
    parser.add_argument("--bucket-mb", type=_bucket, nargs="+", default=[None, 16.0], help="none: one message")
    parser.add_argument("--markdown", action="store_true", help='write docs/benchmarks.md, "Authentication cost"')
    args = parser.parse_args()
    rates = mac_rates(100, 5)
    sends = []
    for mb, rounds in zip(args.mb, args.rounds + [args.rounds[-1]] * len(args.mb)):
        model = make_model(mb)
        for bucket_mb in args.bucket_mb:
            if bucket_mb is not None and bucket_mb >= mb:
                continue  # one bucket: the row above
            times: dict[bool, list[float]] = {False: [], True: []}
            with connected(model, mb, False, bucket_mb) as plain, connected(model, mb, True, bucket_mb) as authed:
                for step in range(rounds + 1):  # alternating, under the same load; the first touches the pages
                    for mac, scheme in ((False, plain), (True, authed)):
                        took = timed_send(scheme, model)
                        if step:
                            times[mac].append(took)
            sends.append((mb, bucket_mb, rounds, statistics.median(times[False]), statistics.median(times[True])))
        del model
    machine = f"{platform.machine()} / {os.cpu_count()} cores, torch {torch.__version__}, one run"
    lines = [
        f"MACs over 100 MB on one thread, median of 5, {machine}.",
        "",
        "| MAC | 100 MB | rate |",
        "|---|---:|---:|",
        *(f"| {name} | {ms:.1f} ms | {100 / ms:.2f} GB/s |" for name, ms in rates),
        "",
        "`send()` of the `distributed` scheme to one worker (gloo on loopback, until acked), with the engine's "
        "MAC (the one `auth.fastest_mac` picks for the model's size here) and with it replaced by a constant on both "
        "sides; medians:",
        "",
        "| model | bucket_mb | rounds | MAC | send without MAC | send with MAC | ratio |",
        "|---:|---:|---:|---|---:|---:|---:|",
        *(
            f"| {mb:g} MB | {'one message' if bucket is None else f'{bucket:g}'} | {rounds} | "
            f"{auth.fastest_mac(int(mb * 1e6))} | {1e3 * off:.1f} ms | {1e3 * on:.1f} ms | {on / off:.2f}x |"
            for mb, bucket, rounds, off, on in sends
        ),
    ]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        replace_section(Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md", "auth-cost", text)


if __name__ == "__main__":
    main()
