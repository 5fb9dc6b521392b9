"""``python -m weightsync``: the Hydra app. See ``conf/config.yaml`` for what it runs."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ..config.store import SCHEMES, TRANSPORTS, register_scheme_group
from ..errors import WeightSyncError
from .job import JobConfig, run_job
from .report import RESULTS_FILE, error_row, failed_models, markdown_table, verification_error

__all__ = ["main"]

log = logging.getLogger("weightsync.app")


def _register() -> None:
    ConfigStore.instance().store(name="job_schema", node=JobConfig)
    register_scheme_group("scheme")  # the job's own `scheme` group, so `scheme=shared_mem` works
    # --help lists the group's options as registered: an installed package's engines too (conf/config.yaml)
    OmegaConf.register_new_resolver("weightsync_options", _listed, replace=True)


def _listed(group: str) -> str:
    """The options of the job's group ``group`` (``scheme`` or ``scheme/transport``), for its help."""
    return ", ".join(sorted(SCHEMES if group == "scheme" else TRANSPORTS))


_register()


@hydra.main(version_base="1.3", config_path="pkg://weightsync.conf", config_name="config")
def _app(cfg: DictConfig) -> None:
    from tqdm import tqdm

    def progress(rounds):
        # disable=None: no bar where stderr is not a terminal (a file, a pipe), where it would run into the table
        return tqdm(rounds, desc="rounds", unit="round", disable=None if cfg.progress else True, leave=False)

    hydra_cfg = HydraConfig.get()
    try:
        rows = run_job(cfg, progress=progress)
    except Exception as exc:
        sweeping = hydra_cfg.mode == RunMode.MULTIRUN
        if not sweeping and not isinstance(exc, WeightSyncError):
            raise
        log.error("%s", exc, exc_info=not isinstance(exc, WeightSyncError))
        print(f"weightsync: error: {exc}", file=sys.stderr)
        if not sweeping:
            sys.exit(2)
        rows = [error_row(exc)]  # (a sweep's other jobs run, and its end names this one)
    overrides = " ".join(hydra_cfg.overrides.task)
    rows = [{**row, "overrides": overrides} for row in rows]
    (Path(hydra_cfg.runtime.output_dir) / RESULTS_FILE).write_text(json.dumps(rows, indent=1))
    print(markdown_table(rows))
    for row in (row for row in rows if "median_ms" in row):  # (a sweep's job that ended on an error timed nothing)
        log.info(
            "model %r: median send %s ms, p95 %s ms, %s GB/s over %d rounds; verified: %s", row["model"],
            row["median_ms"], row["p95_ms"], row["gb_s"], row["rounds"], row["verified"],
        )  # fmt: skip
    failed = failed_models(rows)
    if failed and hydra_cfg.mode != RunMode.MULTIRUN:  # a sweep's jobs all run; its end says what failed
        log.error("%s", verification_error(failed))
        print(verification_error(failed), file=sys.stderr)
        sys.exit(1)


def main() -> None:
    """Entry point of ``python -m weightsync`` and the ``weightsync`` command: runs the app, then ends the process
    with its exit status (:func:`_leave`). A SIGTERM (``timeout``, a scheduler's end of a job) ends it as Ctrl-C
    does: its schemes shut down (their workers, key files and shared memory go) and it exits 143."""
    signal.signal(signal.SIGTERM, _terminated)
    try:
        _app()
    except SystemExit as exc:
        _leave(exc.code)
    _leave(0)


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _leave(code: str | int | None) -> NoReturn:
    """End the process with ``code`` (as ``sys.exit`` takes it) once what Python's exit does that matters is done:
    the other threads ended, the atexit callbacks run (logging's flush, multiprocessing's and Ray's shutdowns,
    weakref finalizers), the streams flushed. What it leaves out is the interpreter's teardown of every module,
    which only frees memory: with torch and tensordict loaded it runs garbage collections over their objects,
    0.7 to 1.3 s, a fifth of the default job. Where any of that cannot be done here, the usual exit."""
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)  # (CPython's: what its exit calls)
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if run_exitfuncs is None or others:
        sys.exit(code)
    run_exitfuncs()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # (sys.exit prints a message, and exits 1)
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
