"""Sends across a shaped link between two hosts: ``distributed``, ``rpc`` and ``ray`` at 100 MB, fp32 and
``wire_dtype="bfloat16"``, against the link's floor (bytes / rate).

    python benchmarks/bench_two_hosts.py                 # 1 and 10 Gbit/s, prints the table (needs root)
    python benchmarks/bench_two_hosts.py --write         # ... and rewrites its section of docs/benchmarks.md
    python benchmarks/bench_two_hosts.py --mb 10 --rounds 3 --rates 1e9 --engines ray --wire-dtypes float32
    python benchmarks/bench_two_hosts.py --changed 0 0.001 0.01 0.1 0.5 --rates 1e9 --write   # delta rows
    python benchmarks/bench_two_hosts.py --changed 0 0.01 --track-writes --rates 1e9 --wire-dtypes float32 --write

With ``--changed``, each round changes that share of the values (at random places) and the scheme sends with
``delta="auto"``; a row of whole sends (``delta=false``) per engine is the reference. Those rows go to the
``delta`` section of docs/delta.md, against the whole model's floor and the floor of the bytes actually sent.
``--track-writes`` adds, per share, a row with ``track_writes=True`` too, and per engine a row of whole sends of a
4 KB model: what a small message costs on that engine and link (those rows go to the ``track-writes`` section).

The hosts are network namespaces joined by a switch of their own (tests/_hosts.py); the trainer's host sends
through a token bucket (``tbf``) at the rate. The trainer runs on host A, one worker on host B built from the
receiver config's YAML; each send is ``sync=True`` and timed until the worker applied and acknowledged it. The
floor is the bytes on the wire (half for bf16) over the rate: what no protocol can beat. For ``ray``, a head node
runs on host A and a worker node on host B (token authentication on), and the worker is an actor placed on B.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def trainer(args: argparse.Namespace) -> None:
    import torch
    from omegaconf import OmegaConf

    import weightsync as ws

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, int(args.mb * 2**20 / 4 / 1024), bias=False)
    kwargs = {"master_addr": args.addr, "master_port": 29612, "timeout": 120, "wire_dtype": args.wire_dtype}
    kwargs["delta"] = {"false": False, "true": True}.get(args.delta, args.delta)
    kwargs["track_writes"] = args.track
    if args.engine == "rpc":  # the benchmark's hosts are a private network namespace of its own
        kwargs["allow_store_peers_to_run_code"] = True
    scheme = ws.WeightSyncScheme.from_backend(args.engine, **kwargs)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    out = Path(args.out)
    (out / "w.part").write_text(OmegaConf.to_yaml(scheme.receiver_config(0)))
    (out / "w.part").rename(out / "worker0.yaml")
    try:
        scheme.connect()
        timed_sends(scheme, model, args.rounds, args.wire_dtype, args.fraction)
    finally:
        scheme.shutdown()


def worker(args: argparse.Namespace) -> None:
    from pathlib import Path

    import torch

    import weightsync as ws

    model = torch.nn.Linear(1024, int(args.mb * 2**20 / 4 / 1024), bias=False)
    scheme = ws.from_config(Path(args.config), allow_store_peers_to_run_code=args.engine == "rpc")
    scheme.init_on_receiver(model=model)
    scheme.connect()
    try:
        while True:
            scheme.receive(timeout=1.0)
    except ws.ConnectionClosedError:
        pass
    finally:
        scheme.shutdown()


def timed_sends(scheme, model, rounds: int, wire_dtype: str, fraction: float | None = None) -> None:
    """``rounds`` sync sends of ``model`` (a step between each: every value, or ``fraction`` of them at random
    places, or none at 0); prints their median, the bytes of the whole model on the wire and the median bytes sent."""
    import torch

    times, sent = [], []
    gen = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        with torch.no_grad():
            if fraction is None:
                model.weight.add_(1e-3)
            elif fraction == 0:  # (no step: a mask of nothing would cost 125 MB of random numbers, which slow
                pass  # any send after them, a small one too: 1.1-2.0 ms became 2.7-4.0 on one host)
            else:
                mask = torch.rand(model.weight.shape, generator=gen) < fraction
                model.weight[mask] += 1e-3
        began = time.perf_counter()
        scheme.send()
        times.append(time.perf_counter() - began)
        record = scheme.last_send
        sent.append(record.changes.get(0, record.nbytes))
    nbytes = model.weight.numel() * (2 if wire_dtype == "bfloat16" else 4)
    print(json.dumps({"median": statistics.median(times), "wire_bytes": nbytes, "sent_bytes": statistics.median(sent)}),
          flush=True)  # fmt: skip


def ray_trainer(args: argparse.Namespace) -> None:
    import ray
    import torch

    import weightsync as ws
    from tests._ray_two_hosts import join_cluster

    join_cluster(args.addr, "hostB", 1, within=120)

    @ray.remote(num_cpus=0, resources={"hostB": 1})
    class Worker:
        def __init__(self, mb: float) -> None:
            self.model = torch.nn.Linear(1024, int(mb * 2**20 / 4 / 1024), bias=False)

        def join(self, cfg, worker_idx: int) -> None:
            self.scheme = ws.from_config(cfg, allow_pickle=True)
            self.scheme.init_on_receiver(model_id="policy", model=self.model, worker_idx=worker_idx)
            self.scheme.connect()

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, int(args.mb * 2**20 / 4 / 1024), bias=False)
    actor = Worker.remote(args.mb)
    delta = {"false": False, "true": True}.get(args.delta, args.delta)
    scheme = ws.RayWeightSyncScheme(
        allow_pickle=True, timeout=120, wire_dtype=args.wire_dtype, delta=delta, track_writes=args.track
    )
    scheme.init_on_sender(model_id="policy", model=model, remote_collectors=[actor])
    ray.get(actor.join.remote(scheme.receiver_config(0), 0))
    scheme.connect()
    try:
        timed_sends(scheme, model, args.rounds, args.wire_dtype, args.fraction)
    finally:
        scheme.shutdown()
        ray.shutdown()


def one_ray(a, b, wire_dtype: str, mb: float, rounds: int, extra: list[str]) -> dict:
    import secrets

    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    common = ["--num-cpus", "1", "--disable-usage-stats", "--block"]
    with tempfile.TemporaryDirectory(prefix="wsray", dir="/tmp") as tmp:
        a.spawn(["ray", "start", "--head", "--node-ip-address", a.addr, "--port", "6379", "--include-dashboard",
                 "false", "--temp-dir", f"{tmp}/a", *common], env=env)  # fmt: skip
        b.spawn(["ray", "start", "--address", f"{a.addr}:6379", "--node-ip-address", b.addr, "--resources",
                 '{"hostB": 1}', "--temp-dir", f"{tmp}/b", *common], env=env)  # fmt: skip
        t = a.spawn(["python", __file__, "--role", "ray-trainer", "--addr", f"{a.addr}:6379", "--rounds", str(rounds),
                     "--wire-dtype", wire_dtype, "--mb", str(mb), *extra], env=env)  # fmt: skip
        stdout, stderr = t.communicate(timeout=900)
    if t.returncode != 0:
        raise SystemExit(f"ray {wire_dtype}: the trainer failed:\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def one(
    a, b, engine: str, wire_dtype: str, mb: float, rounds: int, delta: str = "false", fraction=None, track=False
) -> dict:
    extra = ["--delta", delta, *(["--fraction", str(fraction)] if fraction is not None else [])]
    extra += ["--track"] if track else []
    if engine == "ray":
        return one_ray(a, b, wire_dtype, mb, rounds, extra)
    out = Path(tempfile.mkdtemp())
    common = ["--engine", engine, "--wire-dtype", wire_dtype, "--mb", str(mb), *extra]
    t = a.spawn(["python", __file__, "--role", "trainer", "--out", str(out), "--addr", a.addr, "--rounds",
                 str(rounds), *common])  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out / "worker0.yaml").exists():
        if t.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the trainer wrote no receiver config: {t.stderr.read()}")
        time.sleep(0.1)
    w = b.spawn(["python", __file__, "--role", "worker", "--config", str(out / "worker0.yaml"), *common])
    stdout, stderr = t.communicate(timeout=900)
    w.communicate(timeout=120)
    if t.returncode != 0:
        raise SystemExit(f"{engine} {wire_dtype}: the trainer failed:\n{stderr}")
    return json.loads(stdout.strip().splitlines()[-1])


#: The model of a small message's row (``--track-writes``): 4 KB.
SMALL_MB = 4 / 1024


def rate_name(bits: float) -> str:
    return f"{bits / 1e9:g} Gbit/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--role", choices=["main", "trainer", "worker", "ray-trainer"], default="main", help=argparse.SUPPRESS
    )
    parser.add_argument("--engine", default="distributed", help=argparse.SUPPRESS)
    parser.add_argument("--wire-dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--addr", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--rates", type=float, nargs="*", default=[1e9, 10e9], help="link rates, bits/s")
    engines = ["distributed", "rpc", "ray"]
    parser.add_argument("--engines", nargs="*", default=engines, choices=engines)
    dtypes = ["float32", "bfloat16"]
    parser.add_argument("--wire-dtypes", nargs="*", default=dtypes, choices=dtypes)
    parser.add_argument("--write", action="store_true", help="rewrite the two-host section of docs/benchmarks.md")
    parser.add_argument("--changed", type=float, nargs="*", help="delta rows: the shares of values each step changes")
    parser.add_argument("--delta", default="false", help=argparse.SUPPRESS)
    parser.add_argument("--fraction", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--track", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--track-writes", action="store_true", help="delta rows: with track_writes=True too, and a small message's"
    )
    args = parser.parse_args()
    if args.role == "trainer":
        return trainer(args)
    if args.role == "worker":
        return worker(args)
    if args.role == "ray-trainer":
        return ray_trainer(args)

    from _doc import replace_section

    from tests._hosts import hosts

    if os.geteuid() != 0:
        sys.exit("bench_two_hosts.py makes network namespaces: run it as root")
    if args.changed:
        return delta_rows(args, hosts, replace_section)
    began = time.perf_counter()
    lines = [
        "| link | engine | wire dtype | median send (s) | link floor (s) | x floor |",
        "|---|---|---|---|---|---|",
    ]
    for rate in args.rates:
        for engine in args.engines:
            for wire_dtype in args.wire_dtypes:
                with hosts(2) as (a, b):
                    a.shape(rate)
                    row = one(a, b, engine, wire_dtype, args.mb, args.rounds)
                floor = row["wire_bytes"] * 8 / rate
                lines.append(
                    f"| {rate_name(rate)} | {engine} | {wire_dtype} | {row['median']:.3f} | {floor:.3f} | "
                    f"{row['median'] / floor:.2f} |"
                )
                print(lines[-1], flush=True)
    import torch

    text = "\n".join(
        [
            f"A {args.mb:g} MB float32 model, trainer on host A, one worker on host B, median of {args.rounds} "
            f"sync sends per row, one run of `benchmarks/bench_two_hosts.py` ({time.perf_counter() - began:.0f} s, "
            f"torch {torch.__version__}, {os.cpu_count()} cores).",
            "",
            *lines,
        ]
    )
    print(text)
    if args.write:
        replace_section(ROOT / "docs" / "benchmarks.md", "two-hosts", text)


def delta_rows(args: argparse.Namespace, hosts, replace_section) -> None:
    """Per engine: whole sends, then ``delta="auto"`` at each share changed, against the whole model's floor and
    the floor of the bytes sent; per rate and wire dtype."""
    import torch

    began = time.perf_counter()
    lines = [
        "| link | engine | wire dtype | changed | delta | median send (s) | sent MB | whole floor (s) | sent floor (s) "
        "| x whole floor | x whole send |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate in args.rates:
        for engine in args.engines:
            for wire_dtype in args.wire_dtypes:
                whole = None
                cases = [("false", 0.01, False)]
                for fraction in args.changed:
                    cases += [("auto", fraction, False), *([("auto", fraction, True)] if args.track_writes else [])]
                if args.track_writes:
                    cases.append(("small", None, False))
                for delta, fraction, track in cases:
                    mb = args.mb if delta != "small" else SMALL_MB
                    with hosts(2) as (a, b):
                        a.shape(rate)
                        row = one(a, b, engine, wire_dtype, mb, args.rounds, delta.replace("small", "false"),
                                  fraction, track)  # fmt: skip
                    if whole is None:
                        whole = row["median"]
                    floor, sent_floor = row["wire_bytes"] * 8 / rate, row["sent_bytes"] * 8 / rate
                    share = "a 4 KB model, whole" if fraction is None else f"{fraction:.1%}"
                    mode = "false" if delta == "small" else delta + (", track_writes" if track else "")
                    lines.append(
                        f"| {rate_name(rate)} | {engine} | {wire_dtype} | {share} | {mode} | "
                        f"{row['median']:.4f} | {row['sent_bytes'] / 1e6:.2f} | {floor:.3f} | {sent_floor:.4f} | "
                        f"{row['median'] / floor:.3f} | {row['median'] / whole:.2f} |"
                    )
                    print(lines[-1], flush=True)
    small = (
        " *a 4 KB model, whole*: a small message on the same engine and link (a model of 1024 float32 values, "
        "``delta=false``); at 0% no step is made (see the script)."
        if args.track_writes
        else ""
    )
    command = " ".join(sys.argv[1:]).replace(" --write", "")
    text = "\n".join(
        [
            f"A {args.mb:g} MB float32 model (one tensor), trainer on host A, one worker on host B, median of "
            f"{args.rounds} sync sends per row, each after a step that changed that share of the values; one run "
            f"of `benchmarks/bench_two_hosts.py {command}` ({time.perf_counter() - began:.0f} s, torch "
            f"{torch.__version__}, {os.cpu_count()} cores). *x whole send*: against the row of whole sends "
            f"(``delta=false``) of the same engine.{small}",
            "",
            *lines,
        ]
    )
    print(text)
    if args.write:
        replace_section(ROOT / "docs" / "delta.md", "track-writes" if args.track_writes else "delta-two-hosts", text)


if __name__ == "__main__":
    main()
