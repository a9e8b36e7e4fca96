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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.core import paths, tracking
from pipeline.core.errors import ConfigError, PlanError
from pipeline.core.fsutil import read_json
from pipeline.eval import gate
from pipeline.eval import run as evaluate
from pipeline.plan import capacity
from pipeline.plan.accelerators import detect as detect_accelerator
from pipeline.plan.accelerators import get_accelerator
from pipeline.quantize import baseline as baselines
from pipeline.quantize import checkpoint

BASELINE = "baseline"
SERVED, EMULATED = evaluate.SERVED, evaluate.EMULATED

# compressed-tensors format -> the planner's weight precision
PRECISION_OF_FORMAT = {
    "dense": "bf16", "float-quantized": "fp8", "naive-quantized": "int8",
    "int-quantized": "int8", "pack-quantized": "int4", "mxfp4-pack-quantized": "mxfp4",
    "nvfp4-pack-quantized": "nvfp4",
}


DEFAULT_PLAN_GPU = "h100-80gb"  # where the planner places variants on a host without a GPU


@dataclass(frozen=True)
class PlanTarget:
    """Where the planner places each variant: an accelerator preset (or memory) and contexts.
    ``gpu: auto`` is the card this machine has (its preset, else its memory), or h100-80gb on
    a host without a GPU."""

    gpu: str = "auto"
    context: int = 2048
    max_context: int = 8192
    memory_gb: float | None = None

    def resolved(self, prof: Any) -> tuple[PlanTarget, str]:
        """(this target with ``auto`` decided for the machine ``prof``, a note for the report
        when the plan is not for the card the figures were measured on)."""
        gpu = prof.gpus[0] if prof.target == "cuda" and prof.gpus else None
        if self.memory_gb is not None:
            return self, (f"planned for {self.memory_gb:g} GB" + (
                f"; the figures were measured on {gpu.name}" if gpu else ""))
        if self.gpu != "auto":
            preset = get_accelerator(self.gpu)
            if gpu is None:
                return self, f"planned for {preset.description}; this machine has no GPU"
            here = detect_accelerator(gpu.name, gpu.memory_mib)
            same = here is not None and here.name == preset.name
            return self, "" if same else (f"planned for {preset.description}, not for this "
                                          f"machine's {gpu.name}")
        if gpu is None:
            return replace(self, gpu=DEFAULT_PLAN_GPU), (
                f"planned for {get_accelerator(DEFAULT_PLAN_GPU).description}: this machine "
                "has no GPU (PLAN_GPU= picks another)")
        here = detect_accelerator(gpu.name, gpu.memory_mib)
        if here is not None:
            return replace(self, gpu=here.name), ""
        if gpu.memory_mib:
            return replace(self, memory_gb=gpu.memory_mib * 2**20 / 1e9), ""
        return replace(self, gpu=DEFAULT_PLAN_GPU), (
            f"planned for {DEFAULT_PLAN_GPU}: {gpu.name} has no preset and reports no memory")

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
    engine: dict[str, Any] = field(default_factory=dict)  # what the engine chose and used
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
    measurement: str = ""  # the bench run (its key) the speed figures come from
    comparable: bool = True  # measured in the comparison's reference run: same baseline run,
    # workload and load point as every other comparable row

    @property
    def speedup(self) -> float | None:
        return self.headline.get(tracking.SPEEDUP)

    def served_concurrency(self, context: int) -> int | None:
        """Requests of ``context`` tokens the served engine's KV cache holds at once (paged)."""
        tokens = self.kv.get(tracking.KV_CACHE_TOKENS)
        block = int(self.kv.get("kv_block_size") or 0)  # 0: read from the log, size unknown
        if not tokens or context <= 0:
            return None
        per_request = -(-context // block) * block if block > 0 else context
        return int(tokens // per_request)

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
    measurement: dict[str, str] = field(default_factory=dict)  # the reference bench run
    objective: str = "speed"
    plan_note: str = ""  # when the plan is not for the card the figures come from

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


def _holds(summary: dict[str, Any], name: str, identity: str) -> dict[str, Any] | None:
    entry = summary.get("models", {}).get(name)
    return entry if entry and entry.get("identity") == identity else None


def reference_run(summaries: list[tuple[Path, dict[str, Any]]], identities: dict[str, str],
                  hardware_key: str) -> tuple[Path, dict[str, Any]] | None:
    """The bench run the comparison is made from: of the runs that served this baseline, the
    one on this machine's hardware that measured most of the current variants (the newest on
    a tie). Every speedup compared comes from it: one baseline run, one workload, one load
    point."""
    ranked = []
    for age, (path, summary) in enumerate(summaries):  # newest first
        base = _holds(summary, BASELINE, identities[BASELINE])
        if not base or base.get("status") != "ok":
            continue
        covered = sum(bool(_holds(summary, n, i)) for n, i in identities.items())
        same_hw = summary.get("hardware", {}).get("key") == hardware_key
        ranked.append(((same_hw, covered, -age), path, summary))
    if not ranked:
        return None
    _, path, summary = max(ranked, key=lambda r: r[0])
    return path, summary


def _bench_for(row: Row, identity: str, summaries: list[tuple[Path, dict[str, Any]]]
               ) -> tuple[Path, dict[str, Any], dict[str, Any]] | None:
    for path, summary in summaries:
        entry = _holds(summary, row.name, identity)
        if entry:
            return path, summary, entry
    return None


def measurement_label(path: Path, summary: dict[str, Any]) -> str:
    return f"bench {path.parent.name}" + (f" ({summary['measured']})"
                                          if summary.get("measured") else "")


def _apply_bench(row: Row, summary: dict[str, Any], entry: dict[str, Any]) -> tuple[str, int]:
    """Fill the bench fields; returns (headline workload, its load point)."""
    workloads = [Path(w).stem for w in summary.get("workloads", [])] or list(entry["workloads"])
    first = workloads[0]
    head = int(summary.get("headline", {}).get(first, 0)) or None
    row.serving, row.serving_reason = entry["status"], entry.get("reason", "")
    row.serving_log = entry.get("log", "")
    row.kv = {k: float(v) for k, v in entry.get("kv", {}).items()}
    row.engine = dict(entry.get("engine", {}))
    if row.engine.get("fp8_weight_only"):
        row.notes.append(f"served as {row.engine['scheme']}: its speed is not an FP8 W8A8 "
                         "speed")
    row.peak_memory_bytes = int(entry.get("peak_memory_bytes") or 0)
    data = entry.get("workloads", {}).get(first, {})
    row.sweep = {int(k): v for k, v in data.get("points", {}).items()}
    if head is None and row.sweep:
        head = sorted(row.sweep)[len(row.sweep) // 2]
    row.headline = row.sweep.get(head, {}) if head is not None else {}
    for name in workloads[1:]:
        other = entry.get("workloads", {}).get(name, {})
        if tracking.PREFIX_CACHE_TTFT_SPEEDUP in other:
            row.prefix = {k: other[k] for k in (tracking.PREFIX_CACHE_HIT_RATE,
                                                tracking.PREFIX_CACHE_EXPECTED_HIT_RATE,
                                                tracking.PREFIX_CACHE_TTFT_SPEEDUP) if k in other}
    return first, head or 0


def _apply_eval(row: Row, summary: dict[str, Any], base: baselines.Baseline,
                identity: str) -> None:
    """The variant's current task results (this checkpoint, baseline and task files), its
    suite figures and the gate's verdict on them; stale results are named, never used."""
    entries, stale = gate.current_tasks(summary, identity, base.identity)
    row.tasks = entries
    row.suites = gate.suite_figures(entries)
    backends = {t.get("backend") for t in entries.values()}
    row.eval_backend = EMULATED if EMULATED in backends else (SERVED if backends else None)
    div = summary.get("divergence", {})
    if div.get("identity") == identity:
        row.divergence = {k: v for k, v in div.items() if isinstance(v, (int, float))}
    row.threshold = gate.threshold_of(row.recipe, paths.variant_dir(base.name, row.recipe))
    verdict = gate.judge(entries, row.recipe, row.threshold, stale=stale)
    row.gate_status, row.gate_reason = verdict.status, verdict.reason()
    if stale:
        row.notes.append("eval: not judged, stale: " + "; ".join(stale)
                         + f" (make eval RECIPE={row.name})")


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
            failures: list[dict[str, str]] | None = None, objective: str = "speed"
            ) -> Comparison:
    """One row for the baseline and each variant on disk (or ``recipes``). ``failures`` are a
    campaign's failed stages (e.g. a recipe that did not quantize), shown beside the rows."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)} "
                          "(OBJECTIVE= in make, --objective in the CLI).")

    from pipeline.core import hardware

    target, plan_note = (target or PlanTarget()).resolved(hardware.profile())
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
    reference = reference_run(summaries, identities, hardware.profile().key())
    workload, load_point, sources = "", None, {}
    measurement: dict[str, str] = {}
    if reference is not None:
        ref_path, ref = reference
        measurement = {"run": measurement_label(ref_path, ref), "path": str(ref_path),
                       "hardware": ref.get("hardware", {}).get("summary", "unknown"),
                       "pairing": ref.get("speedup_pairing", "")}
    failed = list(failures or [])
    for row in rows:
        _apply_plan(row, config, target, _group_size(row.scheme))
        in_reference = reference is not None and _holds(reference[1], row.name,
                                                        identities[row.name])
        found = (reference[0], reference[1], in_reference) if in_reference else \
            _bench_for(row, identities[row.name], summaries)
        if found:
            path, summary, entry = found
            head_workload, head_point = _apply_bench(row, summary, entry)
            row.measurement = measurement_label(path, summary)
            sources[f"bench:{row.name}"] = str(path)
            if in_reference:
                workload, load_point = head_workload, head_point
            else:
                row.comparable = False
                row.notes.append(
                    f"speed from another measurement ({row.measurement}) than the comparison's "
                    f"({measurement.get('run', 'none')}): its speedup is against another "
                    "baseline run, so it is shown but not compared or recommended; "
                    f"`make bench` measures every variant in one run")
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
        elif evaluated:
            _apply_eval(row, evaluated, base, identities[row.name])
            sources[f"eval:{row.name}"] = str(summary_path)
    best, reason = recommend(rows, objective)
    return Comparison(base.name, rows, workload, load_point, target, best, reason, sources,
                      failed, measurement.get("hardware", ""), measurement, objective, plan_note)


# --- the verdict -------------------------------------------------------------------------------
OBJECTIVES = ("speed", "memory", "capacity")
OBJECTIVE_TEXT = {
    "speed": "the fastest variant that passes its gate and is faster than the baseline in "
             "every repeat",
    "memory": "the variant with the smallest weights that passes its gate",
    "capacity": "the variant that holds the most concurrent requests at the plan target and "
                "passes its gate",
}


def _suites_text(row: Row) -> str:
    return ", ".join(f"{s} {v['recovery_pct']:.1f}% [{v['ci_low']:.1f}, {v['ci_high']:.1f}]"
                     for s, v in sorted(row.suites.items()) if v.get("recovery_pct") is not None)


def _speed_text(row: Row) -> str:
    h = row.headline
    return (f"{h[tracking.SPEEDUP]:.2f}x [{h[tracking.SPEEDUP + '_min']:.2f}-"
            f"{h[tracking.SPEEDUP + '_max']:.2f}]")


def recommend(rows: list[Row], objective: str = "speed") -> tuple[str | None, str]:
    """The variant that best meets ``objective`` among those that pass their gate on every
    suite, were served here and were measured in the comparison's reference run; else why
    none does, variant by variant."""
    eligible, why_not = [], []
    for row in rows:
        if row.name == BASELINE:
            continue
        if row.gate_status != gate.PASS:
            detail = f": {row.gate_reason}" if row.gate_reason else ""
            why_not.append(f"{row.name}: gate {row.gate_status}{detail}")
        elif row.serving == "failed":
            why_not.append(f"{row.name}: passes its gate but failed while served "
                           f"({row.serving_reason})")
        elif row.serving != "ok" or row.speedup is None:
            why = row.serving_reason or "its speed was not measured (make bench)"
            why_not.append(f"{row.name}: passes its gate but was not served here ({why})")
        elif not row.comparable:
            why_not.append(f"{row.name}: passes its gate but its speed is from another "
                           f"measurement ({row.measurement})")
        elif objective == "speed" and row.headline.get(tracking.SPEEDUP + "_max", 0) < 1:
            why_not.append(f"{row.name}: passes its gate but is slower than the baseline "
                           f"({_speed_text(row)})")
        elif objective == "speed" and row.headline.get(tracking.SPEEDUP + "_min", 0) <= 1:
            why_not.append(f"{row.name}: passes its gate but is not shown faster than the "
                           f"baseline: its speedup {_speed_text(row)} straddles 1")
        else:
            eligible.append(row)
    if not eligible:
        return None, (f"objective {objective} ({OBJECTIVE_TEXT[objective]}): no variant "
                      "qualifies: " + ("; ".join(why_not) if why_not else
                                       "no variant on disk (make quantize)"))
    if objective == "speed":
        best = max(eligible, key=lambda r: r.speedup or 0.0)
    elif objective == "memory":
        best = min(eligible, key=lambda r: r.weight_bytes)
    else:
        best = max(eligible, key=lambda r: (r.plan.get(capacity.MAX_CONCURRENCY_PAGED, 0),
                                            -r.weight_bytes))
    reason = (f"{best.name} (objective {objective}: {OBJECTIVE_TEXT[objective]}): "
              f"{_speed_text(best)} the baseline's throughput, {best.weight_ratio:.2f}x its "
              f"weight memory")
    if best.plan:
        reason += (f", {best.plan.get(capacity.MAX_CONCURRENCY_PAGED, 0):,} concurrent "
                   "requests planned")
    reason += f", recovery {_suites_text(best)} (threshold {best.threshold:g}%)"
    if best.eval_backend == EMULATED:
        reason += " [accuracy emulated]"
    return best.name, reason
