"""benchmarks/bench_delta_workload.py: what changes per optimizer step, counted right on tensors whose changes are
known, and a tiny Llama trained for real steps where a zero learning rate changes nothing and a large one nearly
everything."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_delta_workload", ROOT / "benchmarks/bench_delta_workload.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "benchmarks/bench_delta_workload.py", *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_changes_chunks_and_runs_are_counted_exactly():
    bench = _bench()
    # bfloat16 bits: 64 KiB chunks of 32768 values; one tensor of 2.5 chunks, one of 10 values, all unchanged.
    big = torch.zeros(80_000, dtype=torch.int16)
    changed = big.clone()
    changed[[0, 1, 2, 40_000, 79_999]] = 1  # runs: changed 3, unchanged 39997, changed 1, unchanged 39998, changed 1
    small = torch.zeros(10, dtype=torch.int16)
    got = bench.compare([big, small], [changed, small.clone()], ["mlp", "norms"], 64 * 1024)
    assert got["changed"] == 5 / 80_010
    assert got["kinds"] == {"mlp": 5 / 80_000, "norms": 0.0}
    assert got["chunks"] == 4  # 3 of the big tensor (the last one shorter), 1 of the small one
    assert got["chunks_unchanged"] == 1 / 4  # chunk 0, 1 and the tail are all touched; the small one is not
    assert got["mean_unchanged_run"] == (39_997 + 39_998 + 10) / 3
    assert got["mean_changed_run"] == 5 / 3
    # float32 bits: 16384 values a chunk; every value changed, one run each.
    a, b = torch.zeros(16_385, dtype=torch.int32), torch.ones(16_385, dtype=torch.int32)
    got = bench.compare([a], [b], ["attention"], 64 * 1024)
    assert (got["changed"], got["chunks"], got["chunks_unchanged"]) == (1.0, 2, 0.0)
    assert (got["mean_changed_run"], got["mean_unchanged_run"]) == (16_385, 0.0)


def test_bits_compare_the_cast_not_the_value():
    bench = _bench()
    master = torch.tensor([1.0, 0.02], dtype=torch.float32)
    nudged = master + torch.tensor([1e-6, 1e-6])  # a float32 change, below bfloat16's spacing at both values
    assert (bench.bits(master, torch.float32) != bench.bits(nudged, torch.float32)).all()
    assert (bench.bits(master, torch.bfloat16) == bench.bits(nudged, torch.bfloat16)).all()
    assert [bench.kind_of(n) for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")] == [
        "embeddings",
        "lm_head",
        "norms",
    ]


def test_a_tiny_llama_trains_and_the_figures_hold_up(tmp_path):
    pytest.importorskip("transformers", reason='needs transformers: `pip install -e ".[vllm]"` (or `.[test]`)')
    pytest.importorskip("tokenizers", reason='needs tokenizers: `pip install -e ".[vllm]"` (or `.[test]`)')
    out_json, doc = tmp_path / "out.json", tmp_path / "delta.md"
    # [[lr, ...]] per run: steps 1 (warm-up), 2 and 3 (measured).
    args = ["--layers", "2", "--hidden", "64", "--vocab", "512", "--batch", "2", "--seq", "32", "--warmup", "1"]
    args += ["--steps", "2", "--lrs", "0", "1e-2", "--json", str(out_json), "--write", "--doc", str(doc)]
    _run(*args, timeout=110)
    result = json.loads(out_json.read_text())
    assert result["model"]["num_parameters"] == sum(
        (512 * 64 * 2, 2 * (4 * 64 * 64 + 3 * 64 * 192 + 2 * 64), 64)
    )  # embeddings, 2 layers (q, k, v, o; gate, up, down; 2 norms), the final norm
    runs = result["runs"]
    assert {(r["dtype"], r["weight_decay"], r["lr"]) for r in runs} == {
        (d, wd, lr) for d in ("bfloat16", "float32") for wd in (0.0, 0.01) for lr in (0.0, 0.01)
    }
    for run in runs:
        cases = ["a"] if run["dtype"] == "bfloat16" else ["b", "c"]
        assert [s["step"] for s in run["steps"]] == [1, 2, 3]
        for step in run["steps"]:
            for case in cases:
                got = step[case]
                fractions = [got["changed"], got["chunks_unchanged"], *got["kinds"].values()]
                assert all(0 <= f <= 1 for f in fractions), got
                assert set(got["kinds"]) == {"embeddings", "attention", "mlp", "norms", "lm_head"}
                if run["lr"] == 0:
                    assert got["changed"] == 0 and got["chunks_unchanged"] == 1, (run["dtype"], case, step)
                else:
                    # Every weight of a layer and of lm_head has a gradient, and Adam moves it by ~1e-2, far past
                    # a bfloat16 spacing at these weights' scale; input-embedding rows of absent tokens have none.
                    assert got["changed"] > 0.6, (run["dtype"], case, step)
                    assert min(got["kinds"][k] for k in ("attention", "mlp", "lm_head")) > 0.95, (case, step)
                    if case == "b" and run["weight_decay"]:  # decay by 1 - 1e-4 moves every float32 value
                        assert got["changed"] == 1
    rows = result["rows"]
    assert len(rows) == 3 * 2 * 2 and {r["case"] for r in rows} == {"a", "b", "c"}
    text = doc.read_text()
    assert text.startswith("# Delta updates\n")
    assert text.index("<!-- workload:begin -->") < text.index("## How much changes per step")
    assert text.index("## How much changes per step") < text.index("<!-- workload:end -->")
    assert "| (c) fp32 master, bf16 wire | 0.01 | 0.01 |" in text
    # --from-json writes the same section from the recorded run, without training.
    again = tmp_path / "again.md"
    _run("--from-json", str(out_json), "--write", "--doc", str(again), timeout=60)
    assert again.read_text() == text
