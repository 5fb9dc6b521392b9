"""Every data-plane target in one command: a table of each case against its floor, and a plot.

    python benchmarks/suite.py                       # everything; prints the table
    python benchmarks/suite.py --write               # ... and updates docs/benchmarks.md and docs/benchmarks.png
    python benchmarks/suite.py --cases small scaling --rounds 20

Each case runs in a fresh process, so no case inherits another's memory or
threads. Sends are ``sync=True`` and timed until every worker applied and
acked; a floor is measured in the same rounds as the sends it is compared with
(interleaved), so machine load hits both alike. Where the floor is another send
(1 worker against 8; 1 tensor against 2000), the local schemes run both senders
in one process and alternate them; the engines, one run each, take each send
against its own run's raw engine. The Ray cases start a local
cluster; to keep it on loopback run the suite in a private network namespace
(``unshare -n sh -c 'ip link set lo up && python benchmarks/suite.py'``, root).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engines  # noqa: E402
import bench_local  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "benchmarks.png"
BEGIN, END = "<!-- suite:begin -->", "<!-- suite:end -->"
LOCAL = ["shared_mem", "multiprocess"]
ENGINES = ["distributed", "rpc", "ray"]
FLATTEN_SENDER = ["shared_mem", "multiprocess", "distributed", "rpc", "ray"]  # the schemes with that option
CASES = ["floors", "tensors", "small", "small_engines", "scaling", "memory", "wire", "checksum", "plot"]
#: The network engines of the small-sync case: each scheme against its raw engine's round trip.
SMALL_ENGINES = {
    "distributed": "one gloo broadcast + a reply from each worker",
    "rpc": "one RPC of the bytes to each worker",
    "ray": "one ray.put fetched + copied by each actor",
    "ray_module_transform": "one ray.put fetched + copied by its actor",
}


# ------------------------------------------------------------ measurements (each in a fresh process)
def local_run(
    name: str, mb: float, workers: int, rounds: int, tensors: int = 0, checksum: bool = False
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = bench_local.make_model(mb, tensors)
    memory: dict[str, int] = {}
    copies, sends = bench_local.time_scheme(name, model, workers, rounds, mb, tensors, memory, checksum=checksum)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"sends": sends, "floor": copies, "nbytes": nbytes, **memory}


def engine_run(engine: str, mb: float, workers: int, rounds: int, tensors: int = 0) -> dict[str, Any]:
    raw, sends = getattr(bench_engines, f"bench_{engine}")(mb, workers, rounds, tensors)
    return {"sends": sends, "floor": raw}


def scaling_run(mb: float, rounds: int) -> tuple[list[float], list[float]]:
    """shared_mem sends to 1 worker and to 8, alternating in the same rounds (two schemes, one model)."""
    torch.manual_seed(0)
    model = bench_local.make_model(mb)
    return bench_local.time_pair("shared_mem", (model, model), (1, 8), rounds, mb)


def tensors_run(
    scheme: str, mb: float, workers: int, rounds: int, flatten_sender: bool = False
) -> tuple[list[float], list[float]]:
    """Sends of a model of 2000 tensors and of one of 1 tensor (``mb`` each) alternating in the same rounds."""
    torch.manual_seed(0)
    models = (bench_local.make_model(mb, 2000), bench_local.make_model(mb, 1))
    options = {"flatten_sender": True} if flatten_sender else {}
    return bench_local.time_pair(scheme, models, (workers, workers), rounds, mb, (2000, 1), **options)


def run(scheme: str, mb: float, workers: int, rounds: int, tensors: int = 0) -> dict[str, Any]:
    return (local_run if scheme in LOCAL else engine_run)(scheme, mb, workers, rounds, tensors)


def _child(fn: Callable, args: tuple, kwargs: dict, out: Any) -> None:
    try:
        out.send(fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        out.send(f"{type(exc).__name__}: {exc}")


def isolated(fn: Callable, *args: Any, timeout: float = 900, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a fresh process (:func:`bench_local.processes`); its result, or ``RuntimeError``
    with its failure."""
    ctx = bench_local.processes()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(fn, args, kwargs, child))
    proc.start()
    result = parent.recv() if parent.poll(timeout) else f"timed out after {timeout:.0f} s"
    proc.join(60)
    if proc.is_alive():
        proc.kill()
    if isinstance(result, str):
        raise RuntimeError(f"{fn.__name__}{args}{kwargs or ''}: {result}")
    return result


