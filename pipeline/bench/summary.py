"""From the client's runs to the figures of each model: medians, spread, speedups; and their
MLflow runs (``bench:<model>``, every load point a step)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from pathlib import Path

from pipeline.bench.measure import ModelRecord, requests_held, speed_ratios
from pipeline.bench.slo import PILOT, Objective
from pipeline.bench.workloads import Workload
from pipeline.core import hardware, tracking
from pipeline.core.artifacts import (
    CENSORED,
    ESTIMATED,
    UNDECIDED_CEILING,
    BenchSummary,
    Capacity,
    ModelBench,
    PointFigures,
    WorkloadFigures,
)
from pipeline.core.provenance import vllm_version
from pipeline.core.speedup import Looks, speedup
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
    "request_goodput": tracking.GOODPUT,
    "preemptions": tracking.PREEMPTIONS,
}


def pairing(target: str) -> str:
    """How each speedup ratio pairs its two runs (said wherever a speedup is shown)."""
    return ("interleaved: the models run by turns, in a random order per repeat, on the same "
            "prompts" if target == "cpu"
            else "sequential: each model's repeats back to back, on the same prompts")


def _spread(values: list[float]) -> dict[str, float]:
    mid = statistics.median(values)
    return {"": mid, "_min": min(values), "_max": max(values),
            "_rel_spread": (max(values) - min(values)) / mid if mid else 0.0}


def _percentile_metrics(results: list[dict]) -> dict[str, str]:
    """Every latency percentile the client reported (``p99_tpot_ms`` -> ``tpot_ms_p99``)."""
    found = {}
    for key in (results[0] if results else {}):
        head, _, rest = key.partition("_")
        if head[:1] == "p" and head[1:].isdigit() and rest.endswith("_ms"):
            found[key] = _latency_key(rest[:-3], int(head[1:]))
    return found


def point_figures(results: list[dict], base_runs: list[dict], looks: Looks | None
                  ) -> PointFigures:
    """The figures of one load point: medians and spread of the client's metrics; and the
    speedup, from the per-repeat ratios (each repeat's variant run over the baseline's run of
    the same prompts) by the sequential rule of :mod:`pipeline.core.speedup`: its geometric
    mean, its interval at the look that decided, n, the interval's level, the sequential
    p-value of "faster" and the verdict the interval gives."""
    metrics: dict[str, float] = {}
    for src, metric in {**CLIENT_METRICS, **_percentile_metrics(results)}.items():
        values = [r[src] for r in results if r.get(src) is not None]
        if values:  # how well the repeats agree: throughput's relative spread
            metrics.update({f"{metric}{k}": v for k, v in _spread(values).items()
                            if k != "_rel_spread" or src == "output_throughput"})
    ratios = speed_ratios(results, base_runs) if looks is not None else []
    if not ratios:
        return PointFigures(metrics=metrics)
    # the per-repeat noise (make calibrate's default)
    sd = statistics.stdev(math.log(r) for r in ratios) if len(ratios) > 1 else None
    return PointFigures(metrics=metrics, speedup=speedup(ratios, looks), speedup_log_sd=sd)


def summarize(records: dict[str, ModelRecord], loads: list[Workload],
              target: str = "cpu") -> dict[str, ModelBench]:
    """Medians and spread per model, workload and load point; speedup against the baseline,
    looked at as ``target`` measured it (sequentially where the models were interleaved)."""
    base = records[BASELINE]
    by_name = {w.name: w for w in loads}
    out: dict[str, ModelBench] = {}
    for name, record in records.items():
        figures: dict[str, WorkloadFigures] = {}
        # a model that failed mid-run has no complete measurement: no figures from it
        for key, points in (record.runs.items() if record.status == "ok" else ()):
            base_points = _measured(base.runs.get(key, {})) if base.status == "ok" else {}
            queries, hits = record.prefix_counters.get(key, [0.0, 0.0])
            workload = by_name.get(key)
            expected = workload.expected_prefix_hit_rate(
                int(record.kv.get("kv_block_size") or 0), workload.headline) \
                if workload is not None and workload.compare_prefix_caching else None
            sweep = by_name.get(key.removesuffix("_nocache"))
            figures[key] = WorkloadFigures(
                points={c: point_figures(results, base_points.get(c, []),
                                         sweep.looks(target, c)
                                         if sweep is not None and name != BASELINE else None)
                        for c, results in _measured(points).items() if results},
                prefix_cache_hit_rate=hits / queries if queries else 0.0,
                prefix_cache_hit_tokens=hits, prefix_cache_query_tokens=queries,
                prefix_cache_expected_hit_rate=expected)
        for key, data in figures.items():
            if key in by_name and by_name[key].dataset in ("custom", "timed_trace"):
                data.lengths = length_distribution(
                    [r for runs in record.runs[key].values() for r in runs])
        for key, found in record.searches.items():
            if key in figures and by_name[key].slo is not None:
                figures[key].capacity = capacity_figures(found, figures[key].points,
                                                         by_name[key], record.kv)
        for workload in loads:  # what prefix reuse buys: TTFT with caching off over on
            on = figures.get(workload.name)
            off = figures.get(f"{workload.name}_nocache")
            head = workload.headline
            if on and off and head in on.points and head in off.points:
                on.prefix_cache_ttft_speedup = (off.points[head].metrics[tracking.TTFT_MS_P50]
                                                / on.points[head].metrics[tracking.TTFT_MS_P50])
        v = record.variant
        out[name] = ModelBench(recipe=v.recipe, status=record.status, identity=v.identity,
                               format=v.format, serve_command=record.serve_command,
                               reason=record.reason, log=record.log, kv=record.kv,
                               engine=record.engine, peak_memory_bytes=record.peak_memory_bytes,
                               workloads=figures)
    return out


def length_distribution(results: list[dict]) -> dict[str, float] | None:
    """Requests sent and their prompt and output lengths in tokens (the client's own counts,
    kept by ``--save-detailed``), over every run of a workload."""
    inputs = [n for r in results for n in r.get("input_lens") or []]
    outputs = [n for r in results for n in r.get("output_lens") or []]
    if not inputs:
        return None
    out: dict[str, float] = {"requests": len(inputs)}
    for name, values in (("input_tokens", sorted(inputs)), ("output_tokens", sorted(outputs))):
        if values:
            out.update({f"{name}_p50": statistics.median(values),
                        f"{name}_p90": values[nearest_rank(len(values), 0.9)],
                        f"{name}_max": values[-1]})
    return out


def nearest_rank(n: int, q: float) -> int:
    """The index of the q-quantile of n sorted values by nearest rank: ceil(q n) - 1 (N = 10:
    the 9th value for p90, not the maximum)."""
    return min(n - 1, max(0, math.ceil(q * n - 1e-9) - 1))


def _measured(points: dict[int, list[dict]]) -> dict[int, list[dict]]:
    """Each load point's runs less a search's pilot runs (too short to be a figure)."""
    return {c: [r for r in runs if not r.get(PILOT)] for c, runs in points.items()}


def interpolated(points: dict[int, PointFigures], load: float, metric: str) -> float | None:
    """``metric`` at ``load`` from the loads measured, linearly between the nearest two (the
    end's own figure beyond the loads measured); None where no load has it."""
    known = sorted((c, at.metrics[metric]) for c, at in points.items() if metric in at.metrics)
    if not known:
        return None
    if load <= known[0][0]:
        return known[0][1]
    for (c1, v1), (c2, v2) in itertools.pairwise(known):
        if c1 <= load <= c2:
            return v1 + (v2 - v1) * (load - c1) / (c2 - c1) if c2 > c1 else v1
    return known[-1][1]


def capacity_figures(found: dict, points: dict[int, PointFigures], workload: Workload,
                     kv: dict[str, float]) -> Capacity:
    """A search's result (:meth:`CapacitySearch.result`), the throughput at the capacity and
    at its interval's ends (interpolated between the loads measured: the cost's range), each
    load's SLO attainment, and what limits the capacity."""
    slo = Objective.model_validate(found["slo"]) if found.get("slo") else workload.slo
    assert slo is not None
    if found.get("rate_start"):  # the rates the search used (an ``auto`` start, derived)
        workload = dataclasses.replace(workload, rate_start=found["rate_start"],
                                       rate_ceiling=found["rate_ceiling"])
    out = {"objective": slo.describe(), "objective_basis": slo.basis, "workload": workload.name,
           **{k: v for k, v in found.items() if k != "slo"},
           "bounds": {_latency_key(m, slo.percentile): v for m, v in slo.bounds().items()},
           "points": {str(c): p for c, p in found["points"].items()},
           "traffic": traffic_model(workload)}
    best = found["capacity"]
    fit = found.get("fit") or {}
    # a rate search's capacity is the rate at the knee itself (rates are not whole); a
    # concurrency search's, whole users at or below it
    at: float = best
    low, high = found["capacity_low"], found["capacity_high"]
    if workload.by_rate:
        rate = workload.rate_of  # a level's requests/s (levels 1, 2, ... from rate_start)
        out["search_by"] = "rate"
        at, low, high = workload.rate_levels(found)
        out[tracking.SLO_MAX_REQUEST_RATE] = workload.rate(at)
        out[tracking.SLO_REQUEST_RATE_LOW] = workload.rate(low)
        out[tracking.SLO_REQUEST_RATE_HIGH] = workload.rate(high)
        out["points"] = {c: {**p, "rate": rate(int(c))} for c, p in out["points"].items()}
    else:
        out[tracking.SLO_MAX_CONCURRENCY] = best
        out[tracking.SLO_CAPACITY_LOW] = low
        out[tracking.SLO_CAPACITY_HIGH] = high
    if fit and at:
        share = 1 / (1 + math.exp(-(fit["intercept"] + fit["slope"] * (at - fit["centre"]))))
        out[tracking.SLO_ATTAINMENT] = share
    if at:
        for metric, name in ((tracking.REQUESTS_PER_S, tracking.SLO_REQUESTS_PER_S),
                             (tracking.OUTPUT_TOKENS_PER_S, tracking.SLO_OUTPUT_TOKENS_PER_S),
                             (tracking.GOODPUT, tracking.SLO_GOODPUT)):
            for suffix in ("", "_min", "_max"):
                value = interpolated(points, at, metric + suffix)
                if value is not None:
                    out[name + suffix] = value
        for metric, name in ((tracking.OUTPUT_TOKENS_PER_S, tracking.SLO_OUTPUT_TOKENS_PER_S),
                             (tracking.REQUESTS_PER_S, tracking.SLO_REQUESTS_PER_S)):
            # the interval's ends: the slowest run's figure at the low end, the fastest's at
            # the high end (the cost's dearest and cheapest)
            for end, load, suffix in (("_at_low", low, "_min"), ("_at_high", high, "_max")):
                if load:
                    value = interpolated(points, load, metric + suffix)
                    if value is None:
                        value = interpolated(points, load, metric)
                    if value is not None:
                        out[name + end] = value
    out["limited_by"] = limited_by(found, points, workload, kv, slo)
    return Capacity.model_validate(out)


def traffic_model(workload: Workload) -> str:
    """The traffic a capacity assumes, in words."""
    if workload.by_rate:
        kind = "Poisson" if workload.burstiness == 1 else \
            f"gamma (burstiness {workload.burstiness:g})"
        return f"open loop: {kind} arrivals at a fixed rate, however slow the answers"
    return "closed loop: N users, each sending its next request once its answer is complete"


def limited_by(found: dict, points: dict[int, PointFigures], workload: Workload,
               kv: dict[str, float], slo: Objective) -> str:
    """Why the capacity is what it is: the search's ceiling, the KV cache, or latency."""
    outcome = found.get("outcome", "")
    if outcome == CENSORED and found.get("ceiling_from") == "the KV cache":
        return (f"the KV cache: it holds {found['ceiling']} requests of up to "
                f"{workload.max_tokens_per_request} tokens (the search's ceiling), and the "
                "objective was shown to be met there")
    if outcome == CENSORED:
        return (f"the search ceiling: the objective was shown to be met at "
                f"{workload.load_text(found['ceiling'])} (raise search_ceiling)")
    if outcome == UNDECIDED_CEILING:
        return (f"undecided: at the ceiling ({workload.load_text(found['ceiling'])}) the runs' "
                "share reaches the target but does not show it; raise repeats (REPEATS=)")
    if outcome.startswith("undecided"):
        return f"undecided ({outcome}): raise repeats (REPEATS=)"
    if outcome.startswith("misses"):
        return f"latency: the objective is missed even at {workload.load_text(1)}"
    miss = found.get("first_below")
    at_miss = (points.get(miss) if miss else None) or PointFigures()
    holds = None if workload.by_rate else requests_held(kv, workload.max_tokens_per_request)
    if at_miss.get(tracking.PREEMPTIONS, 0) > 0 or (holds is not None and miss and holds < miss):
        return (f"the KV cache: it holds {holds if holds is not None else '?'} requests of up "
                f"to {workload.max_tokens_per_request} tokens; "
                f"{at_miss.get(tracking.PREEMPTIONS, 0):.0f} preemptions at "
                f"{workload.load_text(miss or 0)}")
    parts = [f"{m.upper()} p{slo.percentile} {at_miss.metrics[key]:.0f} ms"
             for m in slo.bounds() if (key := _latency_key(m, slo.percentile)) in at_miss.metrics]
    opened = (outcome == ESTIMATED and (found.get("capacity_low") is None
                                         or found.get("capacity_high") is None))
    return (f"latency (compute), not the KV cache: at {workload.load_text(miss or 0)} "
            + (", ".join(parts) if parts else "the objective is missed")
            + (f"; the KV cache holds {holds} such requests" if holds is not None else "")
            + ("; the interval is open: no load up to the ceiling is shown to miss, or none "
               "down to one user to meet (raise repeats, REPEATS=, or search_ceiling)"
               if opened else ""))


def _latency_key(metric: str, percentile: int) -> str:
    """The point figure holding a latency percentile (``ttft_ms_p99``, ``e2e_ms_p99``)."""
    return f"{metric.replace('e2el', 'e2e')}_ms_p{percentile}"


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
            for concurrency, figures in data.points.items():
                for metric, value in figures.flat().items():
                    stepped.append((f"{SWEEP}{prefix}{suffix}{metric}", value, concurrency))
                    if concurrency == workload.headline:
                        metrics[f"{prefix}{suffix}{metric}"] = value
            # the hit counters of every measured run: 0 in a sweep, the prefix's share in a
            # prefix comparison
            metrics.update({f"{prefix}{suffix}{k}": v for k, v in data.counters().items()})
            if data.capacity is not None:
                first = workload is next(w for w in loads if w.slo is not None)
                name = "" if first else f"{workload.name}."
                metrics.update({f"{name}{k}": v for k, v in data.capacity.metrics().items()})
                stepped += [(f"{SWEEP}{prefix}{tracking.SLO_ATTAINMENT}", p.attainment,
                             int(c)) for c, p in data.capacity.points.items()]
    metrics.update({k: float(v) for k, v in entry.kv.items()})
    if entry.engine.engine_weight_memory_bytes:
        metrics[tracking.ENGINE_WEIGHT_MEMORY_BYTES] = entry.engine.engine_weight_memory_bytes
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
        if entry.engine.scheme:
            params["engine_scheme"] = entry.engine.scheme[:500]
            params["engine_kernels"] = "; ".join(entry.engine.kernels)[:500] or "-"
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
            stepped=stepped, seconds=summary.seconds, variant=name)
