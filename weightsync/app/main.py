"""``python -m weightsync``: the Hydra app. See ``conf/config.yaml`` for what it runs."""

from __future__ import annotations

import json
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


def _register() -> None:
    ConfigStore.instance().store(name="job_schema", node=JobConfig)
    register_scheme_group("scheme")  # the job's own `scheme` group, so `scheme=shared_mem` works


_register()


@hydra.main(version_base="1.3", config_path="pkg://weightsync.conf", config_name="config")
def _app(cfg: DictConfig) -> None:
    from tqdm import tqdm

    def progress(rounds):
        return tqdm(rounds, desc="rounds", unit="round", disable=not cfg.progress, leave=False)

    try:
        rows = run_job(cfg, progress=progress)
    except WeightSyncError as exc:
        print(f"weightsync: error: {exc}", file=sys.stderr)
        sys.exit(2)
    hydra_cfg = HydraConfig.get()
    overrides = " ".join(hydra_cfg.overrides.task)
    rows = [{**row, "overrides": overrides} for row in rows]
    (Path(hydra_cfg.runtime.output_dir) / RESULTS_FILE).write_text(json.dumps(rows, indent=1))
    print(markdown_table(rows))
    failed = failed_models(rows)
    if failed and hydra_cfg.mode != RunMode.MULTIRUN:  # a sweep's jobs all run; its end says what failed
        print(verification_error(failed), file=sys.stderr)
        sys.exit(1)


def main() -> None:
    """Entry point of ``python -m weightsync`` and the ``weightsync`` command."""
    _app()
