"""Executable documentation: every fenced ``bash`` and ``python`` block of README.md, docs/ and examples/*/README.md
runs as written, so a doc that stops working fails CI.

Each block runs in a copy of the repository (what it writes stays there), as ``bash -euo pipefail`` or as a Python
script, with a bound on its time (the Ray blocks, which start local clusters, on a network of loopback only). The few
blocks that cannot run here say so by a marker the tests check (tests/_docs.py): the install, main and test
commands, which ``.ci/run`` runs in its own environment, and what needs two hosts or a GPU.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._docs import CI_KINDS, RUNNABLE, SKIP_REASONS, Block, blocks, ci_commands, doc_files
from tests._netns import loopback_only_network

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = blocks()
RUN = [b for b in BLOCKS if b.lang in RUNNABLE and not b.ci_kind and b.skip is None]
# What a copy of the repository leaves out: environments, caches, and what earlier runs wrote.
_NOT_COPIED = shutil.ignore_patterns(
    ".git",
    ".venv*",
    "__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    ".hypothesis",
    ".whl",
    "outputs",
    "multirun",
)


def test_every_block_says_its_language_and_each_marker_is_one_the_tests_know():
    assert len(doc_files()) >= 10 and len(RUN) >= 15, "the docs were not found where the test looks"
    problems = []
    for b in BLOCKS:
        if not b.lang:
            problems.append(f"{b.name}: a fence without a language (bash, python, yaml, text, ...)")
        if b.marker and not (b.ci_kind or b.skip is not None or re.fullmatch(r"timeout: \d+", b.marker)):
            problems.append(f"{b.name}: unknown marker <!-- {b.marker} -->")
        if b.marker and b.lang not in RUNNABLE:
            problems.append(f"{b.name}: a marker on a {b.lang or 'plain'} block, which never runs")
        if b.skip is not None and not b.skip.startswith(SKIP_REASONS):
            problems.append(f"{b.name}: skipped for {b.skip!r}; only {' or '.join(SKIP_REASONS)} may skip a block")
    assert not problems, "\n".join(problems)


def test_ci_runs_the_main_install_and_test_commands_as_written():
    """The blocks the suite cannot run itself (they change its environment, or are the suite) are .ci/run's."""
    marked = [b for b in BLOCKS if b.ci_kind]
    kinds = [b.ci_kind for b in marked]
    assert kinds.count("main-command") == kinds.count("test-command") == 1, kinds
    assert {b.path for b in marked if b.ci_kind != "install"} == {"README.md"}
    for b in marked:
        lines = [line for line in b.code.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("pip install "), f"{b.name} is not one install command line"
    commands = ci_commands()
    assert [c for c in commands if "python -m pytest" in c] == commands[-1:]  # the suite last, once installed
    assert sorted(commands) == sorted(b.code.strip() for b in marked) and set(kinds) == set(CI_KINDS)
    listed = subprocess.run(
        [sys.executable, "tests/_docs.py", "--ci"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert listed.returncode == 0 and listed.stdout.splitlines() == commands, listed.stderr
    assert "tests/_docs.py --ci" in (ROOT / ".ci" / "run").read_text()


def _copy_of_the_repository(dest: Path) -> Path:
    shutil.copytree(ROOT, dest, ignore=_NOT_COPIED, symlinks=True)
    return dest


def _run(argv: list[str], cwd: Path, timeout_s: int) -> subprocess.CompletedProcess:
    """Run ``argv`` in a session of its own; past ``timeout_s`` kill the whole session (workers included)."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # `python` is this one
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"did not finish within {timeout_s}s; its output ended with:\n{out[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def _network(block: Block):
    """A block that starts a Ray cluster runs on a network of loopback only (Ray binds the host's own address);
    the other engines bind 127.0.0.1 unless told otherwise."""
    return loopback_only_network() if re.search(r"\bray\b", block.code) else contextlib.nullcontext()


def _param(b: Block):
    return pytest.param(b, id=b.name, marks=pytest.mark.timeout(b.timeout_s + 60))


@pytest.mark.parametrize("block", [_param(b) for b in RUN])
def test_block_runs_as_written(block: Block, tmp_path):
    repo = _copy_of_the_repository(tmp_path / "repo")
    if block.lang == "python":
        (repo / "block.py").write_text(block.code)
        argv = [sys.executable, "block.py"]
    else:
        (repo / "block.sh").write_text(block.code)
        argv = ["bash", "-euo", "pipefail", "block.sh"]
    with _network(block):
        out = _run(argv, repo, block.timeout_s)
    assert out.returncode == 0, f"{block.name} exited {out.returncode}:\n{block.code}\n---\n{out.stdout[-6000:]}"
    # A clean run prints no traceback, no Python warning, no TensorPipe complaint about a closed connection.
    noise = re.search(r"Traceback \(most recent call last\)|\w+Warning: |encountered error", out.stdout)
    assert noise is None, f"{block.name} printed {noise.group()!r}:\n{out.stdout[-6000:]}"
    for table in repo.glob("multirun/**/results.md"):
        _check_sweep_report(table.parent, block)


def _check_sweep_report(sweep: Path, block: Block) -> None:
    """What a sweep of the main job wrote (``python -m weightsync -m ...``): one table, CSV and plot of every job
    it ran (a folder each), each job's row of every model, verified."""
    where = f"{block.name}: {sweep.relative_to(sweep.parents[2])}"
    lines = (sweep / "results.md").read_text().splitlines()
    column = {name.strip("| "): i for i, name in enumerate(lines[0].split(" | "))}
    rows = [line.split(" | ") for line in lines[2:]]
    jobs = sorted(int(d.name) for d in sweep.iterdir() if d.is_dir() and d.name.isdigit())
    assert jobs and sorted({int(row[0].strip("| ")) for row in rows}) == jobs, (where, rows, jobs)
    models = [sorted(row[column["model"]] for row in rows if int(row[0].strip("| ")) == job) for job in jobs]
    assert all(m == models[0] for m in models), (where, rows)  # every job, every model
    assert all(row[column["verified"]] == "yes" for row in rows), (where, rows)
    csv = (sweep / "results.csv").read_text().splitlines()
    assert len(csv) == len(rows) + 1 and all(",yes," in line for line in csv[1:]), (where, csv)
    assert (sweep / "results.png").read_bytes()[:4] == b"\x89PNG", where
