"""Result tables of the main job: printed, and for a multirun combined into Markdown, CSV and a plot."""

from __future__ import annotations

import csv
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

__all__ = [
    "COLUMNS",
    "SweepReport",
    "error_row",
    "failed_jobs",
    "failed_models",
    "markdown_table",
    "series_labels",
    "verification_error",
    "write_sweep_report",
]

log = logging.getLogger("weightsync.app")

COLUMNS = [
    "scheme", "model", "transport", "model_mb", "workers", "sync", "rounds", "median_ms", "p95_ms", "gb_s", "verified"
]  # fmt: skip
RESULTS_FILE = "results.json"


def markdown_table(rows: list[dict[str, Any]], columns: list[str] = COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def failed_models(rows: list[dict[str, Any]]) -> list[str]:
    """The rows whose verification failed (a report that did not match, or none at all), as ``job:model``
    (``model`` for a single run). A row passes with ``yes``, or ``n/a`` where the scheme moves nothing; a sweep's
    job that ended on an error is :func:`failed_jobs`'."""
    return [
        f"{row['job']}:{row['model']}" if "job" in row else str(row["model"])
        for row in rows
        if not (row["verified"] == "yes" or str(row["verified"]).startswith(("n/a", ERROR)))
    ]


ERROR = "error: "


def error_row(exc: BaseException) -> dict[str, Any]:
    """The one row of a sweep's job that ended on ``exc`` (its configuration refused, its workers lost)."""
    said = " ".join(str(exc).split())
    return {"model": "-", "verified": f"{ERROR}{type(exc).__name__}: {said[:300]}"}


def failed_jobs(rows: list[dict[str, Any]]) -> list[str]:
    """The sweep's jobs that ended on an error, as ``job (the error)``."""
    return [f"{row['job']} ({row['verified'][len(ERROR) :]})" for row in rows if str(row["verified"]).startswith(ERROR)]


def verification_error(failed: list[str]) -> str:
    return f"weightsync: error: the workers' weights did not match the trainer's for {', '.join(failed)}"


def write_sweep_report(sweep_dir: Path, since: float = 0.0) -> list[dict[str, Any]]:
    """Combine every job's ``results.json`` under ``sweep_dir`` written at ``since`` (a time stamp of the file
    system's) or later (the sweep's own: an earlier sweep into the same folder left its jobs') into results.md,
    results.csv and results.png (an earlier sweep's plot goes where this one's jobs timed nothing)."""
    rows = []
    for path in sorted(sweep_dir.glob(f"*/{RESULTS_FILE}"), key=lambda p: (len(p.parent.name), p.parent.name)):
        if path.stat().st_mtime < since:
            continue
        for row in json.loads(path.read_text()):
            rows.append({"job": path.parent.name, **row})
    if not rows:
        log.warning("no %s found under %s", RESULTS_FILE, sweep_dir)
        return rows
    columns = ["job", *COLUMNS, "overrides"]
    (sweep_dir / "results.md").write_text(markdown_table(rows, columns) + "\n")
    with open(sweep_dir / "results.csv", "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    timed = [row for row in rows if "median_ms" in row]  # (a job that ended on an error timed nothing)
    plot = sweep_dir / "results.png"
    if timed:
        _plot(timed, plot)
    elif plot.exists() and plot.stat().st_mtime < since:  # (not this sweep's)
        plot.unlink()
    return rows


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Median send time against model size, one line per job setting (:func:`series_labels`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(10, 5))
    series: dict[str, list[tuple[float, float]]] = {}
    for row, label in zip(rows, series_labels(rows)):
        series.setdefault(label, []).append((float(row["model_mb"]), float(row["median_ms"])))
    for label, points in sorted(series.items()):
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    sizes = sorted({float(row["model_mb"]) for row in rows})
    ax.set_xticks(sizes)  # every size measured, labelled as it is (no 2x10^0)
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("model size (MB)")
    ax.set_ylabel("median send (ms)")
    ax.set_title("weightsync: send time until every worker applied and acked")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the lines, not over them
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def series_labels(rows: list[dict[str, Any]]) -> list[str]:
    """Each row's line in the plot: the overrides its job was run with that differ between jobs (what the sweep
    varied, every key of it), less those that set model sizes (the x axis); the scheme and worker count where
    nothing else tells the jobs apart."""

    def settings(row: dict[str, Any]) -> dict[str, str]:
        pairs = (item.split("=", 1) for item in str(row.get("overrides", "")).split() if "=" in item)
        return {key: value for key, value in pairs if not key.startswith(("models.", "hydra."))}

    every = [settings(row) for row in rows]
    varied = sorted({key for one in every for key in one if len({str(s.get(key)) for s in every}) > 1})
    labels = []
    for row, one in zip(rows, every):
        if varied:
            labels.append(", ".join(f"{key}={one.get(key, '-')}" for key in varied))
        else:
            n = int(row["workers"])
            labels.append(f"{row['scheme']} ({n} worker{'' if n == 1 else 's'})")
    return labels


class SweepReport(Callback):
    """Hydra callback: at the end of a multirun, write and print the combined table of its jobs."""

    started = 0.0

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # The time the jobs' files are compared with, by the file system's clock (where a job on another host
        # writes them, its clock may not be this host's): a mark of this sweep's start, in its folder.
        mark = Path(config.hydra.sweep.dir) / ".weightsync-sweep"
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(f"{time.time()}\n")
        self.started = mark.stat().st_mtime

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_sweep_report(sweep_dir, self.started)
        if rows:
            plot = ", results.png" if (sweep_dir / "results.png").exists() else ""  # (no job timed: none)
            print(f"\nAll jobs ({sweep_dir}/results.md, results.csv{plot}):\n")
            print(markdown_table(rows, ["job", *COLUMNS, "overrides"]))
        failed, erred = failed_models(rows), failed_jobs(rows)
        if erred:
            print(f"weightsync: error: sweep jobs that ended on an error: {', '.join(erred)}", file=sys.stderr)
        if failed:
            print(verification_error(failed), file=sys.stderr)
        if erred or failed:  # after every job ran and the table is written: a sweep exits as a single run does
            sys.exit(2 if erred else 1)
