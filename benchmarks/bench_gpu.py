"""The GPU rows of the benchmarks: trainer and workers on one GPU, every local scheme and ``distributed``.

    python benchmarks/bench_gpu.py --check          # the GPU check: the CUDA tests, then the target rows, one
                                                    # table with pass/fail per row (under 5 minutes on an H100)
    python benchmarks/bench_gpu.py                  # the full table (needs CUDA; about 5 minutes on an H100)
    python benchmarks/bench_gpu.py --write          # ... and rewrites the GPU section of docs/benchmarks.md
                                                    #     and docs/benchmarks_gpu.png (tracked files)
    python benchmarks/bench_gpu.py --mb 100 --rounds 5   # a quick look

``--check`` needs no install: from the repository root, ``PYTHONPATH=$PWD`` (and torch, tensordict, pytest on
the path) is enough. It exits 0 when every row passed, 1 otherwise.

Not part of CI (no GPU there). Sends are ``sync=True`` and timed until every worker applied and acked;
the floors are measured in the same run: one device ``copy_`` of the bytes, a pinned device-to-host copy
(and back), and a hand-written CUDA IPC round trip (the trainer copies into a device buffer it shared
once with each worker, signals over a pipe; each worker copies into its model, synchronizes and acks).
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import statistics
import subprocess
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
    """One device ``copy_``, one pinned device-to-host copy, one pinned device-to-host-to-device trip, and one
    host copy (what a CPU worker adds: it copies the slot into its model)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    model = torch.empty(nbytes, dtype=torch.uint8)
    d2d, d2h, trip, h2h = [], [], [], []
    for _ in range(rounds + 2):
        d2d.append(cuda_timed(lambda: dst.copy_(src)))
        d2h.append(cuda_timed(lambda: host.copy_(src, non_blocking=True)))
        trip.append(cuda_timed(lambda: (host.copy_(src, non_blocking=True), dst.copy_(host, non_blocking=True))))
        h2h.append(cuda_timed(lambda: model.copy_(host)))
    return {k: median_ms(v[2:]) for k, v in (("d2d", d2d), ("d2h", d2h), ("trip", trip), ("h2h", h2h))}


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
    name: str,
    mb: float,
    workers: int,
    rounds: int,
    tensors: int = 0,
    dtype: str = "float32",
    worker_device: str = DEVICE,
    threads: int = 1,
) -> float:
    """Median ms of ``rounds`` sync sends (after 2 more), ``workers`` worker processes of ``threads`` torch threads."""
    torch.manual_seed(0)
    model = bench_local.make_model(mb, tensors, DEVICE, dtype)
    options = {"backend": "gloo"} if name == "distributed" else {}
    with bench_local.connected(
        name, model, workers, mb, tensors, worker_device, dtype, threads=threads, **options
    ) as scheme:
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
    rows.append(cpu_worker_row(mb, rounds, floor))
    took = sends("multiprocess", 0.4, 1, max(rounds, 50))
    rows.append(("multiprocess, 0.4 MB round trip", took, "-", None, "<= 0.3 ms", took <= 0.3))
    for n in WORKERS:
        rows.append(
            (f"floor: hand-written CUDA IPC, {n} worker(s)", lines["hand-written CUDA IPC"][n], "-", None, "-", None)
        )
    return rows, lines


def cpu_worker_row(mb: float, rounds: int, floor: dict[str, float]) -> tuple:
    """A CUDA trainer and a CPU worker: the trainer's pinned device-to-host copy, then the worker's host copy.

    The worker copies on as many torch threads as the floor's host copy ran on (this process's): with one
    thread (what the CPU rows give each worker, several on 2 cores), the copy of 1 GB ran at one core's
    bandwidth, about 176 of the 196 ms a send took on an H100 machine, against 33 ms on its 16 threads."""
    took = sends("multiprocess", mb, 1, rounds, worker_device="cpu", threads=torch.get_num_threads())
    both = floor["d2h"] + floor["h2h"]
    text = f"{both:.2f} ms (pinned D2H + host copy)"
    return ("CUDA trainer -> CPU worker (multiprocess)", took, text, took / both, "<= 1.3x", took / both <= 1.3)


# --------------------------------------------------------------------------------------------- check
#: The targets of the GPU check: 1 GB float32, trainer and workers on one GPU, a sync send until acked.
TARGETS = {("shared_mem", 1): 1.5, ("shared_mem", 2): 2.0, ("multiprocess", 1): 2.5, ("multiprocess", 2): 3.5}
#: The tests the check runs: the CUDA ones, and the GPU path's logic (which runs anywhere).
CHECK_TESTS = ["tests/test_cuda.py", "tests/test_device_slots.py", "tests/test_gpu_logic.py"]
#: The most the tests may take within the check.
TESTS_TIMEOUT_S = 240


