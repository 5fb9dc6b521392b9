"""Median ``send()`` time of each distributed scheme against its raw engine moving the same bytes, in one run.

    python benchmarks/bench_engines.py                          # 100 MB float32 model, 2 workers, 10 rounds
    python benchmarks/bench_engines.py --engines distributed rpc --mb 10 --markdown out.md

Per round, interleaved so that machine load hits both alike:

- ``distributed``: one gloo broadcast of a flat buffer of the model's bytes from the trainer to
  the workers (a group of its own), then one ``send()`` of DistributedWeightSyncScheme.
- ``rpc``: one RPC carrying a tensor of the model's bytes to each worker (in parallel, the worker
  returns at once), then one ``send()`` of RPCWeightSyncScheme.
- ``ray``: one ``ray.put`` of a tensor of the model's bytes fetched by each actor and copied into
  its model, then one ``send()`` of RayWeightSyncScheme to the same actors.
- ``ray_module_transform``: the same against RayModuleTransformScheme, whose module lives in ONE actor
  (``--workers`` does not apply).

``--round-trip``: the raw ``distributed`` engine also gets a reply from each worker (one small gloo send
back to the trainer), as a send gets its acks: the floor of a small model's sync, where the round trip is
most of it. The rpc and Ray floors are round trips already (the call returns). ``--idle LO HI``: how long the
``distributed`` workers wait before each timed round (:data:`WORKER_IDLE_S` by default, as between a trainer's
steps), the same draws before the raw round and the send.

``bench_<engine>_pair`` alternates the sends of two models instead (2000 tensors against 1), each
scheme with workers of its own (rpc: the same workers, holding both models).

A send is timed until every worker applied and acked. Each engine runs in a
fresh process (torch.distributed.rpc starts once per process).
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_local import make_model, passive_openmp, processes  # noqa: E402

import weightsync as ws  # noqa: E402

ENGINES = ["distributed", "rpc", "ray", "ray_module_transform"]
#: Seconds a distributed worker waits in ``receive()`` before each timed send, and in the raw broadcast before
#: each timed raw round (untimed, drawn per round from this range, the same draws for both), as between a
#: trainer's steps: a worker that learns of a new version late (polling on a back-off) shows it in the send's
#: time, at a phase of its polling that a fixed pause would pin. The rpc and Ray workers wait all along (an rpc
#: worker's loop; a Ray update is a call to the actor).
WORKER_IDLE_S = (0.02, 0.06)


# ---------------------------------------------------------------- distributed
def _dist_worker(scheme, idx, mb, port, cmd, tensors=0) -> None:
    import torch.distributed as dist

    from weightsync.transports.distributed import new_group

    torch.set_num_threads(1)
    model = make_model(mb, tensors)
    scheme.init_on_receiver(model_id="policy", model=model, worker_idx=idx)
    scheme.connect()
    if port is not None:  # the raw engine's own group, for the floor
        store = dist.PrefixStore("raw", dist.TCPStore("127.0.0.1", port, is_master=False))
        n = scheme.num_workers + 1
        pg = new_group("gloo", store, idx + 1, n, 120, "127.0.0.1")
        buf = torch.empty(sum(p.numel() for p in model.parameters()))
    while True:
        op = cmd.recv()
        if op in ("raw", "raw+reply"):
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            pg.broadcast([buf], opts).wait()
            if op == "raw+reply":
                pg.send([torch.ones(1)], 0, 0).wait()
        elif op == "send":
            version = scheme.version
            while scheme.version == version:
                scheme.receive(timeout=30)
        else:
            break
    scheme.shutdown()


def bench_distributed(
    mb: float,
    workers: int,
    rounds: int,
    tensors: int = 0,
    reply: bool = False,
    idle: tuple[float, float] = WORKER_IDLE_S,
    **scheme_kw: Any,
) -> tuple[list[float], list[float]]:
    """``reply``: the raw engine's round trip (the broadcast, then a small send back from each worker); ``idle``:
    the range of the workers' pause before each round (:data:`WORKER_IDLE_S`); ``scheme_kw``: more arguments of
    the scheme (``wire_dtype``, ``bucket_mb``)."""
    import torch.distributed as dist

    from weightsync.transports.distributed import new_group
    from weightsync.transports.store import open_store

    model = make_model(mb, tensors)
    store, (_, port), _ = open_store("127.0.0.1", 0, 120)
    scheme = ws.DistributedWeightSyncScheme(timeout=120, **scheme_kw)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=workers)
    ctx = processes()
    pipes = [ctx.Pipe() for _ in range(workers)]
    procs = [ctx.Process(target=_dist_worker, args=(scheme, i, mb, port, pipes[i][1], tensors)) for i in range(workers)]
    for p in procs:
        p.start()
    scheme.connect()
    pg = new_group("gloo", dist.PrefixStore("raw", store), 0, workers + 1, 120, "127.0.0.1")
    buf = torch.randn(sum(p.numel() for p in model.parameters()))
    replies = [torch.zeros(1) for _ in range(workers)]
    draws = random.Random(0)
    raw, sends = [], []
    for r in range(rounds + 1):
        pause = draws.uniform(*idle)
        for parent, _ in pipes:
            parent.send("raw+reply" if reply else "raw")
        time.sleep(pause)  # the workers wait in the broadcast as long as they wait in receive() below
        start = time.perf_counter()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        pg.broadcast([buf], opts).wait()
        if reply:
            for work in [pg.recv([replies[i]], i + 1, 0) for i in range(workers)]:
                work.wait()
        raw.append(time.perf_counter() - start)
        _perturb(model, r)
        for parent, _ in pipes:
            parent.send("send")
        time.sleep(pause)
        start = time.perf_counter()
        scheme.send()
        sends.append(time.perf_counter() - start)
    for parent, _ in pipes:
        parent.send("stop")
    scheme.shutdown()
    for p in procs:
        p.join(60)
    return raw[1:], sends[1:]  # the first round warms connections up


def bench_distributed_pair(
    mb: float, workers: int, rounds: int, tensors: tuple[int, int], **scheme_kw: Any
) -> tuple[list[float], list[float]]:
    """Sends of two models of ``mb`` each (``tensors[i]`` tensors), each scheme with worker processes of its
    own, alternating in the same rounds (:func:`_alternate`)."""
    ctx = processes()
    models = [make_model(mb, t) for t in tensors]
    schemes, pipes, procs = [], [], []
    for model, t in zip(models, tensors):
        scheme = ws.DistributedWeightSyncScheme(timeout=120, **scheme_kw)
        scheme.init_on_sender(model_id="policy", model=model, num_workers=workers)
        ends = [ctx.Pipe() for _ in range(workers)]
        procs += [ctx.Process(target=_dist_worker, args=(scheme, i, mb, None, ends[i][1], t)) for i in range(workers)]
        for p in procs[-workers:]:
            p.start()
        scheme.connect()
        schemes.append(scheme)
        pipes.append([parent for parent, _ in ends])

    idle = random.Random(0)

    def tell(i: int) -> None:
        for parent in pipes[i]:
            parent.send("send")
        time.sleep(idle.uniform(*WORKER_IDLE_S))

    sends = _alternate(models, schemes, rounds, tell)
    for parent in pipes[0] + pipes[1]:
        parent.send("stop")
    for scheme in schemes:
        scheme.shutdown()
    for p in procs:
        p.join(60)
    return sends


# ------------------------------------------------------------------------ rpc
def _sink(tensor: torch.Tensor) -> int:
    return tensor.numel()


def _rpc_worker(schemes, idx, mb, stop, tensors) -> None:
    """Worker ``idx`` of every scheme in ``schemes`` (one RPC world), scheme ``i`` with a model of ``tensors[i]``."""
    torch.set_num_threads(1)
    for scheme, t in zip(schemes, tensors):
        scheme.init_on_receiver(model=make_model(mb, t), worker_idx=idx)
        scheme.connect()
    while not stop.is_set():
        try:
            for scheme in schemes:
                scheme.receive(timeout=0.05 / len(schemes))
        except ws.ConnectionClosedError:
            break
    for scheme in schemes:
        scheme.shutdown()


def bench_rpc(mb: float, workers: int, rounds: int, tensors: int = 0) -> tuple[list[float], list[float]]:
    import torch.distributed.rpc as rpc

    from weightsync.transports.rpc import default_worker_name

    model = make_model(mb, tensors)
    # Opted in: while it runs, every local user could run code in this benchmark's processes (docs/multinode.md).
    scheme = ws.RPCWeightSyncScheme(timeout=120, allow_store_peers_to_run_code=True)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=workers)
    ctx = processes()
    stop = ctx.Event()
    procs = [ctx.Process(target=_rpc_worker, args=([scheme], i, mb, stop, [tensors])) for i in range(workers)]
    for p in procs:
        p.start()
    scheme.connect()
    payload = torch.randn(sum(p.numel() for p in model.parameters()))
    raw, sends = [], []
    for r in range(rounds + 1):
        start = time.perf_counter()
        futures = [rpc.rpc_async(default_worker_name(i), _sink, args=(payload,)) for i in range(workers)]
        torch.futures.wait_all(futures)
        raw.append(time.perf_counter() - start)
        _perturb(model, r)
        start = time.perf_counter()
        scheme.send()
        sends.append(time.perf_counter() - start)
    stop.set()
    scheme.shutdown()
    for p in procs:
        p.join(60)
    return raw[1:], sends[1:]


def bench_rpc_pair(
    mb: float, workers: int, rounds: int, tensors: tuple[int, int], **options: Any
) -> tuple[list[float], list[float]]:
    """Sends of two models of ``mb`` each (``tensors[i]`` tensors) to the same worker processes, each holding
    both models (one RPC world per process), alternating in the same rounds (:func:`_alternate`)."""
    models = [make_model(mb, t) for t in tensors]
    schemes = [ws.RPCWeightSyncScheme(timeout=120, allow_store_peers_to_run_code=True, **options) for _ in tensors]
    for i, (scheme, model) in enumerate(zip(schemes, models)):
        scheme.init_on_sender(model_id=f"policy{i}", model=model, num_workers=workers)
    ctx = processes()
    stop = ctx.Event()
    procs = [ctx.Process(target=_rpc_worker, args=(schemes, i, mb, stop, tensors)) for i in range(workers)]
    for p in procs:
        p.start()
    for scheme in schemes:
        scheme.connect()
    sends = _alternate(models, schemes, rounds)
    stop.set()
    for scheme in schemes:
        scheme.shutdown()
    for p in procs:
        p.join(60)
    return sends


# ------------------------------------------------------------------------ ray
class _RayActor:
    """An actor holding a model of the benchmark's shape, joined to a scheme (used as ``ray.remote(...)``)."""

    def __init__(self, scheme, idx, mb, tensors):
        torch.set_num_threads(1)
        self.model = make_model(mb, tensors)
        self.flat = torch.nn.utils.parameters_to_vector(self.model.parameters()).detach()
        scheme.init_on_receiver(model_id="policy", model=self.model, worker_idx=idx)
        scheme.connect()
        self.scheme = scheme

    def fetch_and_copy(self, array):
        self.flat.copy_(torch.from_numpy(array))  # the raw floor: fetch the object, copy it into the model
        return True


