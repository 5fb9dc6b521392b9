"""Median ``send()`` time of each local scheme against one ``copy_`` of the same bytes, in one run.

    python benchmarks/bench_local.py                   # 100 MB float32 model, 2 workers
    python benchmarks/bench_local.py --mb 10 --workers 4 --rounds 20 --markdown local.md

``benchmarks/suite.py`` runs every target case (this one included) in one command.

A send is timed from the call until every worker has applied the update and
acked (``sync=True``). Workers wait in ``receive()`` and do nothing else, so
the figure is the cost of moving the weights, not of a busy worker.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import weightsync as ws

SCHEMES = ["no_sync", "shared_mem", "multiprocess"]


def make_model(mb: float, tensors: int = 0, device: str = "cpu", dtype: str = "float32") -> nn.Module:
    """About ``mb`` megabytes of ``dtype``: an MLP of square layers, or ``tensors`` equal tensors when given, on
    ``device``.

    The MLP is 2048 wide (4.2 MB a layer in float32) from 4 MB up, narrower below, so small models stay MLPs too.
    """
    kind = getattr(torch, dtype)
    size = torch.empty((), dtype=kind).element_size()
    if tensors:
        numel = max(1, round(mb * 1e6 / size / tensors))
        model: nn.Module = nn.ParameterList([nn.Parameter(torch.randn(numel)) for _ in range(tensors)])
    else:
        width = 2048 if mb >= 4 else max(8, round((mb * 1e6 / size / 3) ** 0.5))
        layers = max(1, round(mb * 1e6 / size / (width * width + width)))
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    return model.to(device=device, dtype=kind)


def processes() -> mp.context.BaseContext:
    """How the benchmarks start processes: forked from a server that imported torch, tensordict, weightsync and
    these modules once. Spawning imports them in every process, 4.6 s of CPU apiece on this VM: a 2-worker run
    spent more time starting than measuring. Each process is still fresh (the server runs no torch op), and the
    server, like a spawned process, loads OpenMP with the environment of its first use in the process that
    starts it (:func:`passive_openmp` before)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensordict", "weightsync", "bench_local", "bench_engines"])
    return ctx


def passive_openmp() -> str:
    """Make processes started from now on let idle OpenMP threads sleep (OpenMP reads the policy when it loads: in
    a spawned process, or in the server that :func:`processes` forks them from).

    With the default policy the trainer's OpenMP threads spin for a while after each parallel copy, on
    the cores its workers need: on 2 cores that delays the workers' wake-up by milliseconds (see
    docs/benchmarks.md, "Where the time goes"). An ``OMP_WAIT_POLICY`` already set is kept; returns the policy.
    """
    return os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def held_memory() -> int:
    """Bytes of this process's resident anonymous and shared memory (Linux ``RssAnon + RssShmem``).

    That is the slots and the sender's own objects. Resident file pages (``RssFile``) are left out:
    they are the code of the libraries a module imports the first time it is used (1.6 MB when
    ``connect`` first runs), shared with every process that maps them, not memory the sync holds.
    """
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024  # kB
    return sum(fields.values())


def worker(
    scheme: ws.WeightSyncScheme,
    idx: int,
    mb: float,
    stop,
    tensors: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int = 1,
) -> None:
    torch.set_num_threads(threads)
    model = make_model(mb, tensors, device, dtype)
    scheme.init_on_receiver(model_id="policy", model=model, worker_idx=idx)
    scheme.connect()
    serve_until(scheme, stop)


def serve_until(scheme: ws.WeightSyncScheme, stop: Any) -> None:
    """A benchmark worker's loop: apply updates until ``stop`` is set or the trainer is done, then shut down."""
    while not stop.is_set():  # no_sync has no channel to say the trainer is done
        try:
            scheme.receive(timeout=0.5)
        except ws.ConnectionClosedError:
            break
    scheme.shutdown()


@contextlib.contextmanager
def connected(
    name: str,
    model: nn.Module,
    workers: int,
    mb: float,
    tensors: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int = 1,
    **options: Any,
) -> Iterator[ws.WeightSyncScheme]:
    """A sender scheme for ``model`` (``options``: the scheme's own), connected to ``workers`` worker processes
    (:func:`processes`) whose models are on ``device``, each with ``threads`` torch threads (1: the CPU rows run
    several workers on 2 cores); shut down on exit."""
    ctx = processes()
    scheme = ws.WeightSyncScheme.from_backend(name, timeout=120, **options)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=workers)
    stop = ctx.Event()
    args = [(scheme, i, mb, stop, tensors, device, dtype, threads) for i in range(workers)]
    with served(scheme, [ctx.Process(target=worker, args=a) for a in args], stop):
        yield scheme


