"""The comparison: the verdict, the table in every format, and the campaign files."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from pipeline.campaign import files as campaigns
from pipeline.campaign import runner as campaign
from pipeline.core import tracking
from pipeline.core.artifacts import (
    BenchSummary,
    Comparison,
    CostTarget,
    ModelBench,
    PlanFigures,
    PlanTarget,
    PointFigures,
    Prediction,
    Price,
    Recovery,
    Row,
    SuiteFigure,
    TaskEntry,
    WorkloadFigures,
)
from pipeline.core.errors import ConfigError
from pipeline.core.settings import from_options
from pipeline.core.speedup import Speedup, verdict_of
from pipeline.eval import gate
from pipeline.plan import capacity
from pipeline.report import compare, cost, placement, plots, reference
from pipeline.report import render as report
from pipeline.report.recommend import compared, recommend


def planned(paged: int, worst: int = 0) -> PlanFigures:
    """A plan whose concurrency figures are ``paged`` and ``worst`` (the rest zero)."""
    zero = {name: 0 for name in PlanFigures.model_fields}
    return PlanFigures(**{**zero, "planned_max_concurrency_paged": paged,
                          "planned_max_concurrency_worst_case": worst})


def _speedup(point: float, low: float, high: float, p_faster: float) -> Speedup:
    return Speedup(point, low, high, 4, 0.95, verdict_of(low, high), p_faster)


def _row(name: str, speedup: float | None, status: str, low: float = 99.5,
         serving: str = "ok", backend: str = "served", recovery: float = 100.5) -> Row:
    row = Row(name=name, recipe=name, scheme="S", format="float-quantized", precision="fp8",
              weight_bytes=163_000_000, weight_ratio=0.61, serving=serving,
              eval_backend=backend, threshold=99.0, gate_status=status,
              gate_reason="" if status == gate.PASS else f"suite app: {name} too wide")
    if speedup is not None:
        row.headline = PointFigures(
            metrics={tracking.OUTPUT_TOKENS_PER_S: 20 * speedup,
                     f"{tracking.OUTPUT_TOKENS_PER_S}_min": 19 * speedup,
                     f"{tracking.OUTPUT_TOKENS_PER_S}_max": 21 * speedup,
                     tracking.TTFT_MS_P50: 100.0, tracking.TTFT_MS_P99: 150.0,
                     tracking.ITL_MS_P50: 10.0, tracking.ITL_MS_P99: 12.0},
            speedup=_speedup(speedup, speedup - 0.1, speedup + 0.1,
                             0.001 if speedup > 1.1 else 0.5))
        row.sweep = {1: row.headline.model_copy(), 4: row.headline.model_copy()}
    row.suites = {"app": SuiteFigure(recovery_pct=recovery, ci_low=low, ci_high=recovery + 1.5,
                                     tasks=["app_facts"], backend=backend)}
    row.tasks = {"app_facts": TaskEntry(suite="app", backend=backend, primary_metric="acc,none",
                                        recovery={"acc,none": Recovery(
                                            n=200, baseline_score=0.8, variant_score=0.8,
                                            chance=0.25, meaningful=True,
                                            recovery_pct=recovery, ci_low=low,
                                            ci_high=recovery + 1.5, flips=4, flip_rate=0.02,
                                            gained=2, lost=2)})}
    row.plan = planned(40, 10)
    return row


def _baseline() -> Row:
    row = Row(name="baseline", recipe="none", scheme="bf16", format="dense", precision="bf16",
              weight_bytes=269_000_000, weight_ratio=1.0)
    row.headline = PointFigures(metrics={tracking.OUTPUT_TOKENS_PER_S: 20.0,
                                         f"{tracking.OUTPUT_TOKENS_PER_S}_min": 19.0,
                                         f"{tracking.OUTPUT_TOKENS_PER_S}_max": 21.0})
    row.sweep = {1: row.headline.model_copy()}
    return row


def _comparison(rows: list[Row]) -> Comparison:
    best, reason = recommend(rows)
    return Comparison(baseline="Tiny", rows=rows, workload="chat", load_point=4,
                      plan_target=PlanTarget(), recommendation=best, reason=reason)


def test_the_fastest_variant_that_clears_its_gate_is_recommended() -> None:
    rows = [_baseline(), _row("fp8", 1.2, gate.PASS), _row("int4", 1.6, gate.PASS),
            _row("int8", 2.0, gate.INCONCLUSIVE)]
    best, reason = recommend(rows)
    assert best == "int4"  # int8 is faster but its gate is inconclusive
    assert reason.startswith("int4 (objective speed: ") and \
        "1.60x [1.50, 1.70], n=4 the baseline's throughput" in reason
    assert "app 100.5% [99.5, 102.0]" in reason and "threshold 99%" in reason


def test_a_slower_variant_or_one_not_shown_faster_is_never_shipped_for_speed() -> None:
    slower = _row("int8", 0.5, gate.PASS)
    slower.headline.speedup = _speedup(0.5, 0.3, 0.8, 0.5)
    straddles = _row("fp8", 1.05, gate.PASS)  # [0.95, 1.15]
    best, reason = recommend([_baseline(), slower, straddles])
    assert best is None
    assert "int8: passes its gate but is slower than the baseline: 0.50x [0.30, 0.80]" in reason
    assert "fp8: passes its gate but is not shown faster" in reason
    assert "inconclusive at n = 4" in reason
    # for memory, speed is not the question: the smallest passing variant
    small = _row("int4", 0.9, gate.PASS)
    small.weight_bytes = 113_000_000
    best, reason = recommend([_baseline(), slower, straddles, small], "memory")
    assert best == "int4" and "objective memory" in reason


def test_holms_family_is_the_variants_that_pass_their_gates() -> None:
    """p = 0.02 for "faster": not enough over four variants (0.02 > 0.05 / 4), enough over the
    two the gate lets through (0.02 <= 0.05 / 2); the gate decided on scores, not speed."""
    rows = [_baseline()]
    for name, status in (("int8", gate.PASS), ("fp8", gate.PASS), ("int4", gate.FAIL),
                         ("w8a16", gate.INCONCLUSIVE)):
        row = _row(name, 1.3, status)
        row.headline.speedup = _speedup(1.3, 1.2, 1.4, 0.02)
        rows.append(row)
    assert set(compared(rows)) == {"int8", "fp8"}
    best, _ = recommend(rows)
    assert best in ("int8", "fp8")
    for row in rows[3:]:
        row.gate_status = gate.PASS
    best, reason = recommend(rows)
    assert best is None and "not after Holm's correction over the 4 variants that pass" in reason


def test_capacity_objective_takes_the_most_requests_at_the_plan_target() -> None:
    a, b = _row("fp8", 1.5, gate.PASS), _row("int4", 1.2, gate.PASS)
    b.plan = planned(90, 20)
    assert recommend([_baseline(), a, b], "capacity")[0] == "int4"
    assert recommend([_baseline(), a, b], "speed")[0] == "fp8"
    with pytest.raises(ConfigError, match="objective 'latency'"):
        compare.collect(None, objective="latency")  # type: ignore[arg-type]


def _searched(row: Row, tps: float, censored: bool = False) -> Row:
    """A capacity of 8 users [8-9] at ``tps``, 0.9x at the interval's low end and 1.2x at its
    high end (the cost's dearest and cheapest), priced at $0.36/h."""
    price = Price(price_per_hour=0.36, price_per_device_hour=0.36, example=True, source="test")
    row.capacity = {"workload": "capacity", "objective": "o", tracking.SLO_MAX_CONCURRENCY: 8,
                    "outcome": "censored" if censored else "estimated", "censored": censored,
                    tracking.SLO_OUTPUT_TOKENS_PER_S: tps,
                    tracking.SLO_REQUESTS_PER_S: tps / 16, "price": price,
                    tracking.SLO_CAPACITY_LOW: 8, tracking.SLO_CAPACITY_HIGH: None if censored
                    else 9,
                    **({} if censored else {
                        tracking.SLO_OUTPUT_TOKENS_PER_S + "_at_low": 0.9 * tps,
                        tracking.SLO_OUTPUT_TOKENS_PER_S + "_at_high": 1.2 * tps})}
    row.price = price
    row.cost = cost.figures(row, CostTarget(), price)
    return row


def test_cost_objective_takes_the_cheapest_variant_shown_cheaper_than_the_baseline() -> None:
    base = _searched(_baseline(), 40.0)  # $2.08-2.78 per million
    cheap, close, failing = (_searched(_row("int8", 1.1, gate.PASS), 120.0),
                             _searched(_row("fp8", 1.5, gate.PASS), 45.0),
                             _searched(_row("int4", 0.8, gate.INCONCLUSIVE), 300.0))
    assert base.cost.usd_per_million_output_tokens_min == pytest.approx(0.36 / (48 * 3600) * 1e6)
    assert base.cost.usd_per_million_output_tokens_max == pytest.approx(0.36 / (36 * 3600) * 1e6)
    best, reason = recommend([base, cheap, close, failing], "cost")
    assert best == "int8"  # int4 is cheaper still, but its gate is inconclusive
    assert "$0.83 [0.69-0.93] per million output tokens at 8 [8-9] concurrent requests" in reason
    assert "priced at $0.36/h example price" in reason
    # fp8's range overlaps the baseline's: not shown cheaper, so never "the cheapest"
    best, reason = recommend([base, close], "cost")
    assert best is None and "fp8: passes its gate but is not shown cheaper than the baseline: " \
        "its cost range $2.22 [1.85-2.47] overlaps the baseline's $2.50 [2.08-2.78]" in reason
    # figures of a measured run: the only passing variant costs twice the baseline
    dear = _searched(_row("int4", 0.8, gate.PASS), 20.0)
    best, reason = recommend([base, dear], "cost")
    assert best is None and "int4: passes its gate but is not cheaper than the baseline: " \
        "dearer than the baseline: $4.17 at least against its $2.78 at most" in reason
    # a censored baseline's cost is only a bound: nothing is shown cheaper than it
    bound = _searched(_baseline(), 40.0, censored=True)
    assert bound.cost.cost_bound == "upper" and cost.range_text(bound.cost) == "<= $2.50"
    best, reason = recommend([bound, cheap], "cost")
    assert best is None and "its cost is only an upper bound (<= $2.50)" in reason
    # without a capacity at the objective there is no cost, and no recommendation for it
    close.cost = {}
    best, reason = recommend([base, close], "cost")
    assert best is None and "no cost figure" in reason


def test_capacities_are_compared_at_one_objective_and_workload() -> None:
    base, a, b = _baseline(), _row("int8", 1.1, gate.PASS), _row("int4", 1.1, gate.PASS)
    for row, objective in ((base, "TTFT p90 <= 500 ms"), (a, "TTFT p90 <= 500 ms"),
                           (b, "TTFT p90 <= 1000 ms")):
        row.capacity = {"workload": "capacity", "objective": objective,
                        tracking.SLO_MAX_CONCURRENCY: 8}
    reference.one_objective([base, a, b])
    assert not a.capacity.other_objective and b.capacity.other_objective
    assert "not at the comparison's TTFT p90 <= 500 ms" in b.notes[0]
    assert report._capacity_cell(b) == "8 (other objective, not ranked)"


def test_no_recommendation_names_every_reason() -> None:
    rows = [_baseline(), _row("int8", 2.0, gate.FAIL),
            _row("mxfp4", None, gate.PASS, serving="unsupported", backend="emulated"),
            _row("int4", 2.5, gate.PASS)]
    rows[2].serving_reason = "Failed to find a kernel"
    rows[3].comparable, rows[3].measurement = False, "bench abc (2026-11-30T10:00:00+00:00)"
    best, reason = recommend(rows)
    assert best is None
    assert "int8: gate fail: suite app: int8 too wide" in reason
    assert "mxfp4: passes its gate but was not served here (Failed to find a kernel)" in reason
    assert "int4: passes its gate but its speed is from another measurement (bench abc" in reason
    assert recommend([_baseline()])[1].endswith("no variant on disk (make quantize)")


def _summary(models: dict[str, str], hardware_key: str = "cpu-x") -> BenchSummary:
    return BenchSummary(baseline="Tiny", target="cpu", hardware={"key": hardware_key}, models={
        name: ModelBench(recipe=name, identity=identity, status="ok", format="dense")
        for name, identity in models.items()})


def test_the_comparison_uses_one_reference_run_after_a_partial_rebench() -> None:
    """`make bench RECIPE=int4` after a campaign: the full run stays the reference."""
    identities = {"baseline": "B", "fp8": "F", "int4": "I", "int8": "E"}
    full = (Path("full/summary.json"), _summary({"baseline": "B", "fp8": "F", "int4": "I",
                                                 "int8": "E"}))
    partial = (Path("partial/summary.json"), _summary({"baseline": "B", "int4": "I"}))
    newest_first = [partial, full]
    assert reference.reference_run(newest_first, identities, "cpu-x")[0] == full[0]
    # int4 quantized again: only the partial run measured the new checkpoint; the reference
    # is still the run that covers most variants, and int4's row is marked as from another
    identities["int4"] = "I2"
    partial[1].models["int4"].identity = "I2"
    assert reference.reference_run(newest_first, identities, "cpu-x")[0] == full[0]
    # a run on this machine's hardware wins over one made elsewhere
    elsewhere = (Path("gpu/summary.json"), _summary(dict(identities), "cuda-h100"))
    assert reference.reference_run([elsewhere, full], identities, "cpu-x")[0] == full[0]
    assert reference.reference_run([elsewhere], identities, "cpu-x")[0] == elsewhere[0]
    assert reference.reference_run([], identities, "cpu-x") is None


def test_a_run_from_other_hardware_is_never_comparable_even_beside_its_own_baseline() -> None:
    here = _summary({"baseline": "B", "int8": "E"}, "cpu-x")
    gpu = _summary({"baseline": "B", "int8": "E"}, "cuda-h100")
    gpu.hardware["summary"] = "NVIDIA H100"
    assert reference.compared_as(here, True, "B", "cpu-x", False) == reference.REFERENCE
    assert reference.compared_as(here, False, "B", "cpu-x", True) == reference.PAIRED
    why = reference.compared_as(gpu, False, "B", "cpu-x", True)
    assert why.startswith("measured on other hardware (NVIDIA H100)")
    assert "another baseline run" in reference.compared_as(here, False, "B", "cpu-x", False)
    # the reference's own hardware is what counts, not the machine running the comparison
    assert reference.compared_as(gpu, False, "B", "cuda-h100", True) == reference.PAIRED


def test_a_capacity_search_alone_does_not_displace_the_sweep_as_the_reference() -> None:
    """`make bench WORKLOAD=capacity` after a campaign: it covers every variant too, but has no
    load point to compare speed at; the campaign's sweep stays the reference."""
    identities = {"baseline": "B", "int8": "E"}
    sweep = (Path("sweep/summary.json"), _summary(dict(identities)))
    sweep[1].headline = {"chat": 4, "capacity": 0}
    search = (Path("search/summary.json"), _summary(dict(identities)))
    search[1].headline = {"capacity": 0}
    assert reference.reference_run([search, sweep], identities, "cpu-x")[0] == sweep[0]
    # the capacity itself is an absolute figure: shown from the search's run, and said so
    search[1].measured = "2026-11-30T21:51:10+00:00"
    search[1].models["int8"].workloads = {"capacity": WorkloadFigures(
        points={12: {"ttft_ms_p99": 480.0, "output_tokens_per_s": 216.0}},
        capacity={"workload": "capacity", "objective": "o", "slo_max_concurrency": 12,
                  "bounds": {"ttft_ms_p99": 500.0}})}
    row = _row("int8", 1.2, gate.PASS)
    reference.newest_capacity(row, "E", [search, sweep], "cpu-x", CostTarget())
    assert row.capacity.price is not None and row.capacity.price.example
    assert row.capacity.price.price_per_hour == 0.10
    assert row.capacity.slo_max_concurrency == 12
    assert row.capacity.curve == {12: {"ttft_ms_p99": 480.0}}
    assert row.notes == ["capacity at the objective (concurrency) from bench search "
                         "(2026-11-30T21:51:10+00:00)"]
    other = _row("int8", 1.2, gate.PASS)  # measured on other hardware: not used
    reference.newest_capacity(other, "E", [search, sweep], "cuda-h100", CostTarget())
    assert other.capacity is None and other.notes == []


def test_report_formats_carry_the_same_rows_and_the_emulated_mark(tmp_path: Path) -> None:
    emulated = _row("mxfp4", None, gate.PASS, serving="unsupported", backend="emulated")
    emulated.serving_reason = "Failed to find a kernel"
    comparison = _comparison([_baseline(), _row("fp8", 1.25, gate.PASS), emulated])

    text = report.terminal(comparison)
    assert "recommendation: ship fp8 (objective speed" in text
    assert "1.25x [1.15, 1.35], n=4 faster" in text and "100.5% [99.5, 102.0] [emulated]" in text
    assert "mxfp4: accuracy from the emulated path" in text

    md = report.markdown(comparison)
    assert md.count("\n| ") == 4  # header + 3 rows
    assert "unsupported here" in md

    rows = list(csv.DictReader(io.StringIO(report.csv_text(comparison))))
    assert [r["variant"] for r in rows] == ["baseline", "fp8", "mxfp4"]
    assert float(rows[1]["speedup"]) == pytest.approx(1.25)
    assert rows[2]["eval_backend"] == "emulated" and rows[2]["speedup"] == ""
    assert float(rows[1]["recovery_pct.app_ci_low"]) == pytest.approx(99.5)

    files = report.write(comparison, tmp_path / "out", {"git_commit": "abc123"})
    assert [f.name for f in files] == list(report.FILES)
    page = files[0].read_text()
    assert page.count("<svg") == len(plots.PLOTS)
    assert 'id="comparison"' in page and "abc123" in page and "[emulated]" in page
    assert json.loads(files[3].read_text())["recommendation"] == "fp8"
    written = Comparison.read(files[3])  # the JSON is the typed artifact, with its provenance
    assert written.meta["git_commit"] == "abc123"
    assert written.model_copy(update={"meta": {}}) == comparison
    assert not list(tmp_path.glob(".tmp-*"))


def test_shipped_campaigns_load_and_bad_ones_name_the_field(tmp_path: Path) -> None:
    default, quick = campaigns.load("default"), campaigns.load("quick")
    assert default.workloads == ("chat", "prefix") and default.plan.context == 2048
    assert default.capacity_workload == "capacity"
    assert set(quick.recipes) <= set(default.recipes or quick.recipes)
    bad = tmp_path / "bad.yaml"
    bad.write_text("recipes: [fp8]\nworkload: [chat]\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown field 'workload' \(did you mean "
                       r"'workloads'\?\)"):
        campaigns.load(str(bad))
    bad.write_text("plan: {context: many}\n")
    with pytest.raises(ConfigError, match=r"field 'plan.context': input should be a valid "
                       r"integer.*\(got 'many'\)"):
        campaigns.load(str(bad))
    bad.write_text("plan: {gpu: h100-80gb, contxt: 3}\n")
    with pytest.raises(ConfigError, match=r"'plan.contxt' \(did you mean 'context'\?\); the "
                       r"fields are gpu, context, max_context, memory_gb"):
        campaigns.load(str(bad))
    with pytest.raises(ConfigError, match="the campaigns are default, full, quick"):
        campaigns.load("nope")


def test_stage_settings_follow_the_campaign_and_print_their_command() -> None:
    settings = campaign.CampaignSettings(baseline="tiny", campaign="quick", force=True)
    quantize, bench, evaluate = campaign.stages(settings, settings.file())
    assert [q.recipe for q in quantize] == ["fp8", "mxfp4"]
    assert bench is not None and bench.workloads == ("quick",) and bench.repeats == 3
    assert evaluate.limit == 40 and not evaluate.divergence and evaluate.suites == ("app",)
    # the command that re-runs a stage alone is derived from the same settings
    line = bench.command("bench")
    assert line.startswith("qpipe bench --baseline=tiny") and "--workload=quick" in line
    assert "--force" in line and "--repeats=3" in line
    assert "--limit=40" in evaluate.command("eval") and "--no-divergence" in evaluate.command(
        "eval")
    # the command line overrides the file; no workloads means no bench
    override = from_options(campaign.CampaignSettings, campaign="quick", recipes=("int8",),
                            limit="all")
    quantize, bench, evaluate = campaign.stages(override, override.file())
    assert [q.recipe for q in quantize] == ["int8"] and evaluate.limit == "all"
    no_bench = campaigns.CampaignFile(recipes=("fp8",), workloads=())
    assert campaign.stages(settings, no_bench)[1] is None


def test_the_cost_objective_adds_the_capacity_search_once() -> None:
    def bench_of(**overrides: object) -> tuple[str, ...]:
        settings = from_options(campaign.CampaignSettings, baseline="tiny", **overrides)
        bench = campaign.stages(settings, settings.file())[1]
        assert bench is not None
        return bench.workloads

    assert bench_of() == ("chat", "prefix")  # speed: no search (minutes a model on a CPU)
    assert bench_of(objective="cost") == ("chat", "prefix", "capacity")
    # a search already named is not run twice, whichever it is
    assert bench_of(objective="cost", workloads=("chat", "capacity-rate")) == (
        "chat", "capacity-rate")
    assert bench_of(campaign="full", objective="cost")[-1] == "capacity-gpu"
    assert bench_of(campaign="full", objective="cost").count("capacity-gpu") == 1


def test_served_concurrency_divides_the_engines_kv_cache_by_whole_blocks() -> None:
    row = _baseline()
    assert row.served_concurrency(2048) is None  # not benched
    row.kv = {tracking.KV_CACHE_TOKENS: 46_592, "kv_block_size": 128}
    assert row.served_concurrency(2048) == 22  # vLLM's own figure at 2,048 tokens is 22.75
    assert row.served_concurrency(2000) == 22  # 2,000 tokens still take 16 blocks of 128
    assert row.served_concurrency(100) == 364
    # KV figures read from the start-up log carry no block size: no crash, no rounding
    row.kv = {tracking.KV_CACHE_TOKENS: 46_592, "kv_block_size": 0}
    assert row.served_concurrency(2048) == 22 and row.served_concurrency(2000) == 23


def test_a_searched_variant_shows_its_predicted_against_its_measured_damage(tmp_path: Path):
    searched = _row("searched-1.15xint4", 0.9, gate.PASS)
    searched.search = Prediction(predicted_kl=0.02, predicted_weight_bytes=130_000_000,
                                 basis="searched: least predicted damage within 1.15x uniform "
                                       "int4")
    searched.divergence = {"kl_div_mean": 0.03}
    uniform = _row("int4", 0.8, gate.PASS)
    uniform.search = Prediction(predicted_kl=0.08, predicted_weight_bytes=113_000_000,
                                basis="every unit at int4 in the sensitivity table")
    comparison = _comparison([_baseline(), uniform, searched])
    lines = report.search_lines(comparison)
    assert lines[0].startswith("precision search, predicted against measured")
    assert "searched-1.15xint4: predicted KL 0.0200" in lines[2]
    assert "measured 0.0300 on the held-out check text" in lines[2]
    assert "= 1.50x the prediction: WARNING: it did not hold (held: within 0.75-1.33x)" \
        in lines[2]
    searched.divergence = {"kl_div_mean": 0.024}
    assert "= 1.20x the prediction: it held" in report.search_lines(comparison)[2]
    searched.search = searched.search.model_copy(update={"predicted_kl": 0.02})
    assert searched.search.held(0.0215) and not searched.search.held(0.03)
    # 1.5x, but 0.0015 nats/token apart: within the bf16 check's own floor
    small = searched.search.model_copy(update={"predicted_kl": 0.003})
    assert small.held(0.0045) and small.ratio(0.0045) == pytest.approx(1.5)
    searched.search = small
    searched.divergence = {"kl_div_mean": 0.0045}
    assert "1.50x the prediction: it held (within 0.002 nats/token: the check's bf16" in \
        report.search_lines(comparison)[2]
    searched.search = searched.search.model_copy(update={"predicted_kl": 0.02})
    searched.divergence = {"kl_div_mean": 0.03}
    assert "int4: predicted KL 0.0800" in lines[1] and "not measured" in lines[1]
    # a shipped uniform recipe off the round-to-nearest prediction is its method's doing
    uniform.search = uniform.search.model_copy(update={"uniform": True})
    uniform.divergence = {"kl_div_mean": 0.12}
    shown = report.search_lines(comparison)
    assert "= 1.50x the prediction: a shipped recipe, quantized by its own method" in shown[1]
    assert "WARNING" not in shown[1] and "WARNING" in shown[2]
    # a speed budget's prediction with its interval; the next row is still judged at 0.75-1.33
    uniform.search = uniform.search.model_copy(update={
        "uniform": False, "predicted_speedup": 1.2, "predicted_speedup_low": 1.1,
        "predicted_speedup_high": 1.3})
    shown = report.search_lines(comparison)
    assert "int4: predicted speedup 1.20x [1.10, 1.30]" in " ".join(shown)
    assert "(held: within 0.75-1.33x)" in shown[-1]
    uniform.search, uniform.divergence = uniform.search.model_copy(update={
        "predicted_speedup": None}), {}
    assert any("predicted KL 0.0200" in n for n in report.markdown(comparison).splitlines())
    rows = list(csv.DictReader(io.StringIO(report.csv_text(comparison))))
    assert rows[2]["predicted_kl"] == "0.02" and rows[2]["kl_div_mean"] == "0.03"
    name, svg = plots.plot_size(comparison)
    assert name == "size" and "searched-1.15xint4 predicted" in svg


def test_a_mixed_precision_variant_is_planned_from_its_measured_bytes():
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576,
              "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
              "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
              "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
    target = PlanTarget(gpu="h100-80gb", context=2048, max_context=8192)
    rows = {}
    for name, precision, ratio in (("dense", "bf16", 1.0), ("mix", placement.MIXED, 0.45)):
        rows[name] = Row(name=name, recipe=name, scheme="W4A16-G64+W8A8", format="x",
                         precision=precision, weight_bytes=int(269e6 * ratio), weight_ratio=ratio)
        placement.apply_plan(rows[name], config, target)
    dense, mix = rows["dense"].plan, rows["mix"].plan
    assert mix.planned_weight_bytes == int(dense.planned_weight_bytes * 0.45)
    assert mix.planned_kv_budget_bytes - dense.planned_kv_budget_bytes == pytest.approx(
        dense.planned_weight_bytes * 0.55, abs=2)
    assert any("mixed precision" in n for n in rows["mix"].notes)


def test_a_campaigns_threshold_is_said_wherever_the_verdict_is() -> None:
    row = _row("int8", 1.5, gate.PASS)
    row.threshold, row.threshold_from = 95.0, "campaign"
    best, reason = recommend([_baseline(), row])
    assert best == "int8" and "(threshold 95%, the campaign's)" in reason
    settings = from_options(campaign.CampaignSettings, threshold=95)
    assert settings.file().threshold == 95
    assert campaigns.load("default").threshold is not None  # the demonstration's, said in it


def test_the_reference_the_speedups_are_against_is_named_in_the_table() -> None:
    comparison = _comparison([_baseline(), _row("int8", 0.5, gate.PASS)])
    comparison = comparison.model_copy(update={"measurement": {
        "run": "bench k", "pairing": "interleaved", "reference_dtype": "float32",
        "reference": "the baseline served in float32 (2.38x its bfloat16 throughput here)"}})
    text = report.terminal(comparison)
    assert "bf16 (bf16, served in float32)" in text
    assert "reference: the baseline served in float32" in text


def test_the_join_reads_only_artifacts_never_the_model_files(workspace: Path) -> None:
    """The baseline's model directory is gone and the variant's holds only its manifest: the
    comparison still plans, sizes and thresholds every row from the stages' records."""
    from pipeline.core.artifacts import BaselineRecord, Manifest, RecipeInfo
    from pipeline.core.formats import Identified

    config = json.loads((Path(__file__).parents[1] / "configs/models/smollm2-135m/config.json")
                        .read_text())
    record = BaselineRecord(name="Tiny", directory=str(workspace / "gone"), identity="B",
                            specs=["tiny"], weight_bytes=269_000_000, config=config)
    record.write(BaselineRecord.path_of("Tiny"))
    manifest = Manifest(cache_key="K", baseline={"identity": "B"}, format="float-quantized",
                        recipe=RecipeInfo(name="fp8kv", scheme="FP8", recovery_threshold_pct=97,
                                          search={"predicted_damage": 0.5, "how": "test"}),
                        checkpoint_bytes=170_000_000, weight_bytes=163_000_000, kv_dtype="fp8",
                        weights=Identified(key="fp8"))
    manifest.write(Manifest.path("Tiny", "fp8kv"))
    comparison = compare.collect(BaselineRecord.find("tiny").baseline(), target=PlanTarget(
        gpu="h100-80gb"))
    base, fp8 = comparison.rows
    assert base.weight_bytes == 269_000_000 and fp8.weight_ratio == pytest.approx(163 / 269)
    assert fp8.kv_dtype == "fp8" and fp8.search.predicted_kl == 0.5
    # an FP8 KV cache: half the bytes per token, and the weights saved hold more tokens too
    assert fp8.plan.planned_kv_bytes_per_token * 2 == base.plan.planned_kv_bytes_per_token
    assert fp8.plan.planned_kv_cache_tokens > 2 * base.plan.planned_kv_cache_tokens
    # the row's plan carries every figure the planner reports, under its names
    assert set(fp8.plan.model_dump()) == set(capacity.plan_capacity(config, placement.plan_settings(
        PlanTarget(gpu="h100-80gb"), "bf16", 128)).metrics())
    assert not (workspace / "gone").exists()
    # `qpipe compare BASELINE=tiny` finds the baseline by its record, resolving nothing
    from pipeline.campaign import compare_recorded as make_compare
    from pipeline.report.settings import CompareSettings

    shown = make_compare.run(from_options(CompareSettings, baseline="tiny", track=False,
                                          gpu="h100-80gb"))
    assert [r.name for r in shown.rows] == ["baseline", "fp8kv"]
    assert (Comparison.directory("Tiny") / "comparison.md").is_file()
    # a manifest from before kv_dtype was recorded is refused with the way out
    manifest.model_copy(update={"kv_dtype": None}).write(Manifest.path("Tiny", "fp8kv"))
    with pytest.raises(ConfigError, match="make quantize RECIPE=fp8kv"):
        compare.collect(record.baseline())
    with pytest.raises(ConfigError, match="no baseline 'other'"):
        BaselineRecord.find("other")


def test_a_capacity_from_another_run_is_priced_on_the_devices_that_run_used() -> None:
    """The speed run served on one H100, the capacity search on four (TP=4): the capacity's
    cost is four device-hours an hour, not the speed run's one."""
    def on(count: int) -> BenchSummary:
        summary = _summary({"baseline": "B", "int8": "E"}, "cuda-h100")
        summary.devices = {"unit": "gpu", "kind": "NVIDIA H100 80GB HBM3",
                           "memory_mib": 81559, "count": count, "mig": False}
        return summary
    search = on(4)
    search.models["int8"].workloads = {"capacity": WorkloadFigures(
        points={12: {"output_tokens_per_s": 300.0}},
        capacity={"workload": "capacity", "objective": "o", "outcome": "estimated",
                  "slo_max_concurrency": 12, "slo_capacity_low": 10, "slo_capacity_high": 14,
                  "slo_output_tokens_per_s": 300.0, "slo_output_tokens_per_s_at_low": 250.0,
                  "slo_output_tokens_per_s_at_high": 350.0})}
    target = CostTarget(price_per_device_hour=3.0)
    speed_price = cost.price_of(target, cost.devices_of(on(1)))
    row = _row("int8", 1.2, gate.PASS)
    reference.newest_capacity(row, "E", [(Path("search/summary.json"), search)], "cuda-h100",
                              target)
    assert row.capacity is not None and row.capacity.price is not None
    assert (row.capacity.price.price_per_hour, row.capacity.price.devices) == (12.0, 4)
    figures = cost.figures(row, target, speed_price)
    assert figures is not None and figures.price_per_hour == 12.0
    assert figures.usd_per_million_output_tokens == pytest.approx(
        cost.per_million_tokens(12.0, 300.0))
    assert figures.usd_per_million_output_tokens_max == pytest.approx(
        cost.per_million_tokens(12.0, 250.0))
    assert cost.capacity_price(row, speed_price) == row.capacity.price


def test_a_variant_no_backend_here_can_score_is_unsupported_not_a_failure(
        workspace: Path) -> None:
    from pipeline.core.artifacts import BaselineRecord, EvalFailure, Manifest, RecipeInfo
    from pipeline.core.formats import Identified

    config = json.loads((Path(__file__).parents[1] / "configs/models/smollm2-135m/config.json")
                        .read_text())
    BaselineRecord(name="Tiny", directory=str(workspace / "gone"), identity="B", specs=["tiny"],
                   weight_bytes=269_000_000, config=config).write(BaselineRecord.path_of("Tiny"))
    for name, key in (("fp8-block", "fp8-block"), ("fp8", "fp8")):
        Manifest(cache_key=name, baseline={"identity": "B"}, format="float-quantized",
                 recipe=RecipeInfo(name=name, scheme="FP8", recovery_threshold_pct=97),
                 checkpoint_bytes=170_000_000, weight_bytes=163_000_000, kv_dtype="bf16",
                 weights=Identified(key=key)).write(Manifest.path("Tiny", name))
    EvalFailure(identity="fp8-block", reason="compressed-tensors cannot de-compress it",
                status="unsupported").write(EvalFailure.path("Tiny", "fp8-block"))
    EvalFailure(identity="fp8", reason="lm-eval crashed").write(EvalFailure.path("Tiny", "fp8"))
    comparison = compare.collect(BaselineRecord.find("tiny").baseline(),
                                 target=PlanTarget(gpu="h100-80gb"))
    rows = {r.name: r for r in comparison.rows}
    assert rows["fp8-block"].gate_status == "unsupported"
    assert any("cannot de-compress" in n for n in rows["fp8-block"].notes)
    # the campaign exits 1 on failures only: the crash is one, the format's limit is not
    assert [(f.variant, f.stage) for f in comparison.failures] == [("fp8", "eval")]