def _ray_init(mb: float, workers: int, models: int = 1) -> None:
    import ray

    from weightsync.transports.ray.cluster import private_ray_files

    # Up to 1 GiB, Ray's object store touches its pages once, at start-up, instead of whenever it first hands
    # them out: first-touching 100 MB of fresh memory costs 42 ms on this VM (250 ms on other days), and it
    # landed in whichever column drew fresh pages that round (docs/benchmarks.md, "Where the time goes").
    # Touching the 5 GB the 1000 MB case needs outlasts the raylet's start-up timeout.
    store = max(1 << 30, int((3 * models + 2) * mb * 1e6))  # each scheme's objects, the floor's, and room
    with private_ray_files() as files:  # (Ray's default, /tmp/ray, is open to every user: docs/security.md)
        ray.init(
            address="local",  # (a new cluster: with no address, Ray joins the one a file any user can write names)
            num_cpus=workers + 1,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=store,
            _system_config={"preallocate_plasma_memory": store <= 1 << 30},
            _temp_dir=files,
        )


def _ray_scheme(model: torch.nn.Module, mb: float, workers: int, tensors: int, **options: Any) -> tuple[Any, list]:
    """A connected RayWeightSyncScheme for ``model``, and its actors (each with a model of the same shape)."""
    import ray

    actor_class = ray.remote(num_cpus=0)(_RayActor)
    scheme = ws.RayWeightSyncScheme(timeout=120, **options)
    actors = [actor_class.remote(scheme, i, mb, tensors) for i in range(workers)]
    scheme.init_on_sender(model_id="policy", model=model, remote_collectors=actors)
    scheme.connect()
    return scheme, actors


