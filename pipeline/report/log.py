"""A comparison in MLflow: one parent run with the report as artifacts, one nested child run per
variant carrying the joined figures under the stage runs' metric names."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from pathlib import Path

from pipeline.core import hardware, provenance, tracking
from pipeline.core.artifacts import Comparison, Row
from pipeline.core.variant import BASELINE
from pipeline.report.cost import price_basis
from pipeline.report.render import recommendation_line

STAGE = "campaign"
CHILD_STAGE = "campaign.variant"


def run_meta(comparison: Comparison, campaign: str) -> dict[str, str]:
    """Tags of the parent run, also printed at the foot of the report."""
    meta = {"baseline": comparison.baseline, "git_commit": provenance.git_commit(),
            "hardware": hardware.profile().describe(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "campaign": campaign, "cores": str(os.cpu_count())}
    meta.update({f"version.{k}": v for k, v in provenance.versions().items()})
    return meta


def child_metrics(row: Row) -> dict[str, float]:
    """The joined figures of one variant, under the stage runs' metric names."""
    m: dict[str, float] = {tracking.WEIGHT_BYTES: row.weight_bytes,
                           "weight_ratio": row.weight_ratio}
    for key in (tracking.KV_CACHE_TOKENS, tracking.MAX_CONCURRENCY,
                tracking.KV_CACHE_MEMORY_BYTES, tracking.KV_CACHE_TOKENS_VS_PLANNED,
                tracking.MAX_CONCURRENCY_VS_PLANNED, tracking.KV_PLAN_OFF):
        if key in row.kv:
            m[key] = row.kv[key]
    if row.engine.engine_weight_memory_bytes:
        m[tracking.ENGINE_WEIGHT_MEMORY_BYTES] = row.engine.engine_weight_memory_bytes
    if row.search is not None:
        m["predicted_kl"] = row.search.predicted_kl
        ratio = row.search.ratio(row.divergence.get("kl_div_mean"))
        if ratio is not None:
            m["measured_over_predicted_kl"] = ratio
        if row.search.predicted_speedup:
            m["predicted_speedup"] = row.search.predicted_speedup
    if row.plan is not None:  # at the campaign's plan target (the parent's plan_* params)
        m.update(row.plan.model_dump())
    if row.serving == "ok":
        m.update(row.headline.flat())
        if row.peak_memory_bytes:
            m[tracking.SERVER_PEAK_MEMORY_BYTES] = row.peak_memory_bytes
        m.update(row.prefix)
        if row.capacity is not None:
            m.update(row.capacity.metrics())
        if row.rate_capacity is not None:
            m.update({f"rate.{k}": v for k, v in row.rate_capacity.metrics().items()})
        if row.cost is not None:
            m.update(row.cost.metrics())
    for suite, fig in row.suites.items():
        if fig.recovery_pct is not None:
            m[f"{tracking.SUITE_RECOVERY_PREFIX}{suite}"] = fig.recovery_pct
            if fig.ci_low is not None and fig.ci_high is not None:
                m[f"suite_recovery_pct_ci_low.{suite}"] = fig.ci_low
                m[f"suite_recovery_pct_ci_high.{suite}"] = fig.ci_high
    for key in (tracking.KL_DIV_MEAN, tracking.TOP1_AGREEMENT, tracking.PERPLEXITY):
        if key in row.divergence:
            m[key] = row.divergence[key]
    if row.quantize_seconds is not None:
        m[tracking.QUANTIZE_SECONDS] = row.quantize_seconds
    return m


def _child_params(comparison: Comparison, row: Row) -> dict[str, object]:
    params: dict[str, object] = {
        tracking.PARAM_BASELINE: comparison.baseline, tracking.PARAM_RECIPE: row.recipe,
        tracking.PARAM_SCHEME: row.scheme, "format": row.format, "precision": row.precision,
        "figures_from": row.figures_from}
    if row.threshold is not None:
        params["recovery_threshold_pct"] = row.threshold
    if row.serving_reason:
        params["serving_reason"] = row.serving_reason[:500]
    if row.measurement:
        params["measurement"] = row.measurement
        params["comparable"] = row.comparable
    if row.engine.scheme:
        params["engine_scheme"] = row.engine.scheme[:500]
    if row.engine.kernels_by_layer_text:
        params["engine_kernels_by_layer"] = row.engine.kernels_by_layer_text[:500]
    return params


def _child_tags(row: Row) -> dict[str, str]:
    tags = {tracking.TAG_STAGE: CHILD_STAGE, "serving_status": row.serving,
            "gate": row.gate_status if row.name != BASELINE else "-"}
    if row.eval_backend:
        tags[tracking.TAG_EVAL_BACKEND] = row.eval_backend
    if row.price is not None:  # a cost figure never without whose price it is
        tags["price_basis"] = price_basis(row.price)
        tags["price_source"] = row.price.source[:500]
    if row.search is not None:  # whether the search's prediction held, said here too
        held = row.search.held(row.divergence.get("kl_div_mean"))
        tags["prediction_held"] = "not measured" if held is None else str(held)
    return tags


def log_comparison(comparison: Comparison, files: list[Path], meta: dict[str, str],
                   seconds: float | None = None) -> str:
    """One parent run ``campaign:<name>`` with the report as artifacts, spanning the
    campaign's ``seconds`` when given; one nested child run ``variant:<name>`` per model, and
    under it the quantize, bench and eval runs the campaign made of that model. Every tag,
    param and metric is built before MLflow is called, so a figure that cannot be flattened
    leaves no half-logged campaign run behind."""
    tags = {tracking.TAG_STAGE: STAGE, "qpipe.host": platform.node(),
            **{f"qpipe.{k}": v for k, v in meta.items()},
            "recommendation": comparison.recommendation or "none",
            "failures": "; ".join(f"{f.variant} ({f.stage})"
                                  for f in comparison.failures)[:5000] or "none",
            "mlflow.note.content": recommendation_line(comparison)}
    params = {tracking.PARAM_BASELINE: comparison.baseline,
              "variants": ",".join(r.name for r in comparison.rows),
              "workload": comparison.workload or "-",
              "load_point": comparison.load_point or "-",
              "plan_target": comparison.plan_target.gpu,
              "plan_context": comparison.plan_target.context,
              "plan_max_context": comparison.plan_target.max_context,
              "objective": comparison.objective,
              "measurement": comparison.measurement.get("run", "-"),
              "speedup_pairing": comparison.measurement.get("pairing", "-")[:500]}
    rows = []
    for row in comparison.rows:
        rows.append((row.name, _child_params(comparison, row), _child_tags(row),
                     child_metrics(row)))
    mlflow = tracking.mlflow_module()
    experiment_id = tracking.use_experiment(comparison.baseline)
    name = f"campaign:{meta['campaign']}"
    campaign_id = os.environ.get(tracking.CAMPAIGN_ENV)
    children: dict[str, str] = {}
    with tracking.started_run(experiment_id, name, tags, seconds) as parent:
        mlflow.log_params(params)
        for path in files:
            mlflow.log_artifact(str(path))
        for row_name, child_params, child_tags, metrics in rows:
            with mlflow.start_run(run_name=f"variant:{row_name}", nested=True,
                                  tags=child_tags) as child:
                mlflow.log_params(child_params)
                mlflow.log_metrics(metrics)
                children[row_name] = child.info.run_id
    if campaign_id:  # the stage runs this campaign made, each under its model's run
        tracking.nest_stage_runs(experiment_id, campaign_id, parent.info.run_id, children)
    return parent.info.run_id
