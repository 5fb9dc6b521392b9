"""The examples and the benchmark run as a user would run them (no timing is asserted)."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._netns import loopback_only_network
from weightsync.app.early import PRELOAD
from weightsync.core.timing import deadline_after, wait_until

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


def test_torchrl_example_learns_with_every_batch_on_the_sent_weights():
    pytest.importorskip("torchrl")
    out = subprocess.run(
        [sys.executable, "examples/torchrl_collector.py", "--iters", "30"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "learned: yes" in out.stdout
    assert "scheme shut down" in out.stdout


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


SMALL = ["rounds=2", "progress=false", "models.policy.size_mb=1", "models.value.size_mb=0.25"]


def _run(args, cwd=ROOT, timeout=240):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_authentication_benchmark_times_sends_with_and_without_the_mac():
    # (it reached into the scheme's internals, which moved, and nothing ran it until its next use)
    out = _run(["benchmarks/bench_auth.py", "--mb", "1", "--rounds", "2", "--bucket-mb", "none"], timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| AES-GMAC (cryptography) |" in out.stdout and "| 1 MB | one message | 2 |" in out.stdout, out.stdout


def test_engine_benchmark_runs_against_the_raw_engine(tmp_path):
    md = tmp_path / "engines.md"
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_engines.py",
            "--engines",
            "distributed",
            "--mb",
            "1",
            "--rounds",
            "2",
            "--markdown",
            str(md),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| distributed |" in md.read_text() and "failed" not in md.read_text()


def test_bare_line_benchmark_checks_every_digest_and_ack():
    # (the bound the distributed rows are held against: its workers raise on bytes or acks that do not check)
    out = _run(["benchmarks/bench_bare_line.py", "--mb", "0.25", "--rounds", "3"], timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| bare steps on the lines |" in out.stdout and "failed" not in out.stdout, out.stdout


def test_main_job_single_run_verifies_and_keeps_secrets_out_of_its_outputs(tmp_path):
    # bfloat16 on the wire rounds by design: the job checks the workers hold the trainer's weights so rounded
    run = ["scheme=distributed", "scheme.transport.wire_dtype=bfloat16", "schemes.value=shared_mem"]
    out = _run(["-m", "weightsync", *SMALL, *run, f"hydra.run.dir={tmp_path}"])
    assert out.returncode == 0, out.stderr
    # (the transport is told too: scheme/transport=shared_mem was seen only in a sweep's overrides, an audit)
    assert "| distributed | policy | distributed |" in out.stdout
    assert "| shared_mem | value | shared_mem |" in out.stdout
    assert out.stdout.count("| yes |") == 2
    story = (tmp_path / "weightsync.log").read_text()  # Hydra's job log holds what the job did
    assert "model 'policy' (1 MB in 8 tensors): DistributedWeightSyncScheme to 2 workers" in story, story
    assert "options {'transport': 'distributed', " in story, story
    assert "'wire_dtype': 'bfloat16'" in story and story.count("verified: yes") == 2, story
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "results.json" for p in files)
    for path in files:
        assert "authkey" not in path.read_text(errors="replace"), f"{path} mentions the auth key"


def test_a_main_job_ended_by_sigterm_shuts_its_schemes_down_and_leaves_no_key_file(tmp_path):
    """``timeout`` or a scheduler ends a job with SIGTERM: the job's schemes shut down as at Ctrl-C (their key
    files, workers and shared memory go), and it exits 143. Before, Python's default ended it where it stood, and
    each run left its models' key files behind."""
    import os
    import signal

    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    keys = runtime / f"weightsync-{os.getuid()}"
    job = subprocess.Popen(
        [sys.executable, "-m", "weightsync", "rounds=100000", *SMALL[1:], f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert wait_until(lambda: keys.is_dir() and len(list(keys.iterdir())) >= 2, deadline_after(120), 0.1)
        job.send_signal(signal.SIGTERM)
        out, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 143, out
    assert list(keys.iterdir()) == [], out


def test_a_main_job_that_drops_a_killed_worker_names_it_at_once(tmp_path):
    """``scheme.on_failure=drop``: the scheme drops a worker killed mid-run and goes on; the job, which checks
    every worker's report of each version, waited for the dead one's until ``worker_timeout`` (120 s)."""
    import signal

    import psutil

    job = subprocess.Popen(
        [sys.executable, "-m", "weightsync", "rounds=100000", "scheme.on_failure=drop", *SMALL[1:],
         f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:

        def workers() -> list:
            below = psutil.Process(job.pid).children(recursive=True)
            return [p for s in below if "forkserver" in " ".join(s.cmdline()) for p in s.children()]

        story = tmp_path / "weightsync.log"  # (Hydra's job log: the job says when its rounds begin)
        began = lambda: story.exists() and "rounds begin" in story.read_text()  # noqa: E731
        assert wait_until(lambda: len(workers()) == 2 and began(), deadline_after(120), 0.1)
        workers()[0].send_signal(signal.SIGKILL)
        out, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 2, out
    assert re.search(r"worker processes \[[01]\] exited \(codes \[-9\]\) before reporting", out), out


_FAILING_JOB = """
import weightsync.app.main as main
row = dict(scheme="multiprocess", model_mb=1.0, workers=1, sync=True, rounds=2, median_ms=1.0, p95_ms=1.0, gb_s=1.0)
verdicts = iter(["yes", "NO [(0, 2)]", "no reports", "yes"])
main.run_job = lambda cfg, progress=None: [{**row, "model": m, "verified": next(verdicts)} for m in ("a", "b")]
main.main()
"""


def test_main_job_exits_1_on_a_failed_verification_after_every_sweep_job_ran(tmp_path):
    """The job's verdict is its exit status: a run (or a sweep) that printed a failed verification exits 1."""
    single = _run(["-c", _FAILING_JOB, "progress=false", f"hydra.run.dir={tmp_path / 'run'}"])
    assert single.returncode == 1, single.stderr
    assert "| b | " in single.stdout and "the workers' weights did not match the trainer's for b\n" in single.stderr
    sweep = _run(["-c", _FAILING_JOB, "-m", "seed=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert sweep.returncode == 1, sweep.stderr
    assert (tmp_path / "sweep" / "results.md").read_text().count("| multiprocess |") == 4  # both jobs ran
    assert "did not match the trainer's for 0:b, 1:a\n" in sweep.stderr


_ERRING_JOB = """
import weightsync.app.main as main
from weightsync.errors import ConfigurationError
row = dict(scheme="multiprocess", model_mb=1.0, workers=1, sync=True, rounds=2, median_ms=1.0, p95_ms=1.0, gb_s=1.0)

def run_job(cfg, progress=None):
    if cfg.seed == 1:
        raise ConfigurationError("schemes.policy: timeout must be a positive number of seconds, got -1.0")
    if cfg.seed == 3:
        raise KeyError("an interpolation that names nothing")
    return [{**row, "model": "a", "verified": "yes"}]

main.run_job = run_job
main.main()
"""


def test_a_sweep_job_that_ends_on_an_error_is_named_at_the_end_and_the_others_still_run(tmp_path):
    """One job of a multirun refused (its overrides a bad value) ended the whole sweep: the jobs after it never ran,
    and no report was written. Now each job runs, the report holds the failed one's error, and the sweep exits 2 as
    a single run refused so does."""
    sweep = _run(["-c", _ERRING_JOB, "-m", "seed=1,2,3", f"hydra.sweep.dir={tmp_path}"])
    assert sweep.returncode == 2, sweep.stderr
    table = (tmp_path / "results.md").read_text()
    assert "| 0 |  | - |" in table and "| error: ConfigurationError: schemes.policy: timeout" in table, table
    assert "| 1 | multiprocess | a |" in table and (tmp_path / "results.png").exists()
    assert "| 2 |  | - |" in table and "| error: KeyError: 'an interpolation that names nothing' |" in table, table
    assert "sweep jobs that ended on an error: 0 (ConfigurationError: schemes.policy: timeout" in sweep.stderr
    assert "2 (KeyError: 'an interpolation that names nothing')" in sweep.stderr


def test_main_job_without_ray_says_which_extra_to_install(tmp_path):
    hidden = "import sys; sys.modules['ray'] = None; import weightsync.app.main as m; m.main()"  # as if not installed
    out = _run(["-c", hidden, "scheme=ray", "num_workers=1", *SMALL, f"hydra.run.dir={tmp_path}"], timeout=60)
    assert out.returncode == 2
    one_line = "weightsync: error: the Ray schemes need Ray: pip install 'weightsync[ray]'"
    assert out.stderr.strip() == one_line, out.stderr


def test_main_job_runs_ray_actors_beside_worker_processes(tmp_path):
    # One model on a Ray-hosted module (one actor), the other on shared memory (one process).
    with loopback_only_network():
        out = _run(
            [
                "-m",
                "weightsync",
                "scheme=ray_module_transform",
                "schemes.value=shared_mem",
                "num_workers=1",
                *SMALL,
                f"hydra.run.dir={tmp_path}",
            ]
        )
    assert out.returncode == 0, out.stderr
    assert "| ray_module_transform | policy |" in out.stdout and "| shared_mem | value |" in out.stdout
    assert out.stdout.count("| yes |") == 2


def test_main_job_help_lists_the_groups_it_takes_and_only_those():
    from weightsync.config import SCHEMES, TRANSPORTS

    out = _run(["-m", "weightsync", "--help"])
    assert out.returncode == 0
    listed = out.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    groups = dict(re.findall(r"^([\w/]+): (.+)$", listed, re.M))
    assert groups == {"scheme": ", ".join(sorted(SCHEMES)), "scheme/transport": ", ".join(sorted(TRANSPORTS))}
    # each works on this job's command line
    works = _run(["-m", "weightsync", "scheme=shared_mem", "scheme/transport=mp", "--cfg", "job"])
    assert works.returncode == 0 and "_target_: weightsync.MPSettings" in works.stdout, works.stderr


def test_the_main_jobs_forkserver_starts_before_its_imports_and_ends_with_it(tmp_path):
    """``python -m weightsync`` starts the forkserver its workers come from before it imports the app (the two
    imports overlap: 5.4 s against 6.9 s for the default job), unless its command line says no worker is forked;
    the server exits with the run, even one that fails at once."""
    import psutil

    from weightsync.app.early import may_fork_workers

    assert may_fork_workers([]) and may_fork_workers(["scheme=shared_mem", "start_method=forkserver"])
    for argv in (["--help"], ["--cfg", "job"], ["--shell-completion", "install=bash"], ["start_method=spawn"]):
        assert not may_fork_workers(argv), argv
    run = subprocess.Popen(
        [sys.executable, "-m", "weightsync", "scheme=pigeon", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    servers: list[psutil.Process] = []

    def seen() -> bool:  # (a process has no event for "a child of mine exec'd": looked at every 5 ms)
        with contextlib.suppress(psutil.NoSuchProcess):
            servers[:] = [c for c in psutil.Process(run.pid).children() if "forkserver" in " ".join(c.cmdline())]
        return bool(servers) or run.poll() is not None

    wait_until(seen, deadline_after(60), 0.005)
    _, err = run.communicate(timeout=120)
    assert run.returncode != 0 and b"Could not find 'scheme/pigeon'" in err
    assert servers, "no forkserver while the app imported"
    _, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, "the forkserver outlived the run"


def test_the_jobs_forkserver_ends_at_its_exits_start_with_its_streams_flushed():
    """The server's teardown of the torch it imported took 0.9 s after the job ended, and whatever read the job's
    output (the server holds its stdout and stderr) waited for it: the server ends as its exit begins."""
    assert PRELOAD[-1] == "weightsync.app.forkserver_exit"
    out = _run(["-c", "import atexit; atexit.register(print, 'torn down')\nimport weightsync.app.forkserver_exit\n"
                "print('out', end='')\nraise SystemExit"])  # fmt: skip  # (how the server ends: no status)
    assert (out.returncode, out.stdout, out.stderr) == (0, "out", "")


def test_the_main_job_ends_its_process_as_sys_exit_would_once_its_threads_and_atexit_callbacks_are_done(tmp_path):
    """``main()`` skips the interpreter's teardown of its modules (0.7 to 1.3 s with torch loaded), not what an exit
    does that matters: atexit callbacks run, streams are flushed, the status is ``sys.exit``'s, and a thread that
    is not a daemon is waited for (then by the usual exit)."""
    leave = "import atexit, sys, threading, time, weightsync.app.main as m\n"
    atexit_ran = tmp_path / "atexit"
    out = _run(["-c", leave + f"atexit.register(open({str(atexit_ran)!r}, 'w').write, 'ran')\n"
                "print('out', end='')\nm._leave('a message')"])  # fmt: skip
    assert (out.returncode, out.stdout, out.stderr.strip()) == (1, "out", "a message")
    assert atexit_ran.read_text() == "ran"
    thread_ran = tmp_path / "thread"
    slow = f"threading.Thread(target=lambda: (time.sleep(0.5), open({str(thread_ran)!r}, 'w').write('ran'))).start()"
    out = _run(["-c", leave + slow + "\nm._leave(3)"])
    assert out.returncode == 3 and thread_ran.read_text() == "ran", out.stderr
    assert _run(["-c", leave + "m._leave(None)"]).returncode == 0


@pytest.mark.parametrize(
    "override, message",
    [
        ("scheme=pigeon", "Could not find 'scheme/pigeon'"),
        ("num_workers=many", "num_workers"),
        ("start_method=pigeon", "start_method must be one of"),
        ("scheme.timeout=-1", "timeout must be a positive number"),
        ("scheme=distributed scheme.transport.backend=mpi", "backend must be 'gloo' or 'nccl'"),
        ("scheme=ray_module_transform", "scheme: ray_module_transform hosts the module in ONE actor; run it with"),
    ],
)
def test_main_job_bad_overrides_fail_before_any_worker_starts(tmp_path, override, message):
    out = _run(["-m", "weightsync", *override.split(), f"hydra.run.dir={tmp_path}"], timeout=60)
    assert out.returncode != 0
    assert message in out.stderr
    assert not (tmp_path / "results.json").exists()


def test_hydra_app_example_shows_its_overrides_take_effect(tmp_path):
    # (Its README's commands run in tests/test_docs.py.)
    override = ["weightsync/scheme=shared_mem", "weightsync.scheme.sync=false", "weightsync.scheme.timeout=10"]
    out = _run(["examples/hydra_app/train.py", "iterations=3", *override, f"hydra.run.dir={tmp_path}"])
    assert out.returncode == 0, out.stderr
    assert "best mean return" in out.stdout
    story = (tmp_path / "train.log").read_text()  # the overrides can be seen to take effect, in the job's log
    assert "SharedMemWeightSyncScheme, 2 workers" in story and "'sync': False, 'timeout': 10.0" in story, story


def test_sweep_plot_draws_one_line_per_combination_of_every_swept_setting():
    from weightsync.app.report import series_labels

    def row(overrides, workers=1):
        return {"scheme": "shared_mem", "workers": workers, "overrides": overrides}

    swept = [
        row("scheme=shared_mem scheme.background_thread=false num_workers=1 rounds=2 models.policy.size_mb=4"),
        row("scheme=shared_mem scheme.background_thread=true num_workers=1 rounds=2 models.policy.size_mb=8"),
    ]
    assert series_labels(swept) == ["scheme.background_thread=false", "scheme.background_thread=true"]
    assert series_labels([row(""), row("", 2)]) == ["shared_mem (1 worker)", "shared_mem (2 workers)"]


@pytest.mark.timeout(300)  # about 2 minutes: every case but the engines' in small
def test_benchmark_suite_prints_every_case_against_its_target_and_plots(tmp_path):
    md, png = tmp_path / "suite.md", tmp_path / "suite.png"
    out = _run(
        [
            "benchmarks/suite.py",
            *("--schemes", "shared_mem", "distributed"),
            *("--cases", "floors", "tensors", "scaling", "memory", "plot"),
            *("--mb", "1", "--rounds", "2", "--sizes", "1", "--memory-workers", "2"),
            *("--markdown", str(md), "--png", str(png)),
        ],
        timeout=420,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    table = md.read_text()
    for row in (
        "| shared_mem, 1 MB |",
        "| distributed, 1 MB |",
        "| shared_mem: 2000 tensors vs 1 |",  # two senders alternating in one process
        "| shared_mem, flatten_sender: 2000 tensors vs 1 |",
        "| distributed: 2000 tensors vs 1 |",  # two schemes, each with its worker processes, alternating
        "| distributed, flatten_sender: 2000 tensors vs 1 |",
        "| shared_mem, 1 MB, 1 -> 8 workers |",
        "| shared_mem: sender's extra memory, 2 workers |",
        "| distributed | ",
    ):
        assert row in table, table
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_sweep_reports_its_own_jobs_not_an_earlier_sweeps_in_the_same_folder(tmp_path, capsys):
    """Two sweeps into one ``hydra.sweep.dir``: the second's table listed the first's jobs too, and its exit
    status blamed a job of the first that had failed."""
    import json
    import os
    import time

    from omegaconf import OmegaConf

    from weightsync.app.report import RESULTS_FILE, SweepReport, error_row

    def job(name: str, rows: list[dict]) -> Path:
        (tmp_path / name).mkdir(exist_ok=True)
        path = tmp_path / name / RESULTS_FILE
        path.write_text(json.dumps(rows))
        return path

    ok = {"scheme": "shared_mem", "model": "policy", "model_mb": 1.0, "workers": 2, "sync": True, "rounds": 2,
          "median_ms": 1.0, "p95_ms": 1.0, "gb_s": 1.0, "verified": "yes", "overrides": "num_workers=2"}  # fmt: skip
    earlier = job("1", [{**error_row(ValueError("an earlier sweep's job failed")), "overrides": "x=1"}])
    os.utime(earlier, (time.time() - 3600, time.time() - 3600))
    report = SweepReport()
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    report.on_multirun_start(config)
    job("0", [ok])
    report.on_multirun_end(config)  # (no exit: this sweep's one job passed)
    table = (tmp_path / "results.md").read_text()
    assert "| 0 | shared_mem |" in table and "an earlier sweep" not in table and "| 1 |" not in table
    assert "an earlier sweep" not in capsys.readouterr().err
    assert (tmp_path / "results.png").exists()
    os.utime(tmp_path / "results.png", (time.time() - 3600, time.time() - 3600))
    # A sweep whose jobs timed nothing draws no plot: the earlier sweep's is not announced as its own.
    report.on_multirun_start(config)
    job("0", [{**error_row(ValueError("this sweep's job failed")), "overrides": "x=2"}])
    with pytest.raises(SystemExit):
        report.on_multirun_end(config)
    assert not (tmp_path / "results.png").exists()
