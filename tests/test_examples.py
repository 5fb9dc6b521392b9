"""The examples and the benchmark run as a user would run them (no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("scheme", ["multiprocess", "shared_mem"])
def test_local_sync_example_verifies_every_version(scheme):
    out = subprocess.run(
        [sys.executable, "examples/local_sync.py", "--scheme", scheme, "--rounds", "3", "--hidden", "64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "verified: yes" in out.stdout


def test_benchmark_runs_and_writes_its_table(tmp_path):
    md = tmp_path / "bench.md"
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_local.py", "--mb", "1", "--rounds", "2", "--markdown", str(md)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    table = md.read_text()
    for scheme in ("no_sync", "shared_mem", "multiprocess"):
        assert f"| {scheme} |" in table
