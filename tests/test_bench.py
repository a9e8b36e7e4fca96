"""End to end through the real vLLM CPU engine: a tiny Llama and its INT4 variant, a short load."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from pipeline.bench import stage as bench
from pipeline.bench import workloads
from pipeline.bench.measure import HIT_TOLERANCE
from pipeline.bench.slo import Objective, start_wave
from pipeline.bench.summary import SWEEP
from pipeline.bench.table import format_table
from pipeline.core import hardware, tracking
from pipeline.core.artifacts import BenchSummary
from pipeline.core.provenance import serve_python
from pipeline.core.speedup import speedup
from pipeline.core.variant import variants_of, with_baseline
from pipeline.eval import EvalSettings, lm, suites
from pipeline.eval import stage as evaluate
from pipeline.plan import capacity
from pipeline.quantize import baseline as baselines
from pipeline.quantize import recipes
from pipeline.quantize import stage as quantize
from pipeline.serve import EngineSettings, ServerPool, VllmServer, known_refusal
from tests.conftest import TINY_LOAD

# three or four servers at once (see conftest: the "servers" group)
pytestmark = [pytest.mark.slow, pytest.mark.serve, pytest.mark.xdist_group("servers")]

TINY_PREFIX = """\
description: tiny shared prefix
dataset: prefix_repetition
prefix_len: 256
suffix_len: 16
num_prefixes: 1
output_len: 4
load_points: [2]
headline: 2
min_prompts: 6
repeats: 1
seed: 7
compare_prefix_caching: true
models: baseline
"""

# a capacity search whose objective every request meets: two pilot runs of 4 requests counted
# past the run's start-up wave at the first load, then two full runs of 3 at 1, 2 and 4 (the
# ceiling), where 6 of 6 within the objective shows the 50% asked is met: censored (a knee is
# estimated on known attainment curves in test_slo)
TINY_CAPACITY = """\
description: tiny capacity search
dataset: random
input_len: 16
output_len: 4
slo: {ttft_ms: 600000, tpot_ms: 600000, percentile: 50}
search_ceiling: 4
search_pilot: 4
min_prompts: 3
prompts_per_concurrency: 1
repeats: 2
seed: 9
"""

# requests per second at an objective derived from the baseline's single-request run: Poisson
# arrivals at 2 then 4 req/s (the ceiling), each level shown to meet 50% after two runs of 3
TINY_RATE = """\
description: tiny arrival-rate search
dataset: random
input_len: 16
output_len: 4
slo: {ttft_ms: auto, tpot_ms: 600000, factor: 100, percentile: 50}
search_by: rate
rate_start: 2
rate_ceiling: 4
rate_step: 1
run_seconds: 1
min_prompts: 3
repeats: 2
seed: 13
"""

# the user's own traffic, both ways vLLM's client replays it: prompts and a timed trace
TINY_PROMPTS = """\
description: tiny prompt file
dataset: custom
prompts: prompts.jsonl
load_points: [2]
min_prompts: 3
prompts_per_concurrency: 1
repeats: 1
models: baseline
"""
TINY_TRACE = """\
description: tiny timed trace
dataset: timed_trace
trace: trace.jsonl
load_points: [4]
repeats: 1
models: baseline
"""


def _vllm_processes() -> list[psutil.Process]:
    """vLLM processes this test process started (servers, engines, the benchmark client)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "vllm" in " ".join(p.cmdline()).lower() or p.name().startswith("VLLM"):
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def served_setup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    if not serve_python().exists():
        pytest.fail(f"the serving environment is missing ({serve_python()}): run make setup")
    return tmp_path_factory.mktemp("bench")