def bench_ray(mb: float, workers: int, rounds: int, tensors: int = 0) -> tuple[list[float], list[float]]:
    import ray

    _ray_init(mb, workers)
    try:
        model = make_model(mb, tensors)
        scheme, actors = _ray_scheme(model, mb, workers, tensors)
        raw, sends = _ray_rounds(model, scheme, actors, rounds)
        scheme.shutdown()
        return raw, sends
    finally:
        ray.shutdown()


def _ray_rounds(model: torch.nn.Module, scheme: Any, actors: list, rounds: int) -> tuple[list[float], list[float]]:
    """Per round, the raw floor (one ``ray.put`` fetched and copied by each actor) then one ``send()``; the
    first round warms up and is left out."""
    import ray

    payload = torch.randn(sum(p.numel() for p in model.parameters()))
    raw, sends = [], []
    for r in range(rounds + 1):
        start = time.perf_counter()
        ref = ray.put(payload.numpy())
        ray.get([a.fetch_and_copy.remote(ref) for a in actors])
        raw.append(time.perf_counter() - start)
        del ref
        _perturb(model, r)
        start = time.perf_counter()
        scheme.send()
        sends.append(time.perf_counter() - start)
    return raw[1:], sends[1:]


class _RayModuleHost(ws.ModuleActor):
    """The actor of RayModuleTransformScheme (a :class:`~weightsync.ModuleActor`), with the raw floor's method."""

    def __init__(self, scheme, mb, tensors):
        torch.set_num_threads(1)
        model = make_model(mb, tensors)
        self.flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        super().__init__(model, scheme, model_id="policy")

    def fetch_and_copy(self, array):
        self.flat.copy_(torch.from_numpy(array))
        return True


