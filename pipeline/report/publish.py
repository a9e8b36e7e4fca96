"""``qpipe compare`` / ``make compare``: the join, the report files and the MLflow runs."""

from __future__ import annotations

from pathlib import Path

from pipeline.core import campaigns, tracking
from pipeline.core import log as qlog
from pipeline.core.artifacts import BaselineRecord, Comparison, CostTarget, PlanTarget
from pipeline.core.paths import default_tracking_uri
from pipeline.core.variant import BaselineLike
from pipeline.report import compare, render
from pipeline.report.log import log_comparison, run_meta
from pipeline.report.settings import CompareSettings

log = qlog.get("compare")


def compare_and_log(base: BaselineLike, recipes: list[str] | None, target: PlanTarget,
                    campaign: str = "compare", track: bool = True,
                    failures: list[dict[str, str]] | None = None, objective: str = "speed",
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


def plan_target(settings: CompareSettings, file: campaigns.CampaignFile) -> PlanTarget:
    """The campaign file's plan target with the command line's overrides."""
    t = file.plan
    return PlanTarget(gpu=settings.gpu or t.gpu, context=settings.context or t.context,
                      max_context=settings.max_context or t.max_context,
                      memory_gb=settings.memory_gb if settings.memory_gb else t.memory_gb)


def run(settings: CompareSettings) -> Comparison:
    """``qpipe compare``: the baseline as its stages recorded it (nothing is re-resolved)."""
    file = campaigns.load(settings.campaign)
    if settings.track:
        tracking.check_store()
    base = BaselineRecord.find(settings.baseline).ref()
    comparison, _ = compare_and_log(base, list(settings.recipes) or None,
                                    plan_target(settings, file), "compare", settings.track,
                                    objective=settings.objective or file.objective,
                                    cost_target=settings.cost.apply(file.cost),
                                    threshold=settings.threshold or file.threshold)
    return comparison