def _count_starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The served names of the vLLM servers started from now on."""
    started: list[str] = []
    start = VllmServer.start

    def counted(server: VllmServer) -> None:
        started.append(server.served_name)
        start(server)

    monkeypatch.setattr(VllmServer, "start", counted)
    return started


def _record_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, bool]]:
    """("launch" | "ready", served name, prefix caching) of every server, in order."""
    events: list[tuple[str, str, bool]] = []
    launch, ready = VllmServer.launch, VllmServer.wait_ready

    def launched(server: VllmServer) -> None:
        events.append(("launch", server.served_name, server.settings.enable_prefix_caching))
        launch(server)

    def waited(server: VllmServer) -> None:
        ready(server)
        events.append(("ready", server.served_name, server.settings.enable_prefix_caching))

    monkeypatch.setattr(VllmServer, "launch", launched)
    monkeypatch.setattr(VllmServer, "wait_ready", waited)
    return events


def test_bench_measures_baseline_and_variant_through_vllm(
    tiny_model: Path, workspace: Path, served_setup: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = baselines.resolve(str(tiny_model))
    quantize.quantize(base, recipes.load("int4").with_calibration(num_samples=4,
                                                                  max_seq_length=32))
    (workspace / "tiny.yaml").write_text(TINY_LOAD)
    (workspace / "tinyprefix.yaml").write_text(TINY_PREFIX)
    (workspace / "tinycap.yaml").write_text(TINY_CAPACITY)
    (workspace / "tinyrate.yaml").write_text(TINY_RATE)
    (workspace / "prompts.jsonl").write_text(
        '{"prompt": "What is the capital of France?", "output_tokens": 3}\n'
        '{"prompt": "Write one word.", "output_tokens": 5}\n'
        '{"prompt": "Count to three, please, slowly and clearly.", "output_tokens": 4}\n')
    (workspace / "tinyprompts.yaml").write_text(TINY_PROMPTS)
    (workspace / "trace.jsonl").write_text("".join(
        f'{{"timestamp": {0.2 * i}, "input_length": {20 + 10 * i}, "output_length": 4, '
        f'"hash_ids": [{10 * i}, {10 * i + 1}, {10 * i + 2}, {10 * i + 3}]}}\n'
        for i in range(4)))
    (workspace / "tinytrace.yaml").write_text(TINY_TRACE)
    loads = [workloads.load(str(workspace / f"{name}.yaml"))
             for name in ("tiny", "tinyprefix", "tinycap", "tinyrate", "tinyprompts",
                          "tinytrace")]
    settings = EngineSettings(max_model_len=512, kv_cache_space_gib=1)
    # an AVX2-only CPU (or QPIPE_VLLM_CPU_ISA=avx2) has no W4A16 kernel: int4 is not served
    avx2 = hardware.profile().kernel_library == "_C_AVX2"
    with ServerPool() as pool:  # as a campaign runs it: eval scores through bench's servers
        # the reference set: the probe of float32 against bf16 is the AVX2 test's below
        with monkeypatch.context() as patched:
            launches = _record_launches(patched)
            summary = bench.bench(base, ["int4"], loads, settings, target="cpu", pool=pool,
                                  reference_dtype="bfloat16")
        # the prefix comparison's caching-on server loaded with the cold pass's, not after it
        base_name = with_baseline(base, ["int4"])[0].served_name
        first_ready = next(i for i, e in enumerate(launches) if e[0] == "ready")
        assert ("launch", base_name, True) in launches[:first_ready], launches
        assert ("ready", base_name, False) in launches  # and the cold pass's baseline
        served_models = (("baseline", base.path),) + (() if avx2 else (
            ("int4", workspace / "artifacts" / "variants" / base.name / "int4"),))
        kept = [pool.get(path, name, settings, any_caching=True)
                for name, path in served_models]
        assert all(server is not None and server.healthy() for server in kept)
        started = _count_starts(monkeypatch)
        scored = evaluate.evaluate(base, variants_of(base, ["int4"]),
                                   suites.select(tasks=["app_facts"]),
                                   EvalSettings(limit=4, engine=settings, divergence=False),
                                   track=False, pool=pool)
        served = not avx2
        assert started == []  # eval scored through the servers bench left in the pool
        assert scored["int4"].backend == (lm.SERVED if served else lm.EMULATED)
        # the baseline is scored on each backend a variant used: served, unless none was
        baseline_backend = lm.SERVED if served else lm.EMULATED
        assert scored[f"baseline ({baseline_backend})"].backend == baseline_backend
        assert len(scored["int4"].results["app_facts"].per_item["acc,none"]) == 4

    assert _vllm_processes() == [], "a server outlived the run"
    if avx2:
        # This CPU has no AVX-512: vLLM CPU's AVX2 kernels cannot run W4A16. The unsupported
        # path is checked instead (test_avx2_... checks it on every machine); the baseline's
        # figures below are checked all the same.
        assert summary.models["int4"].status == "unsupported"
        assert "cpu_gemm_wna16" in summary.models["int4"].reason
        assert scored["int4"].backend == lm.EMULATED
    for name in ("baseline",) if avx2 else ("baseline", "int4"):
        entry = summary.models[name]
        assert entry.status == "ok", entry.reason
        stats = entry.workloads["tiny"].points[2].metrics
        for metric in (tracking.OUTPUT_TOKENS_PER_S, tracking.REQUESTS_PER_S,
                       tracking.TTFT_MS_P50, tracking.TTFT_MS_P99, tracking.ITL_MS_P50,
                       tracking.ITL_MS_P99, tracking.E2E_MS_P50):
            assert stats[metric] > 0, metric
        assert stats[f"{tracking.OUTPUT_TOKENS_PER_S}_min"] <= stats[
            tracking.OUTPUT_TOKENS_PER_S] <= stats[f"{tracking.OUTPUT_TOKENS_PER_S}_max"]
        assert entry.peak_memory_bytes > 100e6
        # The planner's prediction of vLLM's KV cache (the goal: within 1%).
        assert abs(entry.kv[tracking.KV_CACHE_TOKENS_VS_PLANNED] - 1) <= 0.01
        assert entry.kv[tracking.KV_CACHE_TOKENS] == entry.kv[capacity.KV_CACHE_TOKENS]
        # the speed sweep is cold: the engine's counters saw prompts and not one cache hit
        sweep = entry.workloads["tiny"]
        assert sweep.prefix_cache_hit_tokens == 0 and sweep.prefix_cache_hit_rate == 0
        # the capacity search ran through vLLM's client, every point with both repeats
        found = entry.workloads["tinycap"].capacity
        assert found is not None
        assert found.slo_max_concurrency == 4 and found.censored
        assert found.outcome == "censored" and found.text() == ">= 4 (censored)"
        assert {c: (p.good, p.counted, p.runs, p.pilots)
                for c, p in found.points.items()} == {
            "1": (6, 6, 2, 2), "2": (6, 6, 2, 0), "4": (6, 6, 2, 0)}
        # a censored capacity is only a lower bound, and is exported as one
        assert "slo_max_concurrency" not in found.metrics()
        assert found.metrics()["slo_max_concurrency_lower_bound"] == 4
        # the attainment counted from each request's figures is vLLM's own goodput count
        runs = sorted((BenchSummary.path(base.name, summary.key).parent / "runs").glob(
            f"{name}-tinycap-c*-r*.json"))
        assert len(runs) == 8
        for run in runs:
            result = json.loads(run.read_text())
            assert round(result["request_goodput"] * result["duration"]) == len(result["ttfts"])
            # vLLM's client sent the first `concurrency` requests at once: the wave not counted
            users = int(run.name.split("-c")[-1].split("-")[0])
            assert start_wave(result) == set(range(users))
            # 3 counted past the wave; the two pilots (the first point's first runs) 4
            pilot = users == 1 and run.name.endswith(("-r0.json", "-r1.json"))
            assert result["num_prompts"] == users + (4 if pilot else 3)
        assert found.slo_output_tokens_per_s and found.slo_output_tokens_per_s > 0
        assert found.limited_by.startswith("the search ceiling")
        # the rate search: Poisson arrivals at 2 and 4 req/s, as vLLM's client recorded them,
        # against 100x the baseline's own single-request TTFT measured in this run
        rated = entry.workloads["tinyrate"].capacity
        assert rated is not None and rated.search_by == "rate" and rated.censored
        assert rated.slo_max_request_rate == 4.0
        assert rated.outcome == "censored"
        assert {c: p.rate for c, p in rated.points.items()} == {"1": 2.0, "2": 4.0}
        assert all(p.good == p.counted >= 6 and p.low > 0.5 for p in rated.points.values())
        assert rated.objective_basis.startswith("100 x the baseline's single-request TTFT")
        probe = json.loads(next((BenchSummary.path(base.name, summary.key).parent / "runs")
                                .glob("baseline-tinyrate_objective-c1-r2.json")).read_text())
        assert rated.objective == Objective(
            ttft_ms="auto", tpot_ms=600000, factor=100, percentile=50).derived(
            probe, "the baseline").describe()
        sent = json.loads(next((BenchSummary.path(base.name, summary.key).parent / "runs")
                               .glob(f"{name}-tinyrate-c2-r0.json")).read_text())
        assert sent["request_rate"] == 4.0 and sent["burstiness"] == 1.0
        assert entry.workloads["tinycap"].prefix_cache_hit_tokens == 0  # cold too
    # prefix reuse, on the baseline only: hits where the prefix allows them, and no more
    base_prefix = summary.models["baseline"].workloads
    on = base_prefix["tinyprefix"]
    assert on.prefix_cache_expected_hit_rate is not None
    assert 0.2 < on.prefix_cache_hit_rate <= on.prefix_cache_expected_hit_rate + HIT_TOLERANCE
    assert base_prefix["tinyprefix_nocache"].prefix_cache_hit_rate == 0
    assert "tinyprefix" not in summary.models["int4"].workloads
    # the user's own traffic went through vLLM's client, and its lengths were kept: three
    # prompts (templated, so longer than their words) with their own output lengths; the
    # trace's four requests with exactly its lengths
    prompts = base_prefix["tinyprompts"].lengths
    assert prompts is not None and prompts["requests"] == 3
    assert prompts["output_tokens_max"] == 5 and prompts["input_tokens_p50"] > 5
    trace = base_prefix["tinytrace"].lengths
    assert trace == {"requests": 4, "input_tokens_p50": 35.0, "input_tokens_p90": 50,
                     "input_tokens_max": 50, "output_tokens_p50": 4.0, "output_tokens_p90": 4,
                     "output_tokens_max": 4}
    if avx2:
        return  # no int4 speed to compare
    # the speedup is the geometric mean of the per-repeat ratios, with the interval of the
    # speed verdict, recomputed here from vLLM's own result files, one per run
    int4 = summary.models["int4"].workloads["tiny"].points[2].speedup
    assert int4 is not None
    run_files = next((workspace / "artifacts" / "bench" / base.name).glob("*/runs"))
    n = int4.n
    ratios = [
        json.loads((run_files / f"int4-tiny-c2-r{r}.json").read_text())["output_throughput"]
        / json.loads((run_files / f"baseline-tiny-c2-r{r}.json").read_text())[
            "output_throughput"] for r in range(n)]
    found = speedup(ratios, loads[0].looks("cpu"))
    assert n == 2 and int4.point == pytest.approx(found.point)
    assert int4.low == pytest.approx(found.low) and int4.high == pytest.approx(found.high)
    assert int4.verdict == found.verdict
    assert min(ratios) <= int4.point <= max(ratios)
    assert summary.models["baseline"].workloads["tiny"].points[2].speedup is None
    table = format_table(summary, loads)
    assert "tiny (concurrency 2" in table and "prefix caching off" in table
    assert ">= 4 concurrent requests" in table
    assert "attainment: 1: 6/6 = 100% (2 runs + 2 pilot)" in table

    import mlflow

    experiment = mlflow.get_experiment_by_name(tracking.experiment_name(base.name))
    runs = {r.info.run_name: r for r in mlflow.search_runs(
        [experiment.experiment_id], filter_string="tags.`qpipe.stage` = 'bench'",
        output_format="list")}
    assert set(runs) == {"bench:baseline", "bench:int4"}
    variant = runs["bench:int4"].data
    assert variant.params[tracking.PARAM_RECIPE] == "int4"
    assert runs["bench:baseline"].data.params[tracking.PARAM_RECIPE] == "none"
    assert variant.metrics[tracking.SPEEDUP] == pytest.approx(int4.point)
    assert variant.metrics["prefix_cache_hit_tokens"] == 0  # logged: the sweep was cold
    assert variant.params["speedup_pairing"].startswith("interleaved")
    assert runs["bench:baseline"].data.metrics["tinyprefix.prefix_cache_hit_rate"] > 0.2
    # censored at the ceiling: a lower bound, under a name that says so
    assert variant.metrics[tracking.SLO_MAX_CONCURRENCY + "_lower_bound"] == 4
    assert tracking.SLO_MAX_CONCURRENCY not in variant.metrics
    assert variant.metrics[tracking.SLO_OUTPUT_TOKENS_PER_S] > 0
    client = mlflow.MlflowClient()
    history = client.get_metric_history(runs["bench:int4"].info.run_id,
                                        f"{SWEEP}{tracking.OUTPUT_TOKENS_PER_S}")
    assert sorted(m.step for m in history) == [1, 2]
    attained = client.get_metric_history(runs["bench:int4"].info.run_id,
                                         f"{SWEEP}tinycap.{tracking.SLO_ATTAINMENT}")
    assert {m.step: m.value for m in attained} == {1: 1.0, 2: 1.0, 4: 1.0}
    assert tracking.SLO_ATTAINMENT not in variant.metrics  # censored: no knee fitted there
    headline = client.get_metric_history(runs["bench:int4"].info.run_id,
                                         tracking.OUTPUT_TOKENS_PER_S)
    assert [m.value for m in headline] == [pytest.approx(summary.models["int4"].workloads[
        "tiny"].points[2].metrics[tracking.OUTPUT_TOKENS_PER_S])]

    # Nothing changed: the measurement is reused, not repeated, and not logged twice.
    started = _count_starts(monkeypatch)
    again = bench.bench(base, ["int4"], loads, settings, target="cpu",
                        reference_dtype="bfloat16")
    assert started == [] and again == summary
    assert BenchSummary.read(BenchSummary.path(base.name, summary.key)) == summary
    assert len(mlflow.search_runs([experiment.experiment_id], output_format="list",
                                  filter_string="tags.`qpipe.stage` = 'bench'")) == 2

    # The comparison joins this measurement to the variant's current checkpoint.
    from pipeline.report import compare

    rows = {r.name: r for r in compare.collect(base, ["int4"]).rows}
    assert rows["int4"].serving == "ok" and rows["int4"].comparable
    assert rows["int4"].speedup == pytest.approx(int4.point)
    assert rows["baseline"].headline.metrics[tracking.OUTPUT_TOKENS_PER_S] == pytest.approx(
        summary.models["baseline"].workloads["tiny"].points[2].metrics[
            tracking.OUTPUT_TOKENS_PER_S])
    assert rows["int4"].kv[tracking.KV_CACHE_TOKENS] == summary.models["int4"].kv[
        tracking.KV_CACHE_TOKENS]
    assert rows["baseline"].prefix[tracking.PREFIX_CACHE_HIT_RATE] > 0.2
    # capacity at the objective, its cost at the host's price, and where the speedup crosses 1
    assert rows["int4"].capacity.slo_max_concurrency == 4
    tps = rows["int4"].capacity.slo_output_tokens_per_s
    # censored: its cost is only an upper bound, at the ceiling's throughput
    assert rows["int4"].cost.cost_bound == "upper"
    assert rows["int4"].cost.usd_per_million_output_tokens is None
    assert rows["int4"].cost.usd_per_million_output_tokens_max == pytest.approx(
        0.10 / (tps * 3600) * 1e6)
    # each load's verdict with its interval and n (two repeats of a tiny load: rarely decided)
    assert " at 1 (" in rows["int4"].crossover and " at 2 (" in rows["int4"].crossover
    assert "n=2" in rows["int4"].crossover
    assert summary.reference == {"dtype": "bfloat16", "why": "REFERENCE=bfloat16 (set, not "
                                 "probed)"}


def test_avx2_cpu_serves_no_int4_says_why_and_scores_it_emulated(
    tiny_model: Path, workspace: Path, served_setup: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On any x86 machine: vLLM CPU made to load its AVX2 kernels (as an AVX2-only CPU does).
    W4A16 loads and answers /health, then cannot run: unsupported, with vLLM's reason and the
    CPU fact, remembered at once; the baseline is measured as usual; eval scores int4 emulated."""
    monkeypatch.setenv(hardware.ISA_ENV, "avx2")
    base = baselines.resolve(str(tiny_model))
    for recipe in ("int4", "int8-fp8kv"):
        quantize.quantize(base, recipes.load(recipe).with_calibration(num_samples=4,
                                                                      max_seq_length=32))
    (workspace / "tiny.yaml").write_text(TINY_LOAD.replace("load_points: [1, 2]",
                                                           "load_points: [2]")
                                         .replace("repeats: 2", "repeats: 1"))
    loads = [workloads.load(str(workspace / "tiny.yaml"))]
    settings = EngineSettings(max_model_len=512, kv_cache_space_gib=1)
    with ServerPool() as pool:
        summary = bench.bench(base, ["int4", "int8-fp8kv"], loads, settings, target="cpu",
                              pool=pool)
        # an FP8 KV cache needs AVX-512 or AMX on CPUs: refused, with vLLM's own words
        fp8kv = summary.models["int8-fp8kv"]
        assert fp8kv.status == "unsupported", fp8kv
        assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in fp8kv.reason
        int4 = summary.models["int4"]
        assert int4.status == "unsupported", int4
        assert int4.reason.startswith("AttributeError: '_OpNamespace' '_C' object has no "
                                      "attribute 'cpu_gemm_wna16'"), int4.reason
        assert "_C_AVX2" in int4.reason and int4.log.endswith(".log")
        assert known_refusal(int4.identity) == int4.reason  # remembered, for this key
        assert summary.models["baseline"].status == "ok"
        assert summary.models["baseline"].workloads["tiny"].points[2].metrics[
            tracking.OUTPUT_TOKENS_PER_S] > 0
        assert "unsupported on this hardware (pack-quantized)" in format_table(summary, loads)
        # no native bf16 here: the baseline was served in bf16 and float32 side by side, and
        # the faster of the two is the reference of every speedup (said in the table)
        reference = summary.reference
        assert reference["dtype"] in ("bfloat16", "float32"), reference
        assert reference["probe"]["bf16_tok_s"] and reference["probe"]["float32_tok_s"]
        assert "no native bf16" in reference["why"]
        assert f"reference: the baseline served in {reference['dtype']}" in format_table(
            summary, loads)

        started = _count_starts(monkeypatch)
        scored = evaluate.evaluate(base, variants_of(base, ["int4"]),
                                   suites.select(tasks=["app_facts"]),
                                   EvalSettings(limit=4, engine=settings, divergence=False),
                                   track=False, pool=pool)
        assert scored["int4"].backend == lm.EMULATED
        assert "int4" not in started  # the refusal was remembered: no second try
    assert _vllm_processes() == []

    import mlflow

    experiment = mlflow.get_experiment_by_name(tracking.experiment_name(base.name))
    runs = {r.info.run_name: r for r in mlflow.search_runs(
        [experiment.experiment_id], output_format="list",
        filter_string="tags.`qpipe.stage` = 'bench'")}
    run = runs["bench:int4"].data
    assert run.tags[tracking.TAG_SERVING_STATUS] == "unsupported"
    assert run.tags[tracking.TAG_HARDWARE_KEY] == "cpu-avx2"
    assert "forced avx2" in run.params[tracking.PARAM_HARDWARE]
    assert "cpu_gemm_wna16" in run.params["serving_reason"]

    # the native hardware key keeps its own memory: the forced run taught it nothing
    monkeypatch.delenv(hardware.ISA_ENV)
    if hardware.profile().kernel_library != "_C_AVX2":
        assert known_refusal(int4.identity) is None


