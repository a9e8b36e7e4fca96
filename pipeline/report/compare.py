"""Join what each stage recorded into one row per variant, and name the variant to ship.

A fold over typed artifacts (nothing is re-measured, no model file or recipe is read):

- the baseline: its :class:`~pipeline.core.artifacts.BaselineRecord` (weight bytes, config);
- quantize: each variant's :class:`~pipeline.core.artifacts.Manifest`;
- bench: one :class:`~pipeline.core.artifacts.BenchSummary` for every row (the reference run:
  one baseline run, workload and load point, :mod:`.reference`); a variant measured only
  elsewhere is marked;
- eval: each variant's current task results, judged by :mod:`pipeline.eval.gate`
  (:mod:`.accuracy`);
- plan: the capacity planner on the baseline's config in each variant's precision
  (:mod:`.placement`).
"""

from __future__ import annotations

from pipeline.core import hardware
from pipeline.core.artifacts import (
    UNSUPPORTED,
    Baseline,
    BaselineRecord,
    BenchSummary,
    Comparison,
    CostTarget,
    EvalFailure,
    Failure,
    Manifest,
    PlanTarget,
    Price,
    RecoverySummary,
    Row,
    manifests,
)
from pipeline.core.errors import ConfigError
from pipeline.core.variant import BASELINE
from pipeline.plan.accelerators import get_accelerator
from pipeline.report import cost
from pipeline.report.accuracy import apply_eval, apply_search, sensitivity_tables
from pipeline.report.placement import (
    apply_plan,
    resolve_plan_target,
    served_as,
)
from pipeline.report.recommend import OBJECTIVES, recommend
from pipeline.report.reference import (
    PAIRED,
    REFERENCE,
    apply_bench,
    compared_as,
    holds,
    measured_in,
    measurement_label,
    newest_capacity,
    one_objective,
    own_dtype_speedup,
    reference_run,
    traffic,
)


def baseline_record(base: Baseline) -> BaselineRecord:
    """The baseline's record, as its stages resolved it."""
    record = BaselineRecord.of(base.name)
    if record is None or record.identity != base.identity:
        raise ConfigError(
            f"{BaselineRecord.path_of(base.name)}: "
            + ("missing" if record is None else f"records identity {record.identity}, not "
               f"{base.identity}") + f". Fix: `make baseline BASELINE={base.path}` (any "
            "stage) records the baseline as it is now.")
    return record


def _rows(base: Baseline, record: BaselineRecord, made: dict[str, Manifest]
          ) -> tuple[list[Row], dict[str, str]]:
    base_bytes = record.weight_bytes
    rows = [Row(name=BASELINE, recipe="none", scheme="bf16", format="dense", precision="bf16",
                weight_bytes=base_bytes, weight_ratio=1.0)]
    identities = {BASELINE: base.identity}
    for name, manifest in made.items():
        rows.append(Row(name=name, recipe=name, scheme=manifest.recipe.scheme,
                        format=manifest.format,
                        precision=manifest.precision,
                        group_size=manifest.weights.group_size if manifest.weights else None,
                        symmetric=manifest.weights.symmetric if manifest.weights else True,
                        kv_dtype=manifest.kv_dtype or "bf16",
                        weight_bytes=manifest.weight_bytes,
                        weight_ratio=manifest.weight_bytes / base_bytes,
                        quantize_seconds=manifest.quantize_seconds))
        identities[name] = manifest.cache_key
    return rows, identities


