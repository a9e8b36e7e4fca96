"""The comparison published: the join, the report files and the MLflow runs (the last step of
``make all``, and ``make compare`` alone: pipeline/campaign/compare_recorded.py)."""

from __future__ import annotations

from pathlib import Path

from pipeline.core import log as qlog
from pipeline.core.artifacts import Baseline, Comparison, CostTarget, Failure, PlanTarget
from pipeline.core.paths import default_tracking_uri
from pipeline.report import compare, render
from pipeline.report.log import log_comparison, run_meta

log = qlog.get("compare")


def compare_and_log(base: Baseline, recipes: list[str] | None, target: PlanTarget,
                    campaign: str = "compare", track: bool = True,
                    failures: list[Failure] | None = None, objective: str = "speed",
                    cost_target: CostTarget | None = None, per_variant: bool = False,
                    threshold: float | None = None, seconds: float | None = None
                    ) -> tuple[Comparison, list[Path]]:
    """Join, write ``artifacts/reports/<baseline>/`` and log the parent and child runs
    (``seconds``: how long the campaign took, the parent run's span)."""
    comparison = compare.collect(base, recipes, target, failures, objective, cost_target,
                                 per_variant, threshold)
    meta = run_meta(comparison, campaign)
    comparison = comparison.model_copy(update={"meta": meta})
    out = Comparison.directory(base.name)
    files = render.write(comparison, out, meta)
    print(render.terminal(comparison))
    print(f"\nreport: {out / 'report.html'} (also comparison.md, .csv, .json)")
    if track:
        run_id = log_comparison(comparison, files, meta, seconds)
        log.info(f"recorded in MLflow ({default_tracking_uri()}): parent run {run_id} with "
                 f"{len(comparison.rows)} child runs; `make ui` to review")
    return comparison, files
