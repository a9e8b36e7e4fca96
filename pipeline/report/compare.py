"""Join what each stage measured into one row per variant, and name the variant to ship.

Reads only what the stages left on disk (nothing is re-measured):

- quantize: each variant's :class:`~pipeline.core.artifacts.Manifest`;
- bench: one :class:`~pipeline.core.artifacts.BenchSummary` for every row (the reference run:
  one baseline run, workload and load point); a variant measured only elsewhere is marked;
- eval: each variant's current task results (:mod:`pipeline.eval.gate` judges them);
- plan: the capacity planner on the baseline's ``config.json`` in each variant's precision.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.core import hardware
from pipeline.core.artifacts import (
    EMULATED,
    SERVED,
    BenchSummary,
    Comparison,
    CostTarget,
    EvalFailure,
    ModelBench,
    PlanTarget,
    RecoverySummary,
    Row,
    SensitivityTable,
    manifests,
)
from pipeline.core.errors import ConfigError, PlanError, RecipeError
from pipeline.core.hardware import Profile
from pipeline.core.paths import variant_dir
from pipeline.core.variant import BASELINE, BaselineLike
from pipeline.eval import gate
from pipeline.plan import capacity
from pipeline.plan.accelerators import detect as detect_accelerator
from pipeline.plan.accelerators import get_accelerator
from pipeline.plan.architecture import checkpoint_kv_dtype
from pipeline.quantize import checkpoint
from pipeline.quantize import recipes as recipe_files
from pipeline.report import cost, crossover
from pipeline.report.recommend import OBJECTIVES, recommend
from pipeline.serve.settings import EngineSettings

MIXED = "mixed"  # a searched recipe: formats per layer (planned from its measured bytes)
DEFAULT_PLAN_GPU = "h100-80gb"  # where the planner places variants on a host without a GPU
# compressed-tensors format -> the planner's weight precision
PRECISION_OF_FORMAT = {
    "dense": "bf16", "float-quantized": "fp8", "naive-quantized": "int8",
    "int-quantized": "int8", "pack-quantized": "int4", "mxfp4-pack-quantized": "mxfp4",
    "nvfp4-pack-quantized": "nvfp4", "mixed-precision": MIXED,
}


# --- where the planner places the variants ------------------------------------------------------
def resolve_plan_target(target: PlanTarget, prof: Profile) -> tuple[PlanTarget, str]:
    """(the target with ``auto`` decided for the machine ``prof``, a note for the report when
    the plan is not for the card the figures were measured on)."""
    gpu = prof.gpus[0] if prof.target == "cuda" and prof.gpus else None
    if target.memory_gb is not None:
        return target, (f"planned for {target.memory_gb:g} GB" + (
            f"; the figures were measured on {gpu.name}" if gpu else ""))
    if target.gpu != "auto":
        preset = get_accelerator(target.gpu)
        if gpu is None:
            return target, f"planned for {preset.description}; this machine has no GPU"
        here = detect_accelerator(gpu.name, gpu.visible_memory_mib)
        same = here is not None and here.name == preset.name
        return target, "" if same else (f"planned for {preset.description}, not for this "
                                        f"machine's {gpu.name}")
    if gpu is None:
        return target.model_copy(update={"gpu": DEFAULT_PLAN_GPU}), (
            f"planned for {get_accelerator(DEFAULT_PLAN_GPU).description}: this machine has no "
            "GPU (PLAN_GPU= picks another)")
    visible = gpu.visible_memory_mib
    here = detect_accelerator(gpu.name, visible)
    if here is not None:
        return target.model_copy(update={"gpu": here.name}), ""
    if visible:
        what = (f"the MIG slice {gpu.mig_profile} of an {gpu.name}" if gpu.mig_profile else
                f"{gpu.name}, not a preset (configs/accelerators)")
        return target.model_copy(update={"memory_gb": visible * 2**20 / 1e9}), (
            f"planned for {visible * 2**20 / 1e9:.0f} GB: {what}")
    return target.model_copy(update={"gpu": DEFAULT_PLAN_GPU}), (
        f"planned for {DEFAULT_PLAN_GPU}: {gpu.name} has no preset and reports no memory")


def plan_settings(target: PlanTarget, precision: str, group_size: int,
                  kv_dtype: str = "bf16", engine: Mapping[str, Any] | None = None,
                  block_size: int | None = None) -> capacity.PlanSettings:
    """The planner's settings for one variant on ``target``, with the memory utilisation and
    the tensor / pipeline parallelism its servers were started with (``engine``: a bench run's
    engine settings; none: vLLM's defaults, one device) and ``block_size``, the KV block the
    engine used on that card where it was measured there (else the preset's)."""
    if target.memory_gb is not None:
        memory, block = int(target.memory_gb * 1e9), 16
    else:
        preset = get_accelerator(target.gpu)
        memory, block = preset.memory_bytes, preset.block_size
    served = EngineSettings.from_record(engine or {})
    return capacity.PlanSettings(
        weights=precision, kv_dtype=kv_dtype, context=target.context,
        max_context=target.max_context, memory_bytes=memory, block_size=block_size or block,
        int4_group_size=group_size, utilization=served.gpu_memory_utilization,
        tensor_parallel=served.tensor_parallel_size,
        pipeline_parallel=served.pipeline_parallel_size)


def _served_as(engine: Mapping[str, Any]) -> str:
    """How the servers were started, where the plan follows them away from the defaults."""
    served, default = EngineSettings.from_record(engine), EngineSettings()
    tp, pp = served.tensor_parallel_size, served.pipeline_parallel_size
    parts = [f"TP {tp} x PP {pp}: weights and KV heads split over {tp * pp} devices"] \
        if tp * pp > 1 else []
    if served.gpu_memory_utilization != default.gpu_memory_utilization:
        parts.append(f"{served.gpu_memory_utilization:.0%} of each device's memory")
    return f"planned as the servers were started: {', '.join(parts)}" if parts else ""


def _apply_plan(row: Row, config: dict[str, Any], target: PlanTarget,
                engine: Mapping[str, Any] | None = None, block_size: int | None = None) -> None:
    _, _, tail = row.scheme.rpartition("-G")
    group = int(tail) if tail.isdigit() else 128
    try:
        if row.precision == MIXED:
            plan, weights = _plan_mixed(row, config, target, engine, block_size)
        else:
            plan = capacity.plan_capacity(config, plan_settings(
                target, row.precision, group, row.kv_dtype, engine, block_size))
            weights = plan.weight_bytes
    except PlanError as err:  # e.g. the weights do not fit the accelerator
        row.notes.append(f"plan: {err}")
        return
    row.plan = plan.metrics()  # the planner's own names (planned_*), as `qpipe plan --json`
    row.plan[capacity.WEIGHT_BYTES] = weights


def _plan_mixed(row: Row, config: dict[str, Any], target: PlanTarget,
                engine: Mapping[str, Any] | None = None, block_size: int | None = None
                ) -> tuple[capacity.CapacityPlan, int]:
    """A layer-by-layer mix has no one precision: its planned weights are the bf16 plan's
    scaled by the checkpoint's measured ratio to the baseline, and the KV cache gets the rest
    (on each device its share, as plan_capacity counts it)."""
    import dataclasses

    settings = plan_settings(target, "bf16", 128, row.kv_dtype, engine, block_size)
    bf16 = capacity.plan_capacity(config, settings)
    weights = int(bf16.weight_bytes * row.weight_ratio)
    budget = capacity.kv_budget(settings.memory_bytes or 0, settings.utilization,
                                settings.per_device(weights), settings.reserve_bytes) * \
        bf16.arch.kv_shards(settings.tensor_parallel, settings.pipeline_parallel)
    plan = capacity.plan_capacity(config, dataclasses.replace(settings, kv_budget_bytes=budget))
    row.notes.append("plan: mixed precision, planned with the bf16 weights scaled by the "
                     f"checkpoint's measured {row.weight_ratio:.3f}")
    return plan, weights


# --- bench: one reference run -------------------------------------------------------------------
def _holds(summary: BenchSummary, name: str, identity: str) -> ModelBench | None:
    entry = summary.models.get(name)
    return entry if entry is not None and entry.identity == identity else None


def reference_run(summaries: list[tuple[Path, BenchSummary]], identities: dict[str, str],
                  hardware_key: str) -> tuple[Path, BenchSummary] | None:
    """The bench run the comparison is made from: of the runs that served this baseline, the
    one on this machine's hardware that measured most of the current variants, with a speed
    sweep rather than only a capacity search (the newest on a tie). Every speedup compared
    comes from it: one baseline run, one workload, one load point."""
    ranked = []  # this machine's hardware first: rows measured on another never compare with it
    for age, (path, summary) in enumerate(summaries):  # newest first
        base = _holds(summary, BASELINE, identities[BASELINE])
        if base is None or base.status != "ok":
            continue
        covered = sum(_holds(summary, n, i) is not None for n, i in identities.items())
        same_hw = summary.hardware.get("key") == hardware_key
        swept = any(summary.headline.values())  # a search-only run has no headline point
        ranked.append(((same_hw, covered, swept, -age), path, summary))
    if not ranked:
        return None
    _, path, summary = max(ranked, key=lambda r: r[0])
    return path, summary


REFERENCE, PAIRED = "reference", "paired"


def compared_as(summary: BenchSummary, in_reference: bool, baseline_identity: str,
                measured_on: str, per_variant: bool) -> str:
    """How a row measured in ``summary`` compares: ``reference`` (in the reference run),
    ``paired`` (beside its own baseline server on the reference's hardware, a campaign on
    Ray), else why it is not comparable. A run on other hardware never is."""
    if in_reference:
        return REFERENCE
    key = summary.hardware.get("key", "unknown")
    if key != measured_on:
        return (f"measured on other hardware ({summary.hardware.get('summary', key)}) than the "
                f"comparison's reference run ({measured_on})")
    if per_variant and _holds(summary, BASELINE, baseline_identity) is not None:
        return PAIRED
    return ("another measurement than the comparison's reference run: its speedup is against "
            "another baseline run (`make bench` measures every variant in one run)")


def capacity_of(entry: ModelBench, by: str = "concurrency") -> dict[str, Any]:
    """A model's first capacity search over ``by`` (concurrency, or the arrival rate), with
    the bounded latencies at each point it visited."""
    for name, figures in entry.workloads.items():
        if figures.capacity is not None and figures.capacity.get(
                "search_by", "concurrency") == by:
            bounds = figures.capacity.get("bounds", {})
            return {"workload": name, **figures.capacity, "curve": {
                c: {k: st[k] for k in bounds if k in st} for c, st in figures.points.items()}}
    return {}


def _newest_capacity(row: Row, identity: str, summaries: list[tuple[Path, BenchSummary]],
                     hardware_key: str, prices: dict[str, dict[str, Any]],
                     target: CostTarget) -> None:
    """A capacity search made in another run on the compared hardware (``make bench
    WORKLOAD=capacity``): an absolute figure, shown with the run it comes from and priced on
    the devices that run used."""
    for by, field in (("concurrency", "capacity"), ("rate", "rate_capacity")):
        if getattr(row, field):
            continue
        for path, summary in summaries:  # newest first
            entry = _holds(summary, row.name, identity)
            found = capacity_of(entry, by) if entry is not None and entry.status == "ok" else {}
            if found and summary.hardware.get("key") == hardware_key:
                prices.setdefault(row.name, cost.price_of(target, cost.devices_of(summary)))
                setattr(row, field, {**found, "measurement": measurement_label(path, summary)})
                row.notes.append(f"capacity at the objective ({by}) from "
                                 f"{getattr(row, field)['measurement']}")
                break


def one_objective(rows: list[Row], field: str = "capacity") -> None:
    """Capacities (``field``: ``capacity`` or ``rate_capacity``) are compared at one objective
    and workload: the baseline's (else the first row's). A row searched at another is shown as
    such and gets no cost to rank."""
    searched = [r for r in rows if getattr(r, field)]
    base = next((r for r in searched if r.name == BASELINE), searched[0] if searched else None)
    if base is None:
        return
    basis = (getattr(base, field).get("workload"), getattr(base, field).get("objective"))
    for row in searched:
        cap = getattr(row, field)
        other = (cap.get("workload"), cap.get("objective"))
        if other != basis:
            cap["other_objective"] = True
            row.notes.append(f"capacity searched at {other[1]} (workload {other[0]}), not at the "
                             f"comparison's {basis[1]} (workload {basis[0]}): shown, not ranked "
                             "or priced against the others")


def _traffic(summaries: list[tuple[Path, BenchSummary]], identity: str
             ) -> dict[str, dict[str, float]]:
    """Each prompt-file or trace workload's requests as sent: the newest run of each."""
    out: dict[str, dict[str, float]] = {}
    for _, summary in summaries:  # newest first
        base = _holds(summary, BASELINE, identity)
        for name, figures in (base.workloads.items() if base is not None else ()):
            if figures.lengths and name not in out:
                out[name] = figures.lengths
    return out


def _measured_in(name: str, identity: str, summaries: list[tuple[Path, BenchSummary]]
                 ) -> tuple[Path, BenchSummary, ModelBench] | None:
    for path, summary in summaries:
        entry = _holds(summary, name, identity)
        if entry is not None:
            return path, summary, entry
    return None


def measurement_label(path: Path, summary: BenchSummary) -> str:
    return f"bench {path.parent.name}" + (f" ({summary.measured})" if summary.measured else "")


def _apply_bench(row: Row, summary: BenchSummary, entry: ModelBench) -> tuple[str, int]:
    """Fill the bench fields; returns (headline workload, its load point)."""
    workloads = [Path(w).stem for w in summary.workloads] or list(entry.workloads)
    # the headline: the first sweep (a capacity search has no load points of its own)
    first = next((w for w in workloads if summary.headline.get(w)), workloads[0])
    head = summary.headline.get(first) or None
    row.serving, row.serving_reason, row.serving_log = entry.status, entry.reason, entry.log
    row.kv, row.engine = dict(entry.kv), dict(entry.engine)
    if row.engine.get("fp8_weight_only"):
        row.notes.append(f"served as {row.engine['scheme']}: its speed is not an FP8 W8A8 "
                         "speed")
    if row.engine.get("kernels_by_layer_text"):
        row.notes.append(f"served on {row.engine['kernels_by_layer_text']}")
    row.peak_memory_bytes = entry.peak_memory_bytes
    data = entry.workloads.get(first)
    row.sweep = dict(data.points) if data else {}
    if head is None and row.sweep:
        head = sorted(row.sweep)[len(row.sweep) // 2]
    row.headline = row.sweep.get(head, {}) if head is not None else {}
    if row.name != BASELINE:
        row.crossover = crossover.sentence(row.sweep)
    row.capacity = capacity_of(entry)
    row.rate_capacity = capacity_of(entry, "rate")
    for name in (w for w in workloads if w != first):
        other = entry.workloads.get(name)
        if other is not None and other.prefix_cache_ttft_speedup is not None:
            row.prefix = {k: v for k, v in other.counters().items()
                          if k in ("prefix_cache_hit_rate", "prefix_cache_expected_hit_rate",
                                   "prefix_cache_ttft_speedup")}
    return first, head or 0


# --- eval ---------------------------------------------------------------------------------------
def _apply_eval(row: Row, summary: RecoverySummary, base: BaselineLike, identity: str,
                threshold: float | None = None) -> None:
    """The variant's current task results (this checkpoint, baseline and task files), its
    suite figures and the gate's verdict on them; stale results are named, never used."""
    entries, stale = gate.current_tasks(summary, identity, base.identity)
    row.tasks = entries
    row.suites = gate.suite_figures(entries)
    backends = {t.backend for t in entries.values()}
    row.eval_backend = EMULATED if EMULATED in backends else (SERVED if backends else None)
    div = summary.divergence or {}
    if div.get("identity") == identity:
        row.divergence = {k: v for k, v in div.items() if isinstance(v, (int, float))}
    own = gate.threshold_of(row.recipe, variant_dir(base.name, row.recipe))
    row.threshold = threshold if threshold is not None else own
    row.threshold_from = "recipe" if threshold is None else "campaign"
    if threshold is not None and threshold != own:
        row.notes.append(f"gate threshold {threshold:g}%: the campaign's, instead of recipe "
                         f"{row.recipe}'s own {own:g}% (THRESHOLD= or the campaign file's "
                         "threshold:)")
    verdict = gate.judge(entries, row.recipe, row.threshold, stale=stale)
    row.gate_status, row.gate_reason = verdict.status, verdict.reason()
    if stale:
        row.notes.append("eval: not judged, stale: " + "; ".join(stale)
                         + f" (make eval RECIPE={row.name})")


# --- precision search: predicted against measured damage ----------------------------------------
def _tables(base: BaselineLike) -> list[SensitivityTable]:
    """This baseline's sensitivity tables, newest first."""
    found = []
    for path in SensitivityTable.root(base.name).glob(f"*/{SensitivityTable.FILE}"):
        table = SensitivityTable.read(path)
        if table is not None and table.baseline.get("identity") == base.identity:
            found.append((path.stat().st_mtime, table))
    return [t for _, t in sorted(found, key=lambda x: -x[0])]


def _apply_search(row: Row, base: BaselineLike, tables: list[SensitivityTable]) -> None:
    """What the sensitivity model predicted for this variant: a searched recipe's own
    prediction, or, for a uniform int4/int8 recipe, the table with every unit in its format."""
    recipe = variant_dir(base.name, row.recipe) / "qpipe_recipe.yaml"
    try:
        found = recipe_files.load(str(recipe)).search if recipe.is_file() else {}
    except RecipeError:
        found = {}
    if "predicted_damage" in found:
        row.search = {"predicted_kl": float(found["predicted_damage"]),
                      "predicted_weight_bytes": int(found.get("weight_bytes") or 0),
                      "basis": f"searched: {found.get('how', '?')}"}
        return
    table = next((t for t in tables if row.recipe in t.formats), None)
    if table is not None:
        size, damage = table.uniform(row.recipe)
        row.search = {"predicted_kl": damage, "predicted_weight_bytes": size,
                      "basis": f"every unit at {row.recipe} in the sensitivity table "
                               "(round-to-nearest)"}


# --- the join -----------------------------------------------------------------------------------
def _rows(base: BaselineLike, recipes: list[str] | None) -> tuple[list[Row], dict[str, str]]:
    base_bytes = checkpoint.measure(base.path).weight_bytes
    rows = [Row(name=BASELINE, recipe="none", scheme="bf16", format="dense", precision="bf16",
                weight_bytes=base_bytes, weight_ratio=1.0)]
    identities = {BASELINE: base.identity}
    for name, manifest in manifests(base.name, recipes).items():
        rows.append(Row(name=name, recipe=name, scheme=manifest.recipe.scheme,
                        format=manifest.format,
                        precision=PRECISION_OF_FORMAT.get(manifest.format, "bf16"),
                        kv_dtype=checkpoint_kv_dtype(json.loads(
                            (variant_dir(base.name, name) / "config.json").read_text())) or "bf16",
                        weight_bytes=manifest.weight_bytes,
                        weight_ratio=manifest.weight_bytes / base_bytes,
                        quantize_seconds=manifest.quantize_seconds))
        identities[name] = manifest.cache_key
    return rows, identities


def collect(base: BaselineLike, recipes: list[str] | None = None,
            target: PlanTarget | None = None,
            failures: list[dict[str, str]] | None = None, objective: str = "speed",
            cost_target: CostTarget | None = None, per_variant: bool = False,
            threshold: float | None = None) -> Comparison:
    """One row for the baseline and each variant on disk (or ``recipes``). ``failures`` are a
    campaign's failed stages (e.g. a recipe that did not quantize), shown beside the rows.
    ``per_variant``: each variant was benched beside its own baseline server (a campaign on
    Ray), so a variant's speedup from its own run, paired there, is compared too."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)} "
                          "(OBJECTIVE= in make, --objective in the CLI).")
    prof = hardware.profile()
    target, plan_note = resolve_plan_target(target or PlanTarget(), prof)
    rows, identities = _rows(base, recipes)
    config = json.loads((base.path / "config.json").read_text())
    summaries = BenchSummary.all(base.name)
    reference = reference_run(summaries, identities, prof.key())
    # the hardware every compared figure was measured on: the reference run's, not
    # necessarily this machine's (a comparison run on a cluster's CPU driver node)
    measured_on = reference[1].hardware.get("key", "") if reference else prof.key()
    cost_target = cost_target or CostTarget()
    prices: dict[str, dict[str, Any]] = {}
    workload, load_point, sources = "", None, {}
    measurement: dict[str, str] = {}
    traffic = _traffic(summaries, identities[BASELINE])
    if reference is not None:
        ref_path, ref = reference
        measurement = {"run": measurement_label(ref_path, ref), "path": str(ref_path),
                       "hardware": ref.hardware.get("summary", "unknown"),
                       "pairing": ref.speedup_pairing,
                       "reference": (f"the baseline served in {ref.reference['dtype']} ("
                                     f"{ref.reference['why']})") if ref.reference else "",
                       "reference_dtype": ref.reference.get("dtype", "")}
    failed = list(failures or [])
    tables = _tables(base)
    # planned as the servers were started (memory utilisation, TP x PP), where they were
    engine = reference[1].engine if reference is not None else None
    # the KV block each engine used, where the plan is for the card it was measured on (a
    # GPU attention backend's block is not always the preset's 16: FlashInfer, MLA)
    on_measured_card = (reference is not None and reference[1].target == "cuda"
                        and not plan_note and measured_on == prof.key())
    served_as = _served_as(engine or {})
    if served_as:
        plan_note = f"{plan_note}; {served_as}" if plan_note else served_as
    for row in rows:
        in_reference = _holds(reference[1], row.name, identities[row.name]) \
            if reference is not None else None
        block = int(in_reference.kv.get("kv_block_size") or 0) or None \
            if on_measured_card and in_reference is not None else None
        _apply_plan(row, config, target, engine, block)
        if block and get_accelerator(target.gpu).block_size != block:
            row.notes.append(f"plan: KV blocks of {block} tokens, as its engine used them "
                             "on this card")
        if row.name != BASELINE:
            _apply_search(row, base, tables)
        found = (reference[0], reference[1], in_reference) if reference and in_reference \
            else _measured_in(row.name, identities[row.name], summaries)
        if found:
            path, summary, entry = found
            head_workload, head_point = _apply_bench(row, summary, entry)
            row.measurement = measurement_label(path, summary)
            sources[f"bench:{row.name}"] = str(path)
            prices[row.name] = cost.price_of(cost_target, cost.devices_of(summary))
            basis = compared_as(summary, in_reference is not None, identities[BASELINE],
                                measured_on, per_variant)
            if basis == REFERENCE:
                workload, load_point = head_workload, head_point
            elif basis == PAIRED:
                row.notes.append(f"speed measured beside its own baseline server in "
                                 f"{row.measurement} (one task per variant on the cluster): its "
                                 "speedup is paired there, on the same hardware")
            else:
                row.comparable = False
                row.notes.append(f"speed from {row.measurement}, {basis}, so it is shown but "
                                 "not compared, priced against the others or recommended")
            if row.serving == "ok" and not (row.capacity and row.rate_capacity):
                _newest_capacity(row, identities[row.name], summaries, measured_on, prices,
                                 cost_target)
            if row.serving == "failed":
                failed.append({"variant": row.name, "stage": "bench",
                               "reason": row.serving_reason, "log": row.serving_log})
        if row.name == BASELINE:
            continue
        eval_failed = EvalFailure.load(base.name, row.name)
        evaluated = RecoverySummary.load(base.name, row.name)
        if eval_failed is not None and eval_failed.identity == identities[row.name]:
            row.gate_reason = f"its last evaluation failed: {eval_failed.reason}"
            failed.append({"variant": row.name, "stage": "eval", "reason": eval_failed.reason,
                           "log": ""})
        elif evaluated is not None:
            _apply_eval(row, evaluated, base, identities[row.name], threshold)
            sources[f"eval:{row.name}"] = str(RecoverySummary.path(base.name, row.name))
    priced = prices.get(BASELINE) or cost.price_of(cost_target, {"unit": "host", "kind": "host"})
    one_objective(rows)
    one_objective(rows, "rate_capacity")
    for row in rows:
        if row.serving == "ok" and row.comparable and row.name in prices:
            row.price = prices[row.name]
            ranked = row.model_copy(update={
                f: {} for f in ("capacity", "rate_capacity")
                if getattr(row, f).get("other_objective")})
            row.cost = cost.figures(ranked, row.price["price_per_hour"], cost_target)
    best, reason = recommend(rows, objective)
    return Comparison(baseline=base.name, rows=rows, workload=workload, load_point=load_point,
                      plan_target=target, cost_target=cost_target, price=priced,
                      traffic=traffic,
                      recommendation=best, reason=reason, sources=sources,
                      failures=failed, hardware=measurement.get("hardware", ""),
                      measurement=measurement, objective=objective, plan_note=plan_note)
