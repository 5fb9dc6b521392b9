"""What computing a delta costs the trainer, against one memcpy of the model, on one host.

    python benchmarks/bench_delta.py                       # ~134M-parameter Llama shapes, float32 and bfloat16
    python benchmarks/bench_delta.py --layers 2 --changed 0.01 --repeats 3      # a quick look
    python benchmarks/bench_delta.py --write               # ... and rewrites its section of docs/delta.md

Per dtype and share of values changed (at random places, bits flipped in place), the median over ``--repeats``
versions of:

- **memcpy**: one copy of every tensor into a buffer laid out as the version travels (what a whole send
  stages);
- **delta**: ``DeltaBase.update``, the trainer's whole cost of a version sent as changes: the comparison with
  the copy it keeps, the changed values gathered, the copy brought up to date, the body packed;
- **apply**: a worker's ``apply_delta`` of that body into its copy.

The tensors have the shapes of a Llama (hidden 768, 12 layers, MLP 2048, vocabulary 32000, untied embeddings);
their values are random.

Each table is measured twice, in a process of its own each: with OpenMP's wait policy as torch has it (its idle
workers spin for milliseconds after each parallel operation, the memcpy's or a trainer's optimizer step, on cores
the comparison's threads then share) and with ``OMP_WAIT_POLICY=PASSIVE`` (they sleep at once). ``--policies``
picks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from weightsync.tensors.delta import apply_delta  # noqa: E402
from weightsync.tensors.delta_base import DeltaBase  # noqa: E402
from weightsync.tensors.layout import FlatLayout  # noqa: E402


def llama_shapes(layers: int, hidden: int = 768, mlp: int = 2048, vocab: int = 32000) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{name}.weight"] = (hidden, hidden)
        shapes[p + "mlp.gate_proj.weight"] = (mlp, hidden)
        shapes[p + "mlp.up_proj.weight"] = (mlp, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, mlp)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def change(flat: dict[str, torch.Tensor], share: float, gen: torch.Generator) -> None:
    """Flip one bit of about ``share`` of the values, at random places, in place."""
    for tensor in flat.values():
        words = tensor.view(-1).view(torch.int16 if tensor.element_size() == 2 else torch.int32)
        count = int(words.numel() * share)
        if count:
            at = torch.randint(0, words.numel(), (count,), generator=gen)
            words[at] ^= 1


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def run(dtype: torch.dtype, shares: list[float], layers: int, repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    flat = {k: torch.randn(shape, generator=gen).to(dtype) for k, shape in llama_shapes(layers).items()}
    layout = FlatLayout.from_weights(flat)
    staging = torch.empty(layout.nbytes, dtype=torch.uint8)
    views = layout.views(staging)
    base = DeltaBase(layout)
    base.update(flat, 0)
    worker = base.buffer.clone()
    version = 0
    rows = []
    for share in shares:
        copies, deltas, applies, body = [], [], [], 0
        for _ in range(repeats):
            change(flat, share, gen)
            began = time.perf_counter()
            for key, view in views.items():
                view.copy_(flat[key])
            copies.append(time.perf_counter() - began)
            version += 1
            began = time.perf_counter()
            delta = base.update(flat, version)
            deltas.append(time.perf_counter() - began)
            assert delta is not None
            began = time.perf_counter()
            apply_delta(worker, base.chunks, delta)
            applies.append(time.perf_counter() - began)
            body = delta.nbytes
        assert torch.equal(worker, base.buffer)  # the worker's copy is the trainer's, bit for bit
        row = {
            "dtype": str(dtype).removeprefix("torch."),
            "share": share,
            "mb": layout.nbytes / 1e6,
            "memcpy_ms": median_ms(copies),
            "delta_ms": median_ms(deltas),
            "apply_ms": median_ms(applies),
            "body_mb": body / 1e6,
        }
        print(row, file=sys.stderr, flush=True)
        rows.append(row)
    return rows


POLICIES = {"default": "torch's default", "passive": "`OMP_WAIT_POLICY=PASSIVE`"}


def measured(policy: str, args: argparse.Namespace) -> list[dict]:
    """The rows, measured in a child process under OpenMP's wait ``policy`` (read when torch loads)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    command = [sys.executable, __file__, "--rows", "--layers", str(args.layers), "--repeats", str(args.repeats)]
    command += ["--changed", *map(str, args.changed), "--dtypes", *args.dtypes]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True, timeout=3600).stdout
    return [{**row, "policy": policy} for row in json.loads(out.splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--changed", type=float, nargs="*", default=[0.0, 0.001, 0.01, 0.1, 0.5])
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policies", nargs="*", choices=list(POLICIES), default=list(POLICIES))
    parser.add_argument("--write", action="store_true", help="rewrite the delta-cpu section of docs/delta.md")
    parser.add_argument("--rows", action="store_true", help=argparse.SUPPRESS)  # (a child: its rows as JSON)
    args = parser.parse_args()
    if args.rows:
        rows = [
            row for name in args.dtypes for row in run(getattr(torch, name), args.changed, args.layers, args.repeats)
        ]
        print(json.dumps(rows))
        return
    load = os.getloadavg()[0]
    began = time.perf_counter()
    rows = [row for policy in args.policies for row in measured(policy, args)]
    lines = [
        "| OpenMP's wait | dtype | MB | changed | memcpy ms | delta ms | delta / memcpy | body MB | worker apply ms |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {POLICIES[r['policy']]} | {r['dtype']} | {r['mb']:.0f} | {r['share']:.1%} | {r['memcpy_ms']:.1f} | "
            f"{r['delta_ms']:.1f} | {r['delta_ms'] / r['memcpy_ms']:.2f} | {r['body_mb']:.2f} | {r['apply_ms']:.1f} |"
            for r in rows
        ),
    ]
    text = "\n".join(
        [
            f"One run of `benchmarks/bench_delta.py` ({time.perf_counter() - began:.0f} s, torch {torch.__version__}, "
            f"{os.cpu_count()} cores, 1-minute load average {load:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end); medians of {args.repeats} versions per row.",
            "",
            *lines,
        ]
    )
    print(text)
    if args.write:
        from _doc import replace_section

        replace_section(ROOT / "docs" / "delta.md", "delta-cpu", text)


if __name__ == "__main__":
    main()