def bench_ray_module_transform(
    mb: float, workers: int, rounds: int, tensors: int = 0
) -> tuple[list[float], list[float]]:
    """RayModuleTransformScheme: the module in ONE actor, whatever ``workers``."""
    import ray

    _ray_init(mb, 1)
    try:
        model = make_model(mb, tensors)
        scheme = ws.RayModuleTransformScheme(timeout=120)
        host = ray.remote(num_cpus=0)(_RayModuleHost).remote(scheme, mb, tensors)
        scheme.init_on_sender(model_id="policy", model=model, actor=host)
        scheme.connect()
        raw, sends = _ray_rounds(model, scheme, [host], rounds)
        scheme.shutdown()
        return raw, sends
    finally:
        ray.shutdown()


def bench_ray_pair(
    mb: float, workers: int, rounds: int, tensors: tuple[int, int], **options: Any
) -> tuple[list[float], list[float]]:
    """Sends of two models of ``mb`` each (``tensors[i]`` tensors, 0: the MLP), each to actors of its own,
    alternating in the same rounds (which goes first alternates too), so that load hits both alike."""
    import ray

    _ray_init(mb, 2 * workers, models=2)
    try:
        models = [make_model(mb, t) for t in tensors]
        schemes = [_ray_scheme(model, mb, workers, t, **options)[0] for model, t in zip(models, tensors)]
        sends = _alternate(models, schemes, rounds)
        for scheme in schemes:
            scheme.shutdown()
        return sends
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------- main
def _alternate(models: list, schemes: list, rounds: int, before_send: Any = None) -> tuple[list[float], list[float]]:
    """Time ``schemes[i].send()`` of ``models[i]`` for both, alternating in every round (which goes first
    alternates too) so that load hits both alike; ``before_send(i)`` runs untimed before each. The first
    round warms connections up and is left out."""
    sends: tuple[list[float], list[float]] = ([], [])
    for r in range(rounds + 1):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            _perturb(models[i], r)
            if before_send is not None:
                before_send(i)
            start = time.perf_counter()
            schemes[i].send()
            sends[i].append(time.perf_counter() - start)
    return sends[0][1:], sends[1][1:]


