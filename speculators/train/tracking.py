"""Experiment tracking of a training run: which trackers ``train.report_to`` may name, the run's tracker ids
(``tracking.json``) and an eval report logged into the training run's trackers (rank-free helpers; the
trainer, :mod:`speculators.train.trainer`, starts and feeds the trackers).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from ..errors import SpeculatorsError

TRACKING_NAME = "tracking.json"  # the run's tracker ids (wandb run id, project): resumed by --resume and eval


def check_report_to(report_to: list[str]) -> None:
    """Check that every tracker of ``train.report_to`` can be used, before anything runs.

    Raises:
        SpeculatorsError: ``wandb`` is listed and the ``wandb`` package cannot be imported (one line naming
            ``train.report_to``, how to install it and what is allowed).
    """
    if "wandb" in report_to:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise SpeculatorsError("train.report_to lists wandb, but the wandb package is not installed: "
                                   "pip install 'speculators[wandb]' (or wandb), or remove wandb from "
                                   "train.report_to (allowed: tensorboard, wandb; [] = train_log.jsonl only)") from None


def _wandb_project() -> str:
    """The W&B project: ``$WANDB_PROJECT``, else ``speculators``."""
    return os.environ.get("WANDB_PROJECT") or "speculators"


def _tracking_ids(run_dir: Path) -> dict:
    """The run's tracker ids (``tracking.json``; ``{}`` when absent or unreadable)."""
    try:
        return json.loads((Path(run_dir) / TRACKING_NAME).read_text())
    except (OSError, ValueError):
        return {}


def _markdown_table(columns: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows])


def report_table(report: dict) -> tuple[list[str], list[list]]:
    """The rows of an eval report (:func:`speculators.evaluation.runner.run_eval`: ``report["rows"]``, one per
    method, K and batch size) as ``(columns, data)``: every scalar field (numbers, strings, booleans,
    None) of the rows, in first-seen order; nested values (lists, dicts) are left out."""
    rows = report.get("rows") or []
    scalar = (int, float, str, bool, type(None))
    columns: list[str] = []
    for r in rows:
        columns += [k for k, v in r.items() if isinstance(v, scalar) and k not in columns]
    return columns, [[r.get(c) for c in columns] for r in rows]


def log_eval_report(checkpoint: str | Path, recipe, report: dict, log=print) -> list[str]:
    """Log an eval report to the trackers of the training run that wrote ``checkpoint`` (rank-free: called
    by ``speculators eval``): for ``wandb`` in ``train.report_to``, the report rows as a ``wandb.Table``
    (``eval/report``) and the headline numbers (``eval/<method>_tau``, ``eval/<method>_speedup``) in the
    SAME W&B run (its id from the run's ``tracking.json``); for ``tensorboard``, the table as Markdown text
    (``eval/report``) at the run's last step.

    Args:
        checkpoint: the evaluated checkpoint (``RUN/final`` or ``RUN/checkpoints/step-N``).
        recipe: its :class:`~speculators.recipe.Recipe` (None: nothing is logged).
        report: the report dict of :func:`speculators.evaluation.runner.run_eval`.
    Returns:
        The trackers logged to (``[]`` when the checkpoint is not inside a run directory that tracked,
        e.g. a Hub download, or wandb is not installed: a log line says so).
    """
    checkpoint = Path(checkpoint)
    run_dir = next((d for d in (checkpoint.parent, checkpoint.parent.parent) if (d / TRACKING_NAME).is_file()), None)
    if recipe is None or run_dir is None or not report.get("rows"):
        return []
    ids, done = _tracking_ids(run_dir), []
    columns, data = report_table(report)
    step = int(ids.get("step", 0))
    if "wandb" in recipe.train.report_to and "wandb" in ids:
        try:
            import wandb
        except ImportError:
            log("eval: wandb is not installed: the report is not logged to the run's W&B run")
        else:
            w = ids["wandb"]
            run = wandb.init(project=w.get("project", _wandb_project()), id=w["id"], resume="allow",
                             dir=str(run_dir), name=run_dir.name)
            headline = {f"eval/{m}_{k}": report[m][k] for m in report.get("methods", [])
                        if isinstance(report.get(m), dict) for k in ("tau", "speedup")
                        if isinstance(report[m].get(k), (int, float))}
            run.log({"eval/report": wandb.Table(columns=columns, data=data), **headline})
            run.finish()
            done.append("wandb")
    if "tensorboard" in recipe.train.report_to:
        from torch.utils.tensorboard import SummaryWriter

        with contextlib.closing(SummaryWriter(str(run_dir / "tensorboard"))) as tb:
            tb.add_text("eval/report", _markdown_table(columns, data), step)
        done.append("tensorboard")
    return done


__all__ = ["TRACKING_NAME", "check_report_to", "report_table", "log_eval_report"]