def test_an_fp8_kv_cache_holds_twice_the_tokens_as_planned_or_is_unsupported(
    tiny_model: Path, workspace: Path, served_setup: Path
) -> None:
    """The int8 recipe with a calibrated FP8 KV cache: vLLM stores the cache in FP8 (from the
    checkpoint's kv_cache_scheme), so the same budget holds twice the tokens of the bf16
    cache, as the planner predicts; on a CPU without AVX-512 or AMX it is unsupported."""
    if hardware.profile().kernel_library == "_C_AVX2":
        pytest.skip("no AVX-512 or AMX here: vLLM CPU refuses an FP8 KV cache, which "
                    "test_avx2_cpu_serves_no_int4_says_why_and_scores_it_emulated checks")
    base = baselines.resolve(str(tiny_model))
    quantize.quantize(base, recipes.load("int8-fp8kv").with_calibration(num_samples=4,
                                                                        max_seq_length=32))
    (workspace / "tiny.yaml").write_text(TINY_LOAD.replace("load_points: [1, 2]",
                                                           "load_points: [2]")
                                         .replace("repeats: 2", "repeats: 1"))
    loads = [workloads.load(str(workspace / "tiny.yaml"))]
    summary = bench.bench(base, ["int8-fp8kv"], loads,
                          EngineSettings(max_model_len=512, kv_cache_space_gib=1), target="cpu",
                          reference_dtype="bfloat16")
    entry, baseline = summary.models["int8-fp8kv"], summary.models["baseline"]
    assert entry.status == "ok", entry.reason
    assert entry.engine.kv_cache_dtype == "fp8"
    ratio = entry.kv[tracking.KV_CACHE_TOKENS] / baseline.kv[tracking.KV_CACHE_TOKENS]
    assert 1.9 <= ratio <= 2.1, ratio
    assert abs(entry.kv[tracking.KV_CACHE_TOKENS_VS_PLANNED] - 1) <= 0.01
    assert entry.workloads["tiny"].points[2].metrics[tracking.OUTPUT_TOKENS_PER_S] > 0