def _perturb(model: torch.nn.Module, seed: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * (seed + 1))


def _run_one(
    engine: str, mb: float, workers: int, rounds: int, out, tensors: int = 0, reply: bool = False, idle=WORKER_IDLE_S
) -> None:
    try:
        options = {"reply": reply, "idle": tuple(idle)} if engine == "distributed" else {}
        # By module name, not from __main__: Ray's workers import the actor classes from where they are defined.
        module = importlib.import_module("bench_engines")
        out.send(getattr(module, f"bench_{engine}")(mb, workers, rounds, tensors, **options))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        out.send(f"{type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--round-trip", action="store_true", help="the raw distributed engine gets a reply from each worker too"
    )
    parser.add_argument(
        "--idle",
        type=float,
        nargs=2,
        default=WORKER_IDLE_S,
        metavar=("LO", "HI"),
        help="the distributed workers' pause before each round, drawn from LO to HI seconds",
    )
    parser.add_argument("--markdown", type=Path, default=None, help="write the table to this file")
    args = parser.parse_args(argv)
    policy = passive_openmp()  # each engine runs in a fresh process; OMP_WAIT_POLICY=ACTIVE: without
    ctx = processes()
    rows = []
    for engine in args.engines:
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_run_one, args=(engine, args.mb, args.workers, args.rounds, child, 0, args.round_trip, args.idle)
        )
        proc.start()
        result = parent.recv() if parent.poll(900) else "timed out after 900 s"
        proc.join(60)
        if isinstance(result, str):
            rows.append(f"| {engine} | failed: {result} | | |")
            continue
        raw, sends = (statistics.median(x) * 1e3 for x in result)
        rows.append(f"| {engine} | {sends:.2f} ms | {raw:.2f} ms | {sends / raw:.2f}x |")
    mb = make_model(args.mb)
    nbytes = sum(p.numel() * p.element_size() for p in mb.parameters())
    table = "\n".join(
        [
            f"{nbytes / 1e6:.1f} MB float32, {args.workers} workers (ray_module_transform: its one actor), "
            f"median of {args.rounds} rounds, raw distributed {'with' if args.round_trip else 'without'} replies, "
            f"distributed workers idle {args.idle[0] * 1e3:g} to {args.idle[1] * 1e3:g} ms before each round, "
            f"{platform.machine()} / {mp.cpu_count()} cores, torch {torch.__version__}, OMP_WAIT_POLICY={policy}",
            "",
            "| scheme | send | raw engine | ratio |",
            "|---|---:|---:|---:|",
            *rows,
        ]
    )
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0 if not any("failed" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
