"""From the client's runs to the figures of each model: medians, spread, speedups; and their
MLflow runs (``bench:<model>``, every load point a step)."""

from __future__ import annotations

import statistics
from pathlib import Path

from pipeline.bench.measure import ModelRecord
from pipeline.bench.workloads import Workload
from pipeline.core import hardware, tracking
from pipeline.core.artifacts import BenchSummary, ModelBench, WorkloadFigures
from pipeline.core.provenance import vllm_version
from pipeline.core.variant import BASELINE
from pipeline.serve import EngineSettings

STAGE = "bench"
# Every load point is logged as a step (step = concurrency) under "sweep.<metric>"; the plain
# name holds the headline load point's figure (MLflow shows a metric's highest step as its
# value, so the two cannot share a name).
SWEEP = "sweep."
# vllm bench serve result key -> qpipe metric name.
CLIENT_METRICS = {
    "output_throughput": tracking.OUTPUT_TOKENS_PER_S,
    "request_throughput": tracking.REQUESTS_PER_S,
    "median_ttft_ms": tracking.TTFT_MS_P50,
    "p99_ttft_ms": tracking.TTFT_MS_P99,
    "median_itl_ms": tracking.ITL_MS_P50,
    "p99_itl_ms": tracking.ITL_MS_P99,
    "median_e2el_ms": tracking.E2E_MS_P50,
}


def pairing(target: str) -> str:
    """How each speedup ratio pairs its two runs (said wherever a speedup is shown)."""
    return ("interleaved: the models alternate run by run, on the same prompts" if target == "cpu"
            else "sequential: each model's repeats back to back, on the same prompts")


def _spread(values: list[float]) -> dict[str, float]:
    mid = statistics.median(values)
    return {"": mid, "_min": min(values), "_max": max(values),
            "_rel_spread": (max(values) - min(values)) / mid if mid else 0.0}


def _point(results: list[dict], base_runs: list[dict]) -> dict[str, float]:
    """The figures of one load point; speedup: the median of the per-repeat ratios (each
    repeat's variant run over the baseline's run of the same prompts), with their min and max
    as its spread (one estimator for both)."""
    stats: dict[str, float] = {}
    for src, metric in CLIENT_METRICS.items():
        values = [r[src] for r in results if r.get(src) is not None]
        if values:  # how well the repeats agree: throughput's relative spread
            stats.update({f"{metric}{k}": v for k, v in _spread(values).items()
                          if k != "_rel_spread" or src == "output_throughput"})
    if base_runs and len(base_runs) == len(results):
        ratios = [v["output_throughput"] / b["output_throughput"]
                  for v, b in zip(results, base_runs, strict=True)]
        stats.update({f"{tracking.SPEEDUP}{k}": v for k, v in _spread(ratios).items()
                      if k != "_rel_spread"})
    return stats


def summarize(records: dict[str, ModelRecord], loads: list[Workload]) -> dict[str, ModelBench]:
    """Medians and spread per model, workload and load point; speedup against the baseline."""
    base = records[BASELINE]
    by_name = {w.name: w for w in loads}
    out: dict[str, ModelBench] = {}
    for name, record in records.items():
        figures: dict[str, WorkloadFigures] = {}
        # a model that failed mid-run has no complete measurement: no figures from it
        for key, points in (record.runs.items() if record.status == "ok" else ()):
            base_points = base.runs.get(key, {}) if base.status == "ok" else {}
            queries, hits = record.prefix_counters.get(key, [0.0, 0.0])
            workload = by_name.get(key)
            expected = workload.expected_prefix_hit_rate(
                int(record.kv.get("kv_block_size") or 0), workload.headline) \
                if workload is not None and workload.compare_prefix_caching else None
            figures[key] = WorkloadFigures(
                points={c: _point(results, base_points.get(c, []) if name != BASELINE else [])
                        for c, results in points.items()},
                prefix_cache_hit_rate=hits / queries if queries else 0.0,
                prefix_cache_hit_tokens=hits, prefix_cache_query_tokens=queries,
                prefix_cache_expected_hit_rate=expected)
        for workload in loads:  # what prefix reuse buys: TTFT with caching off over on
            on = figures.get(workload.name)
            off = figures.get(f"{workload.name}_nocache")
            head = workload.headline
            if on and off and head in on.points and head in off.points:
                on.prefix_cache_ttft_speedup = (off.points[head][tracking.TTFT_MS_P50]
                                                / on.points[head][tracking.TTFT_MS_P50])
        v = record.variant
        out[name] = ModelBench(recipe=v.recipe, status=record.status, identity=v.identity,
                               format=v.format, serve_command=record.serve_command,
                               reason=record.reason, log=record.log, kv=record.kv,
                               engine=record.engine, peak_memory_bytes=record.peak_memory_bytes,
                               workloads=figures)
    return out