@contextlib.contextmanager
def served(scheme: ws.WeightSyncScheme, procs: list[Any], stop: Any) -> Iterator[ws.WeightSyncScheme]:
    """``scheme`` connected to the worker processes ``procs`` (started here); on exit the scheme shuts down,
    ``stop`` is set and every worker is joined (killed after 60 s)."""
    for proc in procs:
        proc.start()
    try:
        scheme.connect()
        yield scheme
    finally:
        scheme.shutdown()
        stop.set()
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()


def time_scheme(
    name: str,
    model: nn.Module,
    workers: int,
    rounds: int,
    mb: float,
    tensors: int = 0,
    memory: dict | None = None,
    checksum: bool = False,
) -> tuple[list[float], list[float]]:
    """Per round: one ``copy_`` of the model's bytes, then one ``send()``; both lists of seconds.

    Interleaving the floor with the sends makes their ratio robust to the
    machine's load changing during the run. ``memory``, when given, receives
    ``extra_bytes``: the sender's peak resident memory over its level before
    ``init_on_sender`` (the model and the floor's buffers already counted there), as
    :func:`held_memory` counts it.
    ``checksum``: the floor is a send without checksum and the measured send one with it: two schemes of the
    same model, each with its workers, their sends alternating in the same rounds.
    """
    if checksum:
        return time_pair(
            name, (model, model), (workers, workers), rounds, mb, (tensors, tensors), ({}, {"checksum": True})
        )
    numel = sum(p.numel() for p in model.parameters())
    src, dst = torch.randn(numel), torch.randn(numel)
    base = peak = held_memory()
    with connected(name, model, workers, mb, tensors) as scheme:
        copies, sends = [], []
        for step in range(rounds + 2):
            start = time.perf_counter()
            dst.copy_(src)
            copy_s = time.perf_counter() - start
            send_s = timed_send(scheme, model)
            peak = max(peak, held_memory())
            if step >= 2:  # the first sends also map the slots in the workers
                copies.append(copy_s)
                sends.append(send_s)
        if memory is not None:
            memory["extra_bytes"] = peak - base
        return copies, sends


def time_pair(
    name: str,
    models: tuple[nn.Module, nn.Module],
    workers: tuple[int, int],
    rounds: int,
    mb: float,
    tensors: tuple[int, int] = (0, 0),
    each: tuple[dict, dict] = ({}, {}),
    **options: Any,
) -> tuple[list[float], list[float]]:
    """Sends of ``models[i]`` to ``workers[i]`` workers (two schemes with ``options``, and ``each[i]`` for the
    ``i``-th; worker models of ``tensors[i]`` tensors), alternating each round so both see the same load; the two
    lists of seconds."""
    with (
        connected(name, models[0], workers[0], mb, tensors[0], **options, **each[0]) as first,
        connected(name, models[1], workers[1], mb, tensors[1], **options, **each[1]) as second,
    ):
        times: tuple[list[float], list[float]] = ([], [])
        for step in range(rounds + 2):
            pair = (timed_send(first, models[0]), timed_send(second, models[1]))
            if step >= 2:  # the first sends also map the slots in the workers
                for out, took in zip(times, pair):
                    out.append(took)
        return times


def timed_send(scheme: ws.WeightSyncScheme, model: nn.Module) -> float:
    """Seconds one ``send()`` takes, after an optimizer-like change so every version differs (on a GPU, that change
    is done before the clock starts: the send is timed, not the kernel queued ahead of it)."""
    last = list(model.parameters())[-1]
    with torch.no_grad():
        last.add_(1.0)
    if last.is_cuda:
        torch.cuda.synchronize(last.device)
    start = time.perf_counter()
    scheme.send()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--schemes", nargs="+", default=SCHEMES, choices=SCHEMES)
    parser.add_argument("--markdown", help="also write the table to this Markdown file")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = make_model(args.mb)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for name in args.schemes:
        copies, sends = time_scheme(name, model, args.workers, args.rounds, args.mb)
        copy_ms, send_ms = statistics.median(copies) * 1e3, statistics.median(sends) * 1e3
        rows.append((name, send_ms, copy_ms, send_ms / copy_ms))
    header = (
        f"{nbytes / 1e6:.1f} MB float32 model ({len(list(model.parameters()))} tensors), "
        f"{args.workers} workers, median of {args.rounds} sends, {platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')} (set it before Python starts)"
    )
    lines = [
        header,
        "",
        "| scheme | median send (ms) | median copy_ of the same bytes (ms) | send / copy_ |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {send:.2f} | {copy:.2f} | {ratio:.2f} |" for name, send, copy, ratio in rows]
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as out:
            command = " ".join(["python", *sys.argv])
            out.write(f"`{command}`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
