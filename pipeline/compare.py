"""Join what each stage measured into one row per variant, and name the variant to ship.

Reads only what the stages left on disk (nothing is re-measured):

- quantize: ``artifacts/variants/<baseline>/<recipe>/qpipe_manifest.json``;
- bench: the newest ``artifacts/bench/<baseline>/<key>/summary.json`` that measured the
  variant's current checkpoint (matched by its identity);
- eval: ``artifacts/evals/<baseline>/<recipe>/recovery.json`` (of the current checkpoint), judged
  by :mod:`pipeline.gate`;
- plan: the capacity planner on the baseline's ``config.json`` in each variant's precision.

The recommendation is the fastest variant (speedup at the headline load point) whose recovery
interval clears its recipe's threshold on every suite; or none, with the reason.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline import baseline as baselines
from pipeline import capacity, checkpoint, evaluate, gate, paths, tracking
from pipeline.accelerators import get_accelerator
from pipeline.errors import PlanError
from pipeline.fsutil import read_json

BASELINE = "baseline"
SERVED, EMULATED = evaluate.SERVED, evaluate.EMULATED

# compressed-tensors format -> the planner's weight precision
PRECISION_OF_FORMAT = {
    "dense": "bf16", "float-quantized": "fp8", "naive-quantized": "int8",
    "int-quantized": "int8", "pack-quantized": "int4", "mxfp4-pack-quantized": "mxfp4",
    "nvfp4-pack-quantized": "nvfp4",
}


@dataclass(frozen=True)
class PlanTarget:
    """Where the planner places each variant: an accelerator preset (or memory) and contexts."""

    gpu: str = "h100-80gb"
    context: int = 2048
    max_context: int = 8192
    memory_gb: float | None = None

    def settings(self, precision: str, group_size: int) -> capacity.PlanSettings:
        if self.memory_gb is not None:
            memory, block = int(self.memory_gb * 1e9), 16
        else:
            preset = get_accelerator(self.gpu)
            memory, block = preset.memory_bytes, preset.block_size
        return capacity.PlanSettings(weights=precision, context=self.context,
                                     max_context=self.max_context, memory_bytes=memory,
                                     block_size=block, int4_group_size=group_size)


@dataclass
class Row:
    """Everything known about one model of the campaign."""

    name: str  # "baseline" or the recipe
    recipe: str  # "none" for the baseline
    scheme: str
    format: str
    precision: str
    weight_bytes: int
    weight_ratio: float  # weight bytes / the baseline's
    quantize_seconds: float | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    serving: str = "not measured"  # ok | unsupported | failed | not measured
    serving_reason: str = ""
    serving_log: str = ""
    headline: dict[str, float] = field(default_factory=dict)  # bench stats at the headline
    sweep: dict[int, dict[str, float]] = field(default_factory=dict)  # load point -> stats
    kv: dict[str, float] = field(default_factory=dict)
    peak_memory_bytes: int = 0
    prefix: dict[str, float] = field(default_factory=dict)
    eval_backend: str | None = None  # served | emulated | None (not evaluated)
    suites: dict[str, dict[str, Any]] = field(default_factory=dict)
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    divergence: dict[str, float] = field(default_factory=dict)
    threshold: float | None = None
    gate_status: str = gate.NOT_EVALUATED
    gate_reason: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float | None:
        return self.headline.get(tracking.SPEEDUP)

    def served_concurrency(self, context: int) -> int | None:
        """Requests of ``context`` tokens the served engine's KV cache holds at once (paged)."""
        tokens, block = self.kv.get(tracking.KV_CACHE_TOKENS), self.kv.get("kv_block_size", 16)
        if not tokens:
            return None
        return int(tokens // (-(-context // int(block)) * int(block)))

    @property
    def figures_from(self) -> str:
        """Where the accuracy figures come from, as the report shows it."""
        if self.eval_backend == EMULATED:
            return "emulated (hf, de-compressed weights)"
        return self.eval_backend or "-"


@dataclass
class Comparison:
    baseline: str
    rows: list[Row]
    workload: str
    load_point: int | None
    plan_target: PlanTarget
    recommendation: str | None
    reason: str
    sources: dict[str, str]
    # what failed for a reason other than a hardware limit: {variant, stage, reason, log}
    failures: list[dict[str, str]] = field(default_factory=list)
    hardware: str = ""  # where the bench figures were measured (the machine's profile)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for row, obj in zip(data["rows"], self.rows, strict=True):
            row["speedup"] = obj.speedup
        return data


# --- collecting ---------------------------------------------------------------------------------
def _bench_entries(base_name: str) -> list[tuple[Path, dict[str, Any]]]:
    """Bench summaries of this baseline, newest first."""
    root = paths.artifacts_dir() / "bench" / base_name
    found = [p for p in root.glob("*/summary.json") if not p.parent.name.startswith(".")]
    found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    return [(p, read_json(p)) for p in found]


def _bench_for(row: Row, identity: str, summaries: list[tuple[Path, dict[str, Any]]]
               ) -> tuple[Path, dict[str, Any], dict[str, Any]] | None:
    for path, summary in summaries:
        entry = summary.get("models", {}).get(row.name)
        if entry and entry.get("identity") == identity:
            return path, summary, entry
    return None


def _apply_bench(row: Row, summary: dict[str, Any], entry: dict[str, Any]) -> tuple[str, int]:
    """Fill the bench fields; returns (headline workload, its load point)."""
    workloads = [Path(w).stem for w in summary.get("workloads", [])] or list(entry["workloads"])
    first = workloads[0]
    head = int(summary.get("headline", {}).get(first, 0)) or None
    row.serving, row.serving_reason = entry["status"], entry.get("reason", "")
    row.serving_log = entry.get("log", "")
    row.kv = {k: float(v) for k, v in entry.get("kv", {}).items()}
    row.peak_memory_bytes = int(entry.get("peak_memory_bytes") or 0)
    data = entry.get("workloads", {}).get(first, {})
    row.sweep = {int(k): v for k, v in data.get("points", {}).items()}
    if head is None and row.sweep:
        head = sorted(row.sweep)[len(row.sweep) // 2]
    row.headline = row.sweep.get(head, {}) if head is not None else {}
    for name in workloads[1:]:
        other = entry.get("workloads", {}).get(name, {})
        if tracking.PREFIX_CACHE_TTFT_SPEEDUP in other:
            row.prefix = {tracking.PREFIX_CACHE_HIT_RATE: other[tracking.PREFIX_CACHE_HIT_RATE],
                          tracking.PREFIX_CACHE_TTFT_SPEEDUP:
                              other[tracking.PREFIX_CACHE_TTFT_SPEEDUP]}
    return first, head or 0


def _apply_eval(row: Row, summary: dict[str, Any], base_name: str) -> None:
    row.tasks = summary.get("tasks", {})
    row.suites = {k: v for k, v in summary.get("suites", {}).items() if k != "*"}
    backends = {t.get("backend") for t in row.tasks.values()}
    row.eval_backend = EMULATED if EMULATED in backends else (SERVED if backends else None)
    row.divergence = {k: v for k, v in summary.get("divergence", {}).items()
                      if isinstance(v, (int, float))}
    row.threshold = gate.threshold_of(row.recipe, paths.variant_dir(base_name, row.recipe))
    verdict = gate.judge(summary, row.recipe, row.threshold)
    row.gate_status, row.gate_reason = verdict.status, verdict.reason()


def _apply_plan(row: Row, config: dict[str, Any], target: PlanTarget, group_size: int) -> None:
    try:
        plan = capacity.plan_capacity(config, target.settings(row.precision, group_size))
    except PlanError as err:  # e.g. the weights do not fit the accelerator
        row.notes.append(f"plan: {err}")
        return
    row.plan = plan.metrics()  # the planner's own names (planned_*), as `qpipe plan --json`


def _group_size(scheme: str) -> int:
    _, _, tail = scheme.rpartition("-G")
    return int(tail) if tail.isdigit() else 128


def collect(base: baselines.Baseline, recipes: list[str] | None = None,
            target: PlanTarget | None = None,
            failures: list[dict[str, str]] | None = None) -> Comparison:
    """One row for the baseline and each variant on disk (or ``recipes``). ``failures`` are a
    campaign's failed stages (e.g. a recipe that did not quantize), shown beside the rows."""

    target = target or PlanTarget()
    base_bytes = checkpoint.measure(base.path).weight_bytes
    rows = [Row(BASELINE, "none", "bf16", "dense", "bf16", base_bytes, 1.0)]
    identities = {BASELINE: base.identity}
    for name, manifest in checkpoint.variant_manifests(base.name, recipes).items():
        scheme = manifest.get("recipe", {}).get("scheme", "?")
        fmt = manifest.get("format", "?")
        rows.append(Row(name, name, scheme, fmt, PRECISION_OF_FORMAT.get(fmt, "bf16"),
                        int(manifest["weight_bytes"]), manifest["weight_bytes"] / base_bytes,
                        manifest.get("quantize_seconds")))
        identities[name] = manifest["cache_key"]

    config = json.loads((base.path / "config.json").read_text())
    summaries = _bench_entries(base.name)
    workload, load_point, sources, measured_on = "", None, {}, ""
    failed = list(failures or [])
    for row in rows:
        _apply_plan(row, config, target, _group_size(row.scheme))
        found = _bench_for(row, identities[row.name], summaries)
        if found:
            path, summary, entry = found
            workload, load_point = _apply_bench(row, summary, entry)
            sources[f"bench:{row.name}"] = str(path)
            measured_on = summary.get("hardware", {}).get("summary", measured_on)
            if row.serving == "failed":
                failed.append({"variant": row.name, "stage": "bench",
                               "reason": row.serving_reason, "log": row.serving_log})
        if row.name == BASELINE:
            continue
        eval_dir = evaluate.cache_root(base.name) / row.name
        summary_path = eval_dir / evaluate.SUMMARY_FILE
        evaluated = read_json(summary_path)
        eval_failed = read_json(eval_dir / evaluate.FAILURE_FILE)
        if eval_failed.get("identity") == identities[row.name]:
            row.gate_reason = f"its last evaluation failed: {eval_failed.get('reason', '?')}"
            failed.append({"variant": row.name, "stage": "eval",
                           "reason": eval_failed.get("reason", "?"), "log": ""})
        elif evaluated.get("identity") == identities[row.name]:
            _apply_eval(row, evaluated, base.name)
            sources[f"eval:{row.name}"] = str(summary_path)
        elif evaluated:
            row.notes.append("eval: the evaluation on disk is of an older checkpoint; run "
                             f"`make eval RECIPE={row.name}`")
    best, reason = recommend(rows)
    return Comparison(base.name, rows, workload, load_point, target, best, reason, sources,
                      failed, measured_on)


# --- the verdict -------------------------------------------------------------------------------
def recommend(rows: list[Row]) -> tuple[str | None, str]:
    """The fastest variant whose recovery clears its gate on every suite; else why none does."""
    eligible, why_not = [], []
    for row in rows:
        if row.name == BASELINE:
            continue
        if row.gate_status != gate.PASS:
            detail = f": {row.gate_reason}" if row.gate_reason else ""
            why_not.append(f"{row.name}: gate {row.gate_status}{detail}")
        elif row.serving == "failed":
            why_not.append(f"{row.name}: clears its gate but failed while served "
                           f"({row.serving_reason})")
        elif row.serving != "ok" or row.speedup is None:
            why = row.serving_reason or "its speed was not measured (make bench)"
            why_not.append(f"{row.name}: clears its gate but was not served here ({why})")
        else:
            eligible.append(row)
    if not eligible:
        return None, "no variant both clears its gate on every suite and was served: " + (
            "; ".join(why_not) if why_not else "no variant on disk (make quantize)")
    best = max(eligible, key=lambda r: r.speedup or 0.0)
    suites = ", ".join(f"{s} {v['recovery_pct']:.1f}% [{v['ci_low']:.1f}, {v['ci_high']:.1f}]"
                       for s, v in sorted(best.suites.items())
                       if v.get("recovery_pct") is not None)
    reason = (f"{best.name}: {best.speedup:.2f}x the baseline's throughput, "
              f"{best.weight_ratio:.2f}x its weight memory, recovery {suites} "
              f"(threshold {best.threshold:g}%)")
    if best.eval_backend == EMULATED:
        reason += " [accuracy emulated]"
    return best.name, reason
