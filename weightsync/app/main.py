"""``python -m weightsync``: the Hydra app. See ``conf/config.yaml`` for what it runs."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from ..config.store import register_scheme_group
from ..errors import WeightSyncError
from .job import JobConfig, run_job
from .report import RESULTS_FILE, failed_models, markdown_table, verification_error

__all__ = ["main"]

log = logging.getLogger("weightsync.app")


def _register() -> None:
    ConfigStore.instance().store(name="job_schema", node=JobConfig)
    register_scheme_group("scheme")  # the job's own `scheme` group, so `scheme=shared_mem` works


_register()


@hydra.main(version_base="1.3", config_path="pkg://weightsync.conf", config_name="config")
def _app(cfg: DictConfig) -> None:
    from tqdm import tqdm

    def progress(rounds):
        # disable=None: no bar where stderr is not a terminal (a file, a pipe), where it would run into the table
        return tqdm(rounds, desc="rounds", unit="round", disable=None if cfg.progress else True, leave=False)

    try:
        rows = run_job(cfg, progress=progress)
    except WeightSyncError as exc:
        log.error("%s", exc)
        print(f"weightsync: error: {exc}", file=sys.stderr)
        sys.exit(2)
    hydra_cfg = HydraConfig.get()
    overrides = " ".join(hydra_cfg.overrides.task)
    rows = [{**row, "overrides": overrides} for row in rows]
    (Path(hydra_cfg.runtime.output_dir) / RESULTS_FILE).write_text(json.dumps(rows, indent=1))
    print(markdown_table(rows))
    for row in rows:
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
    """Entry point of ``python -m weightsync`` and the ``weightsync`` command."""
    _app()
