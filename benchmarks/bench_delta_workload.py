"""How many stored values change per optimizer step: a random-weight Llama trained for real steps (issue 35).

    python benchmarks/bench_delta_workload.py                 # ~100 M parameters; prints the tables
    python benchmarks/bench_delta_workload.py --write         # ... and rewrites docs/delta.md's section
    python benchmarks/bench_delta_workload.py --layers 2 --hidden 64 --vocab 512 --steps 2   # a smoke test
    python benchmarks/bench_delta_workload.py --from-json OUT --write   # the tables of a recorded --json run

The model is ``weightsync.app.llama``'s random Llama (transformers' initialization, written to a temporary folder
and loaded back: the model the vLLM tests serve), trained with ``torch.optim.AdamW`` (default betas and eps,
weight decay on every parameter) on a toy language-modelling loss: next-token cross-entropy on sequences that
step through the vocabulary by a random stride from a random start (a fresh seeded batch each step, the same
batches in every run). Each (dtype, weight decay, learning rate) is a run from the same initial weights.

After each step every parameter's bits are compared with the previous step's (``view`` as an integer dtype), in
three cases:

- (a) the parameters are bfloat16 and trained directly (optimizer states in bfloat16 too);
- (b) the parameters are float32, sent as float32;
- (c) the same float32 run, but what workers get is the bfloat16 cast (``wire_dtype=bfloat16``): the casts of
  consecutive versions are compared.

Per step and case: the fraction of values whose bits changed, over the model and per kind of tensor, the
fraction of 64 KiB chunks (of a tensor's bytes; a tensor's last chunk may be shorter) with no change at all, and
the mean length of the runs of unchanged and of changed values (runs end at a tensor's end). The first
``--warmup`` steps, while Adam's moments fill, are reported apart from the ``--steps`` measured ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _doc import replace_section  # noqa: E402

from weightsync.app.llama import LlamaSpec, load_llama, write_llama  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "delta.md"
SECTION = "workload"
KINDS = ("embeddings", "attention", "mlp", "norms", "lm_head")
#: case -> (the dtype trained, the dtype compared)
CASES = {
    "a": ("bfloat16", "bfloat16"),
    "b": ("float32", "float32"),
    "c": ("float32", "bfloat16"),
}
CASE_NAMES = {
    "a": "(a) bf16 params",
    "b": "(b) fp32 params",
    "c": "(c) fp32 master, bf16 wire",
}
_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
_ITEMSIZE = {"bfloat16": 2, "float32": 4}
DOC_HEADER = """# Delta updates

Between two optimizer steps many of a model's stored values can be bit-identical, most of all in bfloat16;
a delta update sends only the values that changed. This page holds the measurements that design rests on.

"""


def kind_of(name: str) -> str:
    """The kind of a Llama parameter, by its name in ``named_parameters()``."""
    for key, kind in (
        ("embed_tokens", "embeddings"),
        ("lm_head", "lm_head"),
        ("self_attn", "attention"),
        ("mlp", "mlp"),
        ("norm", "norms"),
    ):
        if key in name:
            return kind
    raise ValueError(f"unknown kind of parameter {name!r}")


def bits(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``param``'s values in ``dtype`` (a cast when it differs), as integers of the same width, flat, a copy."""
    value = param.detach()
    value = value.to(dtype) if value.dtype != dtype else value.clone()
    return value.reshape(-1).view(_BITS[dtype])


def compare(prev: list[torch.Tensor], cur: list[torch.Tensor], kinds: list[str], chunk_bytes: int) -> dict[str, Any]:
    """What changed from ``prev`` to ``cur`` (parallel lists of flat integer tensors, one per parameter)."""
    counts = {kind: [0, 0] for kind in KINDS}  # changed, total
    chunks = unchanged_chunks = 0
    unchanged_runs = changed_runs = 0
    for before, after, kind in zip(prev, cur, kinds):
        changed = before != after
        n = changed.numel()
        n_changed = int(changed.sum())
        counts[kind][0] += n_changed
        counts[kind][1] += n
        per_chunk = chunk_bytes // before.element_size()
        full = n // per_chunk
        touched = int(changed[: full * per_chunk].view(full, per_chunk).any(1).sum())
        here = full
        if n % per_chunk:  # the tensor's last, shorter chunk
            here += 1
            touched += int(changed[full * per_chunk :].any())
        chunks += here
        unchanged_chunks += here - touched
        # Runs of changed and of unchanged values alternate, starting with the first value's state: a tensor of
        # ``flips + 1`` runs has ceil((flips + 1) / 2) of its first value's state.
        runs = int((changed[1:] != changed[:-1]).sum()) + 1
        first = bool(changed[0])
        runs_of_first = (runs + 1) // 2
        changed_runs += runs_of_first if first else runs - runs_of_first
        unchanged_runs += runs - runs_of_first if first else runs_of_first
    changed_total = sum(c for c, _ in counts.values())
    total = sum(t for _, t in counts.values())
    return {
        "changed": changed_total / total,
        "kinds": {kind: c / t for kind, (c, t) in counts.items() if t},
        "chunks": chunks,
        "chunks_unchanged": unchanged_chunks / chunks,
        "mean_unchanged_run": (total - changed_total) / unchanged_runs if unchanged_runs else 0.0,
        "mean_changed_run": changed_total / changed_runs if changed_runs else 0.0,
    }