def run_tests(timeout_s: float = TESTS_TIMEOUT_S) -> tuple:
    """The CUDA tests in a pytest of their own (from the repository root), for at most ``timeout_s``: a row of the
    check's table."""
    if importlib.util.find_spec("pytest") is None:
        return ("tests: " + " ".join(CHECK_TESTS), None, "pytest is not installed", None, "all pass", False)
    argv = [sys.executable, "-m", "pytest", "-q", *CHECK_TESTS]
    if importlib.util.find_spec("xdist") is None:  # the project's addopts ask for two pytest-xdist processes
        argv += ["-o", "addopts=-ra"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    began = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        print(out[-4000:])
        late = f"timed out after {timeout_s:g} s"
        return ("tests: " + " ".join(CHECK_TESTS), None, late, None, "all pass", False)
    took_ms = (time.perf_counter() - began) * 1e3
    lines = done.stdout.strip().splitlines()
    print("\n".join(lines[-60:]))  # failures, skips (with -ra), the summary
    summary = lines[-1] if lines else done.stderr.strip()[-200:]
    return ("tests: " + " ".join(CHECK_TESTS), took_ms, summary.strip("= "), None, "all pass", done.returncode == 0)


def check(mb: float, rounds: int, tests_timeout_s: float = TESTS_TIMEOUT_S) -> list[tuple]:
    """The GPU check's rows: the tests, then the target sends with their floors, pass or fail each."""
    rows = [run_tests(tests_timeout_s)]
    nbytes = int(mb * 1e6)
    # The schemes' rows first, then the floors they are read against (the order of the table stays).
    sent: list[tuple[str, int, float | None, str]] = []
    for name in ("shared_mem", "multiprocess"):
        for n in (1, 2):
            try:
                sent.append((name, n, sends(name, mb, n, rounds), ""))
            except Exception as exc:  # noqa: BLE001 - a failed row is reported in the table, and the check goes on
                sent.append((name, n, None, f"failed: {exc!r:.120}"))
    floor = copy_floor(nbytes, rounds)
    d2d = f"{floor['d2d']:.2f} ms (one device copy_)"
    rows.append(("floor: one device copy_", floor["d2d"], "-", None, "-", None))
    rows.append(("floor: pinned D2H + H2D", floor["trip"], "-", None, "-", None))
    for n in (1, 2):
        ipc = ipc_floor(nbytes, n, rounds)
        rows.append((f"floor: hand-written CUDA IPC, {n} worker(s)", ipc, "-", None, "-", None))
    for name, n, took, failed in sent:
        case = f"{name}, {mb:g} MB fp32, {n} worker(s)"
        if took is None:
            rows.append((case, None, failed, None, "-", False))
            continue
        target = TARGETS[(name, n)]
        rows.append((case, took, d2d, took / floor["d2d"], f"<= {target} ms", took <= target))
    try:
        rows.append(cpu_worker_row(mb, rounds, floor))
    except Exception as exc:  # noqa: BLE001 - as above
        rows.append(("CUDA trainer -> CPU worker (multiprocess)", None, f"failed: {exc!r:.120}", None, "-", False))
    return rows


def table(rows: list[tuple], mb: float, rounds: int, seconds: float) -> str:
    props = torch.cuda.get_device_properties(0)
    head = (
        f"`python benchmarks/bench_gpu.py --write` on {props.name} ({props.total_memory / 2**30:.0f} GiB), torch "
        f"{torch.__version__}, CUDA {torch.version.cuda}, trainer and workers on {DEVICE}, median of {rounds} "
        f"rounds, {seconds:.0f} s in all."
    )
    out = [head, "", "| case | measured | floor | ratio | target | met |", "|---|---:|---:|---:|---:|:---:|"]
    for case, took, floor, ratio, target, met in rows:
        took_text = "-" if took is None else f"{took:.2f} ms"
        ratio_text = "-" if ratio is None else f"{ratio:.2f}x"
        met_text = "-" if met is None else ("yes" if met else "**no**")
        out.append(f"| {case} | {took_text} | {floor} | {ratio_text} | {target} | {met_text} |")
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
    parser.add_argument("--check", action="store_true", help="the GPU check: CUDA tests and target rows, pass/fail")
    parser.add_argument(
        "--tests-timeout", type=float, default=TESTS_TIMEOUT_S, help="seconds the check's tests may take at most"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs CUDA: run it on a machine with a GPU")
    bench_local.passive_openmp()
    began = time.perf_counter()
    if args.check:
        rows = check(args.mb, args.rounds, args.tests_timeout)
        text = table(rows, args.mb, args.rounds, time.perf_counter() - began)
        print(text.replace("--write", "--check"))
        failed = [row[0] for row in rows if row[5] is False]
        print("GPU check: " + ("PASSED" if not failed else f"FAILED: {failed}"))
        sys.exit(1 if failed else 0)
    rows, lines = run(args.mb, args.rounds)
    text = table(rows, args.mb, args.rounds, time.perf_counter() - began)
    print(text)
    if args.write:
        plot(lines, PLOT)
        replace_section(DOC, "gpu", text + f"\n\n![GPU sends]({PLOT.name})")


if __name__ == "__main__":
    main()