def metric_prefix(workload: Workload, loads: list[Workload]) -> str:
    """The first workload's metrics carry plain names; the others are prefixed by theirs."""
    return "" if workload is loads[0] else f"{workload.name}."


def _metrics(entry: ModelBench, loads: list[Workload]
             ) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    metrics: dict[str, float] = {}
    stepped: list[tuple[str, float, int]] = []
    for workload in loads:
        prefix = metric_prefix(workload, loads)
        for suffix, label in (("", workload.name), ("nocache.", f"{workload.name}_nocache")):
            data = entry.workloads.get(label)
            if not data:
                continue
            for concurrency, stats in data.points.items():
                for metric, value in stats.items():
                    stepped.append((f"{SWEEP}{prefix}{suffix}{metric}", value, concurrency))
                    if concurrency == workload.headline:
                        metrics[f"{prefix}{suffix}{metric}"] = value
            # the hit counters of every measured run: 0 in a sweep, the prefix's share in a
            # prefix comparison
            metrics.update({f"{prefix}{suffix}{k}": v for k, v in data.counters().items()})
    metrics.update({k: float(v) for k, v in entry.kv.items()})
    if entry.engine.get(tracking.ENGINE_WEIGHT_MEMORY_BYTES):
        metrics[tracking.ENGINE_WEIGHT_MEMORY_BYTES] = entry.engine[
            tracking.ENGINE_WEIGHT_MEMORY_BYTES]
    if entry.peak_memory_bytes:
        metrics[tracking.SERVER_PEAK_MEMORY_BYTES] = entry.peak_memory_bytes
    return metrics, stepped


def log_runs(summary: BenchSummary, loads: list[Workload], settings: EngineSettings,
             out: Path) -> None:
    """One MLflow run per model (``bench:<model>``)."""
    prof = hardware.profile()
    for name, entry in summary.models.items():
        metrics, stepped = _metrics(entry, loads) if entry.status == "ok" else ({}, [])
        params = {tracking.PARAM_BASELINE: summary.baseline, tracking.PARAM_RECIPE: entry.recipe,
                  "format": entry.format, "workloads": ",".join(w.name for w in loads),
                  "serve_target": summary.target, "vllm": vllm_version(),
                  "speedup_pairing": summary.speedup_pairing,
                  tracking.PARAM_HARDWARE: prof.describe()[:500], **settings.as_params()}
        if entry.serve_command:
            params["serve_command"] = entry.serve_command[:5000]
        if entry.engine.get("scheme"):
            params["engine_scheme"] = entry.engine["scheme"][:500]
            params["engine_kernels"] = "; ".join(entry.engine.get("kernels", []))[:500] or "-"
        if entry.status != "ok":
            params["serving_reason"] = entry.reason[:500]
            if entry.log:
                params["serving_log"] = entry.log[:500]
        tracking.log_run(
            summary.baseline, STAGE, f"bench:{name}", params, metrics,
            tags={tracking.TAG_CACHE_KEY: summary.key, tracking.TAG_SERVING_STATUS: entry.status,
                  tracking.TAG_HARDWARE_KEY: prof.key()},
            artifacts=[out / BenchSummary.FILE,
                       *sorted((out.parent / "logs" / summary.key).glob(f"server-{name}-*.log"))],
            stepped=stepped)