def batch(step: int, *, batch_size: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """Sequences ``start + stride * t`` (mod ``vocab``) with a random start and a stride in 1..16, seeded by step."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 17, (batch_size, 1), generator=gen)
    return (start + stride * torch.arange(seq_len)) % vocab


def train_run(folder: Path, dtype: str, lr: float, weight_decay: float, args: argparse.Namespace) -> dict[str, Any]:
    """Train a fresh copy of the model for ``warmup + steps`` steps; per step, what changed in each case."""
    model = load_llama(folder, dtype=dtype).train()
    params = list(model.named_parameters())
    kinds = [kind_of(name) for name, _ in params]
    cases = [case for case, (trained, _) in CASES.items() if trained == dtype]
    prev = {case: [bits(p, getattr(torch, CASES[case][1])) for _, p in params] for case in cases}
    optimizer = torch.optim.AdamW([p for _, p in params], lr=lr, weight_decay=weight_decay)
    steps = []
    for step in range(1, args.warmup + args.steps + 1):
        ids = batch(step, batch_size=args.batch, seq_len=args.seq, vocab=args.vocab, seed=args.seed)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        took = time.perf_counter() - start
        value = float(loss.detach())
        record: dict[str, Any] = {"step": step, "seconds": took, "loss": value}
        for case in cases:
            cur = [bits(p, getattr(torch, CASES[case][1])) for _, p in params]
            record[case] = compare(prev[case], cur, kinds, args.chunk_kib * 1024)
            prev[case] = cur
        steps.append(record)
        changes = ", ".join(f"({case}) {record[case]['changed']:.4%}" for case in cases)
        print(
            f"  {dtype} wd={weight_decay:g} lr={lr:g} step {step}: {took:.1f} s, loss {value:.3f}, {changes}",
            file=sys.stderr,
            flush=True,
        )
    return {"dtype": dtype, "lr": lr, "weight_decay": weight_decay, "steps": steps}


def summarize(runs: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """One row per (case, weight decay, lr): warm-up steps as they are, medians and ranges over the rest."""
    rows = []
    for case, (trained, _) in CASES.items():
        for run in runs:
            if run["dtype"] != trained:
                continue
            warm = [s[case] for s in run["steps"][:warmup]]
            measured = [s[case] for s in run["steps"][warmup:]]

            def spread(values: list[float]) -> dict[str, float]:
                return {"median": statistics.median(values), "min": min(values), "max": max(values)}

            rows.append(
                {
                    "case": case,
                    "lr": run["lr"],
                    "weight_decay": run["weight_decay"],
                    "warmup_changed": [w["changed"] for w in warm],
                    "measured_steps": len(measured),
                    "changed": spread([m["changed"] for m in measured]) if measured else None,
                    "kinds": {k: spread([m["kinds"][k] for m in measured]) for k in KINDS} if measured else None,
                    "chunks_unchanged": spread([m["chunks_unchanged"] for m in measured]) if measured else None,
                    "mean_unchanged_run": spread([m["mean_unchanged_run"] for m in measured]) if measured else None,
                    "mean_changed_run": spread([m["mean_changed_run"] for m in measured]) if measured else None,
                    "loss_first": run["steps"][0]["loss"],
                    "loss_last": run["steps"][-1]["loss"],
                }
            )
    return rows


def pct(x: float) -> str:
    """A fraction as a percentage that never rounds to 0 or 100 when it is not."""
    if x == 0:
        return "0"
    if x == 1:
        return "100%"
    if x >= 0.01:
        text = f"{100 * x:.2f}"
        return "> 99.99%" if text == "100.00" else f"{text}%"
    return f"{100 * x:.2g}%"


def run_length(x: float) -> str:
    """A mean run length; "–" where there is no such run."""
    if x == 0:
        return "–"
    return f"{x:,.0f}" if x >= 10 else f"{x:.2f}"


def payloads(row: dict[str, Any]) -> str:
    """Bytes against the dense tensors' of three delta encodings, from a row's median fractions."""
    f, size = row["changed"]["median"], _ITEMSIZE[CASES[row["case"]][1]]
    estimates = (f * (size + 4) / size, 1 / (8 * size) + f, 1 - row["chunks_unchanged"]["median"])
    return " | ".join(f"{100 * e:.1f}%" if e < 10 else f"{e:.0f}x" for e in estimates)


def tables(rows: list[dict[str, Any]], warmup: int, steps: int) -> str:
    measured = f"steps {warmup + 1}–{warmup + steps}" if steps > 1 else f"step {warmup + 1}"
    warm_cols = [f"step {i + 1}" for i in range(warmup)]
    head = ["case", "weight decay", "lr", *warm_cols, f"{measured}: median (range)", *KINDS, "loss first → last"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(head) - 4) + "---|"]
    for r in rows:
        c = r["changed"]
        cells = [
            CASE_NAMES[r["case"]],
            f"{r['weight_decay']:g}",
            f"{r['lr']:g}",
            *(pct(w) for w in r["warmup_changed"]),
            f"{pct(c['median'])} ({pct(c['min'])} – {pct(c['max'])})" if c else "–",
            *(pct(r["kinds"][k]["median"]) if r["kinds"] else "–" for k in KINDS),
            f"{r['loss_first']:.2f} → {r['loss_last']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"How the changes lie ({measured}, medians): the 64 KiB chunks (of a tensor's bytes) with no change at all, "
        "and the mean length of the runs of unchanged and of changed values, in values. The last three columns "
        "are arithmetic on the medians, not measured encodings: what a delta would carry against the dense "
        "tensors with int32 positions and the changed values, with a bitmap of one bit a value and the changed "
        "values, and with the chunks that changed sent whole.",
        "",
        "| case | weight decay | lr | values changed | 64 KiB chunks unchanged | unchanged run | changed run "
        "| positions + values | bitmap + values | changed chunks |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r["changed"]:
            continue
        lines.append(
            f"| {CASE_NAMES[r['case']]} | {r['weight_decay']:g} | {r['lr']:g} | {pct(r['changed']['median'])} | "
            f"{pct(r['chunks_unchanged']['median'])} | {run_length(r['mean_unchanged_run']['median'])} | "
            f"{run_length(r['mean_changed_run']['median'])} | {payloads(r)} |"
        )
    return "\n".join(lines)


def section(result: dict[str, Any]) -> str:
    s, m, c = result["settings"], result["model"], result["conditions"]
    per_step = ", ".join(f"{d} {t:.1f} s" for d, t in c["seconds_per_step"].items())
    return "\n".join(
        [
            "## How much changes per step",
            "",
            f"`{c['command']}`: {c['seconds']:.0f} s on {c['machine']}, torch {c['torch']}, transformers "
            f"{c['transformers']}, {c['threads']} threads; load average {c['load_before']:.2f} before and "
            f"{c['load_after']:.2f} after (1 min; the host was shared). One run; median step (forward, backward, "
            f"AdamW) {per_step}.",
            "",
            f"The model: `weightsync.app.llama`'s random Llama (transformers' initialization), {m['num_layers']} "
            f"layers, hidden {m['hidden_size']}, MLP {m['intermediate_size']}, {m['num_heads']} heads "
            f"({m['num_kv_heads']} key/value), vocabulary {m['vocab_size']}, untied embeddings: "
            f"{m['num_parameters']:,} parameters in {m['num_tensors']} tensors. Trained with `torch.optim.AdamW` "
            "(betas 0.9/0.999, eps 1e-8, weight decay on every parameter) on next-token cross-entropy over "
            f"{s['batch']} sequences of {s['seq']} tokens a step (each steps through the vocabulary by a random "
            "stride from a random start; a fresh batch each step, the same batches in every run), each row from "
            "the same initial weights. After each step every value's bits are compared with the previous step's: "
            "(a) bfloat16 parameters trained directly (Adam's states in bfloat16 too); (b) float32 parameters; "
            "(c) the same float32 run, but the bfloat16 casts of consecutive versions compared, what workers get "
            f"with `wire_dtype=bfloat16`. Steps 1–{s['warmup']} (Adam's moments filling) are shown apart; the "
            f"median and range are over the {s['steps']} steps after them. The per-kind columns are medians. "
            "Full per-step figures: `--json OUT`.",
            "",
            tables(result["rows"], s["warmup"], s["steps"]),
            "",
            "Why: Adam moves a value by about `lr` a step. Neighbouring bfloat16 values near 0.02 (these weights' "
            "scale) are 1.2e-4 apart and near a norm weight's 1.0 they are 3.9e-3 to 7.8e-3 apart, so (a) keeps "
            "every value whose update rounds back to it, while (c) accumulates updates in float32 and a worker's "
            "bfloat16 value changes when the master crosses a rounding boundary. In float32 (b) nearly every value "
            "with a gradient changes at any of these rates. Weight decay multiplies every value by `1 - lr * wd`: that "
            "moves float32 values once `lr * wd` is above a few times 1e-8 (wd 0.01 at lr 1e-5 and 1e-4, not at "
            "1e-6), and bfloat16 ones only above about 2e-3. Input-embedding rows of tokens no batch has held "
            "get no gradient and, "
            "without weight decay, never change: the embeddings column counts how many distinct tokens the toy "
            f"batches held ({s['batch'] * s['seq']} tokens a step, out of {m['vocab_size']}), not a property of "
            "training, and real batches hold more of a vocabulary.",
            "",
            "Where the changes lie: inside the layers and `lm_head` they are scattered value by value (a changed "
            "run is one or two values long in bfloat16), and a 64 KiB chunk holds 32768 bfloat16 values, about 160 "
            "of them changed at 0.5%: whole-chunk skipping finds little beyond what no update touches (bfloat16 "
            "norms, embedding rows of absent tokens). Positions or a bitmap of the changed "
            "values are what pays, and only while few values change.",
        ]
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="measured steps per run, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="first steps, reported apart")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4])
    parser.add_argument("--weight-decays", type=float, nargs="+", default=[0.0, 0.01])
    parser.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float32"], default=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, help="default: 8/3 of hidden, rounded up to 64")
    parser.add_argument("--heads", type=int, help="default: hidden / 64")
    parser.add_argument("--kv-heads", type=int, help="default: a third of the heads")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--chunk-kib", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every step's figures here")
    parser.add_argument("--write", action="store_true", help=f"rewrite the {SECTION} section of --doc")
    parser.add_argument("--doc", type=Path, default=DOC, help="the page --write writes (created if missing)")
    parser.add_argument("--from-json", type=Path, help="print (and --write) the tables of a --json file; no training")
    args = parser.parse_args(argv)
    if args.from_json:  # re-render a recorded run: no training
        result = json.loads(args.from_json.read_text())
        return _report(result, args)
    heads = args.heads or max(1, args.hidden // 64)
    spec = LlamaSpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        intermediate_size=args.intermediate or -(-args.hidden * 8 // 3 // 64) * 64,
        num_heads=heads,
        num_kv_heads=args.kv_heads or max(1, heads // 3),
        vocab_size=args.vocab,
        max_position_embeddings=max(512, args.seq),
        seed=args.seed,
    )
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as tmp:
        folder = write_llama(Path(tmp) / "model", spec)
        for dtype in args.dtypes:
            for weight_decay in args.weight_decays:
                for lr in args.lrs:
                    runs.append(train_run(folder, dtype, lr, weight_decay, args))
    seconds = time.perf_counter() - start
    import transformers

    result = {
        "model": {
            "hidden_size": spec.hidden_size,
            "num_layers": spec.num_layers,
            "intermediate_size": spec.intermediate_size,
            "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads,
            "vocab_size": spec.vocab_size,
            "num_parameters": spec.num_parameters,
            "num_tensors": spec.num_tensors,
        },
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "lrs": args.lrs,
            "weight_decays": args.weight_decays,
            "dtypes": args.dtypes,
            "batch": args.batch,
            "seq": args.seq,
            "chunk_kib": args.chunk_kib,
            "seed": args.seed,
        },
        "conditions": {
            "command": "python benchmarks/bench_delta_workload.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": f"{platform.machine()} / {os.cpu_count()} cores",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
            "seconds": seconds,
            "seconds_per_step": {
                d: statistics.median(s["seconds"] for r in runs if r["dtype"] == d for s in r["steps"])
                for d in args.dtypes
            },
        },
        "runs": runs,
    }
    result["rows"] = summarize(runs, args.warmup)
    return _report(result, args)


def _report(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    text = section(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.write:
        if not args.doc.exists():
            args.doc.write_text(f"{DOC_HEADER}<!-- {SECTION}:begin -->\n<!-- {SECTION}:end -->\n")
        replace_section(args.doc, SECTION, text)
    return result


if __name__ == "__main__":
    main()