def collect(base: Baseline, recipes: list[str] | None = None,
            target: PlanTarget | None = None,
            failures: list[Failure] | None = None, objective: str = "speed",
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
    record = baseline_record(base)
    made = {name: m.recorded(base.name, name) for name, m in manifests(base.name, recipes).items()}
    rows, identities = _rows(base, record, made)
    config = record.config
    summaries = BenchSummary.all(base.name)
    reference = reference_run(summaries, identities, prof.key())
    # the hardware every compared figure was measured on: the reference run's, not
    # necessarily this machine's (a comparison run on a cluster's CPU driver node)
    measured_on = reference[1].hardware.get("key", "") if reference else prof.key()
    cost_target = cost_target or CostTarget()
    prices: dict[str, Price] = {}
    workload, load_point, sources = "", None, {}
    measurement: dict[str, str] = {}
    traffic_of = traffic(summaries, identities[BASELINE])
    if reference is not None:
        ref_path, ref = reference
        measurement = {"run": measurement_label(ref_path, ref), "path": str(ref_path),
                       "hardware": ref.hardware.get("summary", "unknown"),
                       "hardware_key": measured_on,
                       "pairing": ref.speedup_pairing,
                       "reference": (f"the baseline served in {ref.reference['dtype']} ("
                                     f"{ref.reference['why']})") if ref.reference else "",
                       "reference_dtype": ref.reference.get("dtype", "")}
    failed = list(failures or [])
    tables = sensitivity_tables(base)
    # planned as the servers were started (memory utilisation, TP x PP), where they were
    engine = reference[1].engine if reference is not None else None
    # the KV block each engine used, where the plan is for the card it was measured on (a
    # GPU attention backend's block is not always the preset's 16: FlashInfer, MLA)
    on_measured_card = (reference is not None and reference[1].target == "cuda"
                        and not plan_note and measured_on == prof.key())
    served = served_as(engine or {})
    if served:
        plan_note = f"{plan_note}; {served}" if plan_note else served
    for row in rows:
        in_reference = holds(reference[1], row.name, identities[row.name]) \
            if reference is not None else None
        block = int(in_reference.kv.get("kv_block_size") or 0) or None \
            if on_measured_card and in_reference is not None else None
        apply_plan(row, config, target, engine, block)
        if block and get_accelerator(target.gpu).block_size != block:
            row.notes.append(f"plan: KV blocks of {block} tokens, as its engine used them "
                             "on this card")
        if row.name != BASELINE:
            apply_search(row, made[row.name].recipe.search, tables)
        found = (reference[0], reference[1], in_reference) if reference and in_reference \
            else measured_in(row.name, identities[row.name], summaries)
        if found:
            path, summary, entry = found
            head_workload, head_point = apply_bench(row, summary, entry)
            row.measurement = measurement_label(path, summary)
            sources[f"bench:{row.name}"] = str(path)
            prices[row.name] = cost.price_of(cost_target, cost.devices_of(summary))
            for field in ("capacity", "rate_capacity"):  # priced on the run that measured it
                if (found_cap := getattr(row, field)) is not None:
                    setattr(row, field, found_cap.model_copy(update={"price": prices[row.name]}))
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
            if row.serving == "ok" and (row.capacity is None or row.rate_capacity is None):
                newest_capacity(row, identities[row.name], summaries, measured_on,
                                cost_target)
            if row.serving == "failed":
                failed.append(Failure(variant=row.name, stage="bench", reason=row.serving_reason,
                                      log=row.serving_log))
        if row.name == BASELINE:
            continue
        eval_failed = EvalFailure.load(base.name, row.name)
        evaluated = RecoverySummary.load(base.name, row.name)
        if eval_failed is not None and eval_failed.identity == identities[row.name] \
                and eval_failed.status == UNSUPPORTED:
            row.gate_status, row.gate_reason = UNSUPPORTED, eval_failed.reason
            row.notes.append(f"accuracy unsupported here: {eval_failed.reason}")
        elif eval_failed is not None and eval_failed.identity == identities[row.name]:
            row.gate_reason = f"its last evaluation failed: {eval_failed.reason}"
            failed.append(Failure(variant=row.name, stage="eval", reason=eval_failed.reason))
        elif evaluated is not None:
            apply_eval(row, evaluated, base, identities[row.name], made[row.name], threshold)
            sources[f"eval:{row.name}"] = str(RecoverySummary.path(base.name, row.name))
    priced = prices.get(BASELINE) or cost.price_of(cost_target, {"unit": "host", "kind": "host"})
    one_objective(rows)
    one_objective(rows, "rate_capacity")
    for row in rows:
        if row.serving == "ok" and row.comparable and row.name in prices:
            row.price = cost.capacity_price(row, prices[row.name])
            row.cost = cost.figures(row, cost_target, prices[row.name])
    best, reason = recommend(rows, objective)
    return Comparison(baseline=base.name, rows=rows, workload=workload, load_point=load_point,
                      own_dtype_speedup=own_dtype_speedup(reference[1] if reference else None),
                      plan_target=target, cost_target=cost_target, price=priced,
                      traffic=traffic_of,
                      recommendation=best, reason=reason, sources=sources,
                      failures=failed, hardware=measurement.get("hardware", ""),
                      measurement=measurement, objective=objective, plan_note=plan_note)