def med(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


# --------------------------------------------------------------------------- the cases
@dataclass
class Row:
    """One line of the table: a case, its measurement against its floor, and the target of the ratio."""

    case: str
    measured: str
    floor: str
    value: float
    target: float
    unit: str = "x"
    digits: int = 2  # of the ratio: enough that a miss never reads as the target itself

    @property
    def met(self) -> bool:
        return self.value <= self.target

    def cells(self) -> str:
        return (
            f"| {self.case} | {self.measured} | {self.floor} | {self.value:.{self.digits}f}{self.unit} | "
            f"<= {self.target:g}{self.unit} | {'yes' if self.met else '**no**'} |"
        )


def case_floors(args: argparse.Namespace) -> list[Row]:
    floors = {
        "shared_mem": ("one copy_ of the same bytes", 1.3),
        "multiprocess": ("one copy_ of the same bytes", 2.5),
        "distributed": ("one gloo broadcast of the bytes", 1.2),
        "rpc": ("one RPC of the bytes to each worker", 1.3),
        "ray": ("one ray.put fetched + copied by each actor", 1.3),
    }
    rows = []
    for scheme, (what, target) in floors.items():
        if scheme not in args.schemes:
            continue
        r = isolated(run, scheme, args.mb, args.workers, args.rounds)
        send, floor = med(r["sends"]), med(r["floor"])
        rows.append(
            Row(f"{scheme}, {args.mb:g} MB", f"{send:.2f} ms", f"{floor:.2f} ms ({what})", send / floor, target)
        )
    return rows


def tensors_row(args: argparse.Namespace, scheme: str, flatten_sender: bool = False) -> Row:
    """A model of 2000 tensors against one of 1 tensor, ``args.mb`` each, both with ``flatten_sender`` or not;
    the two models' sends alternate in the same rounds (two schemes in one process)."""
    if scheme in LOCAL:
        pair = isolated(tensors_run, scheme, args.mb, args.workers, args.rounds, flatten_sender)
    else:
        options = {"flatten_sender": True} if flatten_sender else {}
        bench = getattr(bench_engines, f"bench_{scheme}_pair")
        pair = isolated(bench, args.mb, args.workers, args.rounds, (2000, 1), **options)
    many, one = (med(sends) for sends in pair)
    how = "1 tensor, same rounds" + (", same option" if flatten_sender else "")
    case = f"{scheme}, flatten_sender: 2000 tensors vs 1" if flatten_sender else f"{scheme}: 2000 tensors vs 1"
    return Row(case, f"{many:.2f} ms", f"{one:.2f} ms ({how})", many / one, 1.2)


def case_tensors(args: argparse.Namespace) -> list[Row]:
    rows = [tensors_row(args, scheme) for scheme in args.schemes]
    # The trainer's model bound to one buffer (opt-in), where the scheme has the option.
    rows += [tensors_row(args, scheme, True) for scheme in args.schemes if scheme in FLATTEN_SENDER]
    return rows


def case_small(args: argparse.Namespace) -> list[Row]:
    rows = []
    for scheme, target in (("shared_mem", 0.2), ("multiprocess", 0.5)):
        if scheme not in args.schemes:
            continue
        r = isolated(run, scheme, 0.4, args.workers, max(args.rounds, 500))  # under 1 s: many rounds are cheap
        rows.append(
            Row(f"{scheme}, 0.4 MB round trip", f"{med(r['sends']):.3f} ms", "-", med(r["sends"]), target, " ms")
        )
    return rows


def small_engine_run(engine: str, rounds: int) -> dict[str, Any]:
    """A 1 MB model to 2 workers (ray_module_transform: its one actor), against the raw engine's round trip."""
    options = {"reply": True} if engine == "distributed" else {}
    raw, sends = getattr(bench_engines, f"bench_{engine}")(1.0, 2, rounds, 0, **options)
    return {"sends": sends, "floor": raw}


def case_small_engines(args: argparse.Namespace) -> list[Row]:
    """RL policies are small and synced every few steps: a sync must cost the engine's round trip, not a pause."""
    rows = []
    for engine, what in SMALL_ENGINES.items():
        if engine.split("_")[0] not in args.schemes:  # ray_module_transform goes with ray
            continue
        rounds = max(args.rounds, 200)  # a few ms each: many rounds are cheap
        r = isolated(small_engine_run, engine, rounds)
        send, floor = med(r["sends"]), med(r["floor"])
        workers = "1 actor" if engine == "ray_module_transform" else "2 workers"
        case = f"{engine}, 1 MB, {workers}, {rounds} rounds"
        rows.append(Row(case, f"{send:.2f} ms", f"{floor:.2f} ms ({what})", send / floor, 2.0))
    return rows


def case_scaling(args: argparse.Namespace) -> list[Row]:
    if "shared_mem" not in args.schemes:
        return []
    one, eight = (med(sends) for sends in isolated(scaling_run, args.mb, args.rounds))
    return [
        Row(
            f"shared_mem, {args.mb:g} MB, 1 -> 8 workers",
            f"{eight:.2f} ms",
            f"{one:.2f} ms (1 worker)",
            eight / one,
            1.5,
        )
    ]


def case_memory(args: argparse.Namespace) -> list[Row]:
    rows = []
    for scheme in [s for s in LOCAL if s in args.schemes]:
        r = isolated(local_run, scheme, args.mb, args.memory_workers, max(3, args.rounds // 2))
        rows.append(
            Row(
                f"{scheme}: sender's extra memory, {args.memory_workers} workers",
                f"{r['extra_bytes'] / 1e6:.1f} MB",
                f"{r['nbytes'] / 1e6:.1f} MB (the model)",
                r["extra_bytes"] / r["nbytes"],
                2.0,
                digits=3,
            )
        )
    return rows


def distributed_run(mb: float, workers: int, rounds: int, **scheme_kw: Any) -> dict[str, Any]:
    raw, sends = bench_engines.bench_distributed(mb, workers, rounds, 0, **scheme_kw)
    return {"sends": sends, "floor": raw}


def case_wire(args: argparse.Namespace) -> list[Row]:
    """The distributed row again with ``wire_dtype="bfloat16"``, against the same fp32 broadcast."""
    if "distributed" not in args.schemes:
        return []
    full = isolated(distributed_run, args.mb, args.workers, args.rounds)
    half = isolated(distributed_run, args.mb, args.workers, args.rounds, wire_dtype="bfloat16")
    # Each send against the fp32 broadcast of its own run, so the two runs' loads cancel out.
    ratio_full, ratio_half = med(full["sends"]) / med(full["floor"]), med(half["sends"]) / med(half["floor"])
    return [
        Row(
            f"distributed, {args.mb:g} MB, wire_dtype=bfloat16 (the same run in fp32: {ratio_full:.2f}x)",
            f"{med(half['sends']):.2f} ms",
            f"{med(half['floor']):.2f} ms (one fp32 gloo broadcast)",
            ratio_half,
            1.2,
        )
    ]


def case_checksum(args: argparse.Namespace) -> list[Row]:
    """What ``checksum=True`` costs at the model size: the issue's bar to keep it on by default is 10%."""
    rows = []
    for name in [s for s in ("shared_mem", "multiprocess") if s in args.schemes]:
        # Sends without and with the checksum alternate in one run.
        got = isolated(local_run, name, args.mb, args.workers, args.rounds, checksum=True)
        rows.append(
            Row(
                f"{name}, {args.mb:g} MB, checksum=True",
                f"{med(got['sends']):.2f} ms",
                f"{med(got['floor']):.2f} ms (the same send without checksum)",
                med(got["sends"]) / med(got["floor"]),
                1.1,
            )
        )
    if "distributed" in args.schemes:
        # Separate runs; each send is taken against the gloo broadcast of its own run, so the loads cancel.
        plain = isolated(distributed_run, args.mb, args.workers, args.rounds)
        checked = isolated(distributed_run, args.mb, args.workers, args.rounds, checksum=True)
        ratio = (med(checked["sends"]) / med(checked["floor"])) / (med(plain["sends"]) / med(plain["floor"]))
        rows.append(
            Row(
                f"distributed, {args.mb:g} MB, checksum=True (each against its own run's broadcast)",
                f"{med(checked['sends']):.2f} ms",
                f"{med(plain['sends']):.2f} ms (without checksum)",
                ratio,
                1.1,
            )
        )
    return rows


def case_plot(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Median send time of every scheme at each size (few rounds: the largest sizes take seconds)."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for scheme in args.schemes:
        for mb in sorted(set(args.sizes)):  # the plot's lines and the table's columns go by size
            rounds = 3 if mb >= 500 else 5
            r = isolated(run, scheme, mb, args.workers, rounds)
            curves.setdefault(scheme, []).append((mb, med(r["sends"])))
    return curves


def plot(curves: dict[str, list[tuple[float, float]]], path: Path, workers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme, points in curves.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=scheme)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model size (MB, float32)")
    ax.set_ylabel("median send time until every worker acked (ms)")
    ax.set_title(f"weightsync send time, {workers} workers, {platform.machine()} / {mp.cpu_count()} cores")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--schemes", nargs="+", default=LOCAL + ENGINES, choices=LOCAL + ENGINES)
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--memory-workers", type=int, default=8, help="workers of the memory case")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 10, 100, 1000], help="plot sizes (MB)")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md and docs/benchmarks.png")
    parser.add_argument("--markdown", type=Path, default=None, help="write the generated section to this file")
    parser.add_argument("--png", type=Path, default=None, help="write the plot here")
    args = parser.parse_args(argv)
    policy = bench_local.passive_openmp()  # each case runs in a fresh process; OMP_WAIT_POLICY=ACTIVE: without
    start = time.perf_counter()
    rows: list[Row] = []
    curves = None
    for case in args.cases:
        if case == "plot":
            curves = case_plot(args)
        else:
            rows += globals()[f"case_{case}"](args)
        print(f"[{time.perf_counter() - start:6.0f} s] {case} done", file=sys.stderr)
    png = PLOT if args.write else args.png
    if curves and png:
        plot(curves, png, args.workers)
    lines = [
        f"`python benchmarks/suite.py {' '.join(argv if argv is not None else sys.argv[1:])}` on "
        f"{platform.machine()} / {mp.cpu_count()} cores, torch {torch.__version__}, "
        f"OMP_WAIT_POLICY={policy}, "
        f"{args.workers} workers unless said, median of {args.rounds} rounds unless said, "
        f"{time.perf_counter() - start:.0f} s in all.",
        "",
        "| case | measured | floor | ratio | target | met |",
        "|---|---:|---:|---:|---:|:---:|",
        *(row.cells() for row in rows),
    ]
    if curves:
        lines += ["", "Median send time (ms) by model size (the plot):", ""]
        sizes = sorted({mb for points in curves.values() for mb, _ in points})
        lines += ["| scheme | " + " | ".join(f"{mb:g} MB" for mb in sizes) + " |", "|---|" + "---:|" * len(sizes)]
        for scheme, points in curves.items():
            lines.append(f"| {scheme} | " + " | ".join(f"{ms:.2f}" for _, ms in points) + " |")
        if png:
            lines += ["", f"![send time against model size]({png.name})"]
    section = "\n".join(lines)
    print(section)
    if args.markdown:
        args.markdown.write_text(section + "\n")
    if args.write:
        text = DOC.read_text()
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        DOC.write_text(f"{head}{BEGIN}\n{section}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
