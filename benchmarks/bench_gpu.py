"""The GPU rows of the benchmarks: trainer and workers on one GPU, every local scheme and ``distributed``.

    python benchmarks/bench_gpu.py                  # prints the table (needs CUDA; about 5 minutes on an H100)
    python benchmarks/bench_gpu.py --write          # ... and rewrites the GPU section of docs/benchmarks.md
                                                    #     and docs/benchmarks_gpu.png (tracked files)
    python benchmarks/bench_gpu.py --mb 100 --rounds 5   # a quick look

Not part of CI (no GPU there). Sends are ``sync=True`` and timed until every worker applied and acked;
the floors are measured in the same run: one device ``copy_`` of the bytes, a pinned device-to-host copy
(and back), and a hand-written CUDA IPC round trip (the trainer copies into a device buffer it shared
once with each worker, signals over a pipe; each worker copies into its model, synchronizes and acks).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_local  # noqa: E402
from _doc import replace_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "benchmarks_gpu.png"
DEVICE = "cuda:0"
WORKERS = (1, 2, 4)


def median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def cuda_timed(fn: Callable[[], None]) -> float:
    """Seconds ``fn`` takes, the GPU work it queues included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


# -------------------------------------------------------------------------------------------- floors
def copy_floor(nbytes: int, rounds: int) -> dict[str, float]:
    """One device ``copy_``, one pinned device-to-host copy, and one pinned device-to-host-to-device trip."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2d, d2h, trip = [], [], []
    for _ in range(rounds + 2):
        d2d.append(cuda_timed(lambda: dst.copy_(src)))
        d2h.append(cuda_timed(lambda: host.copy_(src, non_blocking=True)))
        trip.append(cuda_timed(lambda: (host.copy_(src, non_blocking=True), dst.copy_(host, non_blocking=True))))
    return {"d2d": median_ms(d2d[2:]), "d2h": median_ms(d2h[2:]), "trip": median_ms(trip[2:])}


def _ipc_worker(shared: torch.Tensor, conn: Any) -> None:
    model = torch.empty_like(shared)
    while True:
        if conn.recv() is None:
            return
        model.copy_(shared)
        torch.cuda.current_stream().synchronize()
        conn.send(True)


def ipc_floor(nbytes: int, workers: int, rounds: int) -> float:
    """The hand-written CUDA IPC round trip: one copy into a shared device buffer, a pipe, a copy per worker, acks."""
    ctx = mp.get_context("spawn")
    shared = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    weights = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=DEVICE)
    pipes = [ctx.Pipe() for _ in range(workers)]
    procs = [ctx.Process(target=_ipc_worker, args=(shared, child)) for _, child in pipes]
    for proc in procs:
        proc.start()
    times = []
    try:
        for _ in range(rounds + 2):
            start = time.perf_counter()
            shared.copy_(weights)
            torch.cuda.current_stream().synchronize()
            for parent, _ in pipes:
                parent.send(True)
            for parent, _ in pipes:
                parent.recv()
            times.append(time.perf_counter() - start)
    finally:
        for parent, _ in pipes:
            parent.send(None)
        for proc in procs:
            proc.join(30)
    return median_ms(times[2:])


# --------------------------------------------------------------------------------------------- sends
def sends(
    name: str, mb: float, workers: int, rounds: int, tensors: int = 0, dtype: str = "float32", worker_device=DEVICE
) -> float:
    torch.manual_seed(0)
    model = bench_local.make_model(mb, tensors, DEVICE, dtype)
    options = {"backend": "gloo"} if name == "distributed" else {}
    with bench_local.connected(name, model, workers, mb, tensors, worker_device, dtype, **options) as scheme:
        times = [bench_local.timed_send(scheme, model) for _ in range(rounds + 2)]
    return median_ms(times[2:])


def tensors_ratio(name: str, mb: float, rounds: int) -> tuple[float, float]:
    """2000 tensors against a few, two workers, the two schemes alternating in the same rounds."""
    torch.manual_seed(0)
    many = bench_local.make_model(mb, 2000, DEVICE)
    few = bench_local.make_model(mb, 0, DEVICE)
    with (
        bench_local.connected(name, many, 2, mb, 2000, DEVICE) as first,
        bench_local.connected(name, few, 2, mb, 0, DEVICE) as second,
    ):
        pairs = [(bench_local.timed_send(first, many), bench_local.timed_send(second, few)) for _ in range(rounds + 2)]
    return median_ms([a for a, _ in pairs[2:]]), median_ms([b for _, b in pairs[2:]])


# ---------------------------------------------------------------------------------------------- main
def run(mb: float, rounds: int) -> tuple[list[tuple], dict[str, dict[int, float]]]:
    nbytes = int(mb * 1e6)
    floor = copy_floor(nbytes, rounds)
    rows: list[tuple] = []  # (case, measured ms, floor text, ratio or None, target text, met or None)
    lines: dict[str, dict[int, float]] = {"hand-written CUDA IPC": {}, "shared_mem": {}, "multiprocess": {}}
    d2d = f"{floor['d2d']:.2f} ms (one device copy_)"
    for n in WORKERS:
        lines["hand-written CUDA IPC"][n] = ipc_floor(nbytes, n, rounds)
    targets = {("shared_mem", 1): 1.5, ("shared_mem", 2): 2.0, ("multiprocess", 1): 2.5, ("multiprocess", 2): 3.5}
    for name in ("shared_mem", "multiprocess"):
        for n in WORKERS:
            took = lines[name][n] = sends(name, mb, n, rounds)
            target = targets.get((name, n))
            met = None if target is None else took <= target
            rows.append(
                (
                    f"{name}, {mb:g} MB fp32, {n} worker(s)",
                    took,
                    d2d,
                    took / floor["d2d"],
                    target and f"<= {target} ms",
                    met,
                )
            )
    for name in ("shared_mem", "multiprocess"):
        many, few = tensors_ratio(name, mb, rounds)
        rows.append(
            (
                f"{name}: 2000 tensors vs few, 2 workers",
                many,
                f"{few:.2f} ms (few tensors)",
                many / few,
                "<= 1.2x",
                many / few <= 1.2,
            )
        )
        took = sends(name, mb, 2, rounds, dtype="bfloat16")
        rows.append((f"{name}, {mb:g} MB bf16, 2 workers", took, d2d, took / floor["d2d"], "-", None))
    took = sends("distributed", mb, 2, rounds)
    trip = f"{floor['trip']:.2f} ms (pinned D2H + H2D)"
    rows.append((f"distributed (gloo), {mb:g} MB fp32, 2 workers", took, trip, took / floor["trip"], "-", None))
    took = sends("multiprocess", mb, 1, rounds, worker_device="cpu")
    d2h = f"{floor['d2h']:.2f} ms (pinned D2H)"
    rows.append(
        (
            "CUDA trainer -> CPU worker (multiprocess)",
            took,
            d2h,
            took / floor["d2h"],
            "<= 1.3x",
            took / floor["d2h"] <= 1.3,
        )
    )
    took = sends("multiprocess", 0.4, 1, max(rounds, 50))
    rows.append(("multiprocess, 0.4 MB round trip", took, "-", None, "<= 0.3 ms", took <= 0.3))
    for n in WORKERS:
        rows.append(
            (f"floor: hand-written CUDA IPC, {n} worker(s)", lines["hand-written CUDA IPC"][n], "-", None, "-", None)
        )
    return rows, lines


def table(rows: list[tuple], mb: float, rounds: int, seconds: float) -> str:
    props = torch.cuda.get_device_properties(0)
    head = (
        f"`python benchmarks/bench_gpu.py --write` on {props.name} ({props.total_memory / 2**30:.0f} GiB), torch "
        f"{torch.__version__}, CUDA {torch.version.cuda}, trainer and workers on {DEVICE}, median of {rounds} "
        f"rounds, {seconds:.0f} s in all."
    )
    out = [head, "", "| case | measured | floor | ratio | target | met |", "|---|---:|---:|---:|---:|:---:|"]
    for case, took, floor, ratio, target, met in rows:
        ratio_text = "-" if ratio is None else f"{ratio:.2f}x"
        met_text = "-" if met is None else ("yes" if met else "**no**")
        out.append(f"| {case} | {took:.2f} ms | {floor} | {ratio_text} | {target} | {met_text} |")
    return "\n".join(out)


def plot(lines: dict[str, dict[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in lines.items():
        ax.plot(list(points), list(points.values()), marker="o", label=label)
    ax.set_xticks(list(WORKERS), [str(n) for n in WORKERS])
    ax.set_xlabel("workers on the trainer's GPU")
    ax.set_ylabel("sync send until acked (ms)")
    ax.set_title("1 GB float32 model, one GPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=1000.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--write", action="store_true", help="rewrite the GPU section of docs/benchmarks.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs CUDA: run it on a machine with a GPU")
    bench_local.passive_openmp()
    began = time.perf_counter()
    rows, lines = run(args.mb, args.rounds)
    text = table(rows, args.mb, args.rounds, time.perf_counter() - began)
    print(text)
    if args.write:
        plot(lines, PLOT)
        replace_section(DOC, "gpu", text + f"\n\n![GPU sends]({PLOT.name})")


if __name__ == "__main__":
    main()
