"""Capacity at a latency objective: the search, the objective, the workload's slo block."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import pytest

from pipeline.bench import workloads
from pipeline.bench.slo import (
    MEETS,
    MISSES,
    UNDECIDED,
    CapacitySearch,
    Objective,
    Point,
    run_spread,
    start_wave,
)
from pipeline.bench.summary import capacity_figures
from pipeline.calibrate.scenarios import attainment_curve
from pipeline.core.errors import ConfigError
from pipeline.core.shares import share_bounds


def step_curve(knee: int) -> Callable[[int], float]:
    """Every request meets the objective up to ``knee`` users, none above."""
    return lambda c: 1.0 if c <= knee else 0.0


def search_with(curve: Callable[[int], float], requests: int = 24,
                rng: random.Random | None = None, **kwargs) -> tuple[dict, list[int]]:
    """The search on a known attainment curve: each run's requests meet it at the curve's rate
    (exactly, or drawn with ``rng``)."""
    search, visited = CapacitySearch(**kwargs), []
    while (step := search.next_run()) is not None:
        concurrency, _ = step
        visited.append(concurrency)
        share = curve(concurrency)
        good = (sum(rng.random() < share for _ in range(requests)) if rng
                else round(share * requests))
        search.record(concurrency, good, requests)
    return search.result(), visited


@pytest.mark.parametrize("knee", [1, 3, 7, 12, 20, 31])
def test_the_search_resolves_a_sharp_knee_to_one_user(knee):
    found, visited = search_with(step_curve(knee), ceiling=32)
    assert found["max_concurrency"] == knee and found["capacity_high"] == knee
    assert found["first_miss"] == knee + 1 and not found["censored"]
    # bracket then bisect: a few points, not a sweep of 1..32
    assert len(set(visited)) <= 2 * 5 + 1


def test_precision_trades_points_for_a_coarser_answer():
    exact, visited_exact = search_with(step_curve(20), ceiling=64)
    coarse, visited_coarse = search_with(step_curve(20), ceiling=64, precision=0.25)
    assert exact["max_concurrency"] == 20
    assert 16 <= coarse["max_concurrency"] <= 20 <= coarse["capacity_high"]
    assert coarse["first_miss"] - coarse["max_concurrency"] <= coarse["max_concurrency"] * 0.25
    assert len(set(visited_coarse)) < len(set(visited_exact))


def test_a_point_runs_until_its_exact_bounds_clear_or_miss_the_target():
    search = CapacitySearch(ceiling=8, target=0.9, max_runs=4)
    assert search.next_run() == (1, 0)
    search.record(1, 24, 24)  # 24 of 24: the lower bound (98.75%) is 0.83, not yet 0.9
    assert search.points[1].verdict is None and search.next_run() == (1, 1)
    search.record(1, 24, 24)  # 48 of 48: 0.913 >= 0.9, shown to meet; no third run
    assert search.points[1].verdict == MEETS and search.next_run() == (2, 0)
    search.record(2, 12, 24)  # half: far below 0.9, but one run cannot show how runs vary
    assert search.points[2].verdict is None and search.next_run() == (2, 1)
    search.record(2, 11, 24)  # two runs: a t bound with one degree of freedom reaches 1
    assert search.points[2].verdict is None and search.next_run() == (2, 2)
    search.record(2, 12, 24)  # three that agree: shown to miss
    assert search.points[2].verdict == MISSES and search.done
    found = search.result()
    assert found["max_concurrency"] == 1 and found["capacity_high"] == 1
    assert found["points"][1]["good"] == 48 and found["points"][1]["runs"] == 2
    assert found["points"][1]["low"] >= 0.9 > found["points"][2]["high"]
    assert found["alpha_look"] == pytest.approx(0.05 / 4)


def test_runs_that_disagree_keep_a_point_undecided_where_pooled_requests_would_not():
    """Two runs at one load as measured on the 2-core CPU: 32 of 32, then 26 of 32 (and a
    third at 31): pooled, 89 of 96 would clear 81% at once; the runs' spread keeps it open
    until the shares agree."""
    point = Point(16, looks=4)
    point.per_run += [(32, 32), (26, 32), (31, 32)]
    low, high = point.bounds(0.05)
    pooled_low, _ = share_bounds(89, 96, 0.05 / 4)
    assert low < pooled_low - 0.05 and high == 1.0
    assert point.look(0.81, 0.05) is None  # pooled alone: 0.84 >= 0.81, "meets"
    assert pooled_low >= 0.81
    # runs that agree: the exact bound of their requests decides
    steady = Point(16, looks=4)
    steady.per_run += [(32, 32), (32, 32)]
    assert steady.bounds(0.05) == share_bounds(64, 64, 0.05 / 4)


def test_a_point_at_the_target_is_undecided_and_probed_around_from_both_sides():
    # 100% up to 5, exactly the target at 6 (never decided), nothing above
    found, visited = search_with(lambda c: 1.0 if c <= 5 else 0.9 if c == 6 else 0.0,
                                 requests=40, ceiling=16)
    assert found["points"][6]["verdict"] == UNDECIDED and found["points"][6]["runs"] == 4
    assert found["undecided"] == [6]
    assert found["max_concurrency"] == 5 and found["capacity_high"] == 6  # the range holds 6
    assert visited.count(6) == 4 and 7 in visited  # its neighbours decided, to one user


def test_a_model_that_misses_at_one_and_one_never_shown_to_miss():
    never, visited = search_with(step_curve(0), ceiling=32)
    assert never["max_concurrency"] == 0 and visited == [1, 1]  # 0 of 24, twice
    always, _ = search_with(step_curve(1000), ceiling=32)
    assert always["max_concurrency"] == 32 and always["censored"]
    assert always["capacity_high"] is None


def test_two_pilot_runs_decide_a_hopeless_model_in_eight_requests():
    search = CapacitySearch(ceiling=32, target=0.9, max_runs=4, pilot=4)
    assert search.next_run() == (1, 0) and search.is_pilot(1, 0)
    search.record(1, 0, 4)
    assert search.next_run() == (1, 1) and search.is_pilot(1, 1)
    search.record(1, 0, 4)  # 0 of 8 over two runs: the upper bound is far below 0.9
    assert search.points[1].verdict == MISSES and search.done
    # a model that meets: the pilots are two more looks at that point (6, each at 0.83%),
    # and only the first point has them
    search = CapacitySearch(ceiling=2, target=0.9, max_runs=4, pilot=4)
    for run, counted in enumerate((4, 4, 21)):
        assert search.next_run() == (1, run)
        search.record(1, counted, counted)
    assert search.points[1].verdict is None  # 29 of 29: 0.0083 ** (1 / 29) = 0.85
    assert search.next_run() == (1, 3) and not search.is_pilot(1, 3)
    search.record(1, 21, 21)  # 50 of 50: 0.909
    assert search.points[1].verdict == MEETS and search.next_run() == (2, 0)
    assert not search.is_pilot(2, 0) and search.points[2].looks == 4
    assert search.result()["points"][1]["looks"] == 6


def test_a_start_above_one_that_misses_searches_downwards():
    found, _ = search_with(step_curve(3), ceiling=32, start=8)
    assert found["max_concurrency"] == 3 and found["capacity_high"] == 3


def test_noisy_requests_on_a_smooth_knee_give_a_range_that_holds_the_truth():
    rng = random.Random(0)
    curve = attainment_curve(12, 0.95, 14, 0.85)  # the truth: 13 users at >= 90%
    found, _ = search_with(curve, requests=36, rng=rng, ceiling=32)
    assert found["max_concurrency"] <= 13 <= found["capacity_high"]


def _detailed(ttfts, latencies, output_lens, itls=None, errors=None) -> dict:
    return {"ttfts": ttfts, "latencies": latencies, "output_lens": output_lens,
            "itls": itls or [[0.01] * max(0, n - 1) for n in output_lens],
            "errors": errors or [""] * len(ttfts)}


def test_attainment_counts_requests_within_every_bound_as_vllms_goodput_does():
    objective = Objective(ttft_ms=500, tpot_ms=50, percentile=90)
    result = _detailed(ttfts=[0.1, 0.6, 0.2, 0.2], latencies=[0.5, 0.9, 1.2, 0.3],
                       output_lens=[9, 9, 9, 9], errors=["", "", "", "Connection reset"])
    # 1: TTFT 100 ms, TPOT 50 ms: within; 2: TTFT 600 ms; 3: TPOT 125 ms; 4: failed
    assert objective.attainment(result) == (1, 4)
    assert objective.target == 0.9
    itl = Objective(itl_ms=20)
    assert itl.attainment(_detailed([0.1], [0.2], [3], itls=[[0.01, 0.025]])) == (1, 1)
    assert itl.attainment(_detailed([0.1], [0.2], [3], itls=[[0.01, 0.035]])) == (0, 1)
    with pytest.raises(ValueError, match="--save-detailed"):
        objective.attainment({"p90_ttft_ms": 100.0})


def test_a_closed_loops_start_up_wave_is_not_counted():
    """At concurrency 3 the three users send at once (t = 0) and share one slow prefill, as
    vLLM's client records it; the next requests start as responses complete."""
    objective = Objective(ttft_ms=500, percentile=90)
    result = _detailed(ttfts=[0.8, 0.8, 0.8, 0.2, 0.3, 0.2, 0.6],
                       latencies=[1.0, 1.0, 1.1, 0.5, 0.6, 0.5, 0.9], output_lens=[9] * 7)
    result["start_times"] = [10.0, 10.0, 10.001, 11.0, 11.001, 11.1, 11.5]
    assert start_wave(result) == {0, 1, 2}
    assert objective.attainment(result) == (3, 7)
    assert objective.attainment(result, skip_start=True) == (3, 4)
    # a failed request ends nothing: the wave ends at the first response complete
    failed = {**result, "latencies": [0.0, 1.0, 1.1, 0.5, 0.6, 0.5, 0.9],
              "errors": ["reset", "", "", "", "", "", ""]}
    assert start_wave(failed) == {0, 1, 2}
    # a run without send times: its first max_concurrency requests
    older = {k: v for k, v in result.items() if k != "start_times"} | {"max_concurrency": 3}
    assert start_wave(older) == {0, 1, 2}


def test_a_search_that_cannot_show_its_percentile_is_refused_naming_the_way_out(tmp_path):
    assert Objective(ttft_ms=1, percentile=99).min_requests(4) == 437
    assert Objective(ttft_ms=1, percentile=90).min_requests(4) == 42
    path = _write(tmp_path, BASE + "slo: {ttft_ms: 300, percentile: 99}\nmin_prompts: 24\n"
                  "repeats: 3\n")
    with pytest.raises(ConfigError, match=r"percentile 99 .* at least 408 requests .* count "
                                          r"only 72 \(3 runs x 24, past each run's start-up "
                                          r"wave\)") as err:
        workloads.load(str(path))
    assert str(path) in str(err.value) and "min_prompts or repeats" in str(err.value)
    # a search's run counts min_prompts past its start-up wave: one per user
    w = workloads.load(str(_write(tmp_path, BASE + "slo: {ttft_ms: 300}\nmin_prompts: 21\n"
                                  "prompts_per_concurrency: 3\nrepeats: 4\nsearch_pilot: 4\n")))
    assert [w.num_prompts(c) for c in (1, 8, 16)] == [22, 29, 48]
    assert [w.counted(c) for c in (1, 8, 16)] == [21, 21, 32]
    assert w.pilot_run().num_prompts(1) == 5 and w.pilot_run().counted(3) == 4
    w = workloads.load(str(_write(tmp_path, BASE + "slo: {ttft_ms: 300}\nmin_prompts: 24\n"
                                  "repeats: 4\n")))
    with pytest.raises(ConfigError, match="REPEATS="):
        workloads.check_search(replace(w, repeats=1))


def test_an_objective_names_what_a_run_misses_and_what_vllm_counts_as_goodput():
    objective = Objective(ttft_ms=500, itl_ms=100, percentile=90)
    assert objective.misses({"p90_ttft_ms": 400, "p90_itl_ms": 90}) == []
    missed = objective.misses({"p90_ttft_ms": 650, "p90_itl_ms": 90})
    assert missed == ["TTFT p90 650 ms > 500"]
    assert objective.misses({"p90_ttft_ms": 400}) == ["ITL p90 not reported"]
    assert objective.goodput_args() == ["--goodput", "ttft:500"]  # vLLM has no ITL goodput
    with pytest.raises(ValueError, match="at least one"):
        Objective(percentile=99)


def _write(tmp_path, text: str):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    return path


BASE = "dataset: random\ninput_len: 32\noutput_len: 8\n"
ENOUGH = "min_prompts: 24\nrepeats: 4\n"  # requests enough to show 90% at a point


def test_a_workload_with_an_slo_searches_instead_of_sweeping(tmp_path):
    w = workloads.load(str(_write(tmp_path, BASE + "slo: {ttft_ms: 300, percentile: 90}\n"
                                  + ENOUGH)))
    assert w.slo == Objective(ttft_ms=300, percentile=90)
    assert w.load_points == ()
    args = w.client_args(4)
    assert args[args.index("--metric-percentiles") + 1] == "50,90,99"
    assert args[args.index("--goodput") + 1] == "ttft:300"
    tighter = workloads.with_objective(w, ttft=200, itl=None)
    assert tighter.slo.ttft_ms == 200 and tighter.slo.percentile == 90


@pytest.mark.parametrize("text, names", [
    ("slo: {ttft: 300}\n", "slo.ttft"),
    ("slo: {ttft_ms: -1}\n", "slo.ttft_ms"),
    ("slo: {percentile: 99}\n", "at least one"),
    ("slo: {ttft_ms: 300}\nload_points: [1, 2]\n", "remove load_points"),
    ("slo: {ttft_ms: 300}\nsearch_precision: 1.5\n", "search_precision"),
])
def test_a_malformed_slo_is_an_error_naming_the_file_and_field(tmp_path, text, names):
    path = _write(tmp_path, BASE + text)
    with pytest.raises(ConfigError, match=names) as err:
        workloads.load(str(path))
    assert str(path) in str(err.value)


def test_the_shipped_capacity_workload_loads():
    w = workloads.load("capacity")
    assert w.slo is not None and w.slo.auto() == ["ttft", "itl"] and w.slo.bounds() == {}
    assert w.search_ceiling == 0  # auto: what each model's KV cache holds
    gpu = workloads.load("capacity-gpu")
    assert gpu.slo is not None and gpu.slo.bounds() == {"ttft": 1000.0, "itl": 50.0}


def test_an_auto_objective_is_derived_from_the_baselines_single_request_run():
    auto = Objective(ttft_ms="auto", itl_ms=250, factor=4)
    assert auto.describe() == "90% of requests within ITL 250 ms and TTFT 4x the baseline's"
    assert auto.goodput_args() == []  # nothing numeric for vLLM's goodput until derived
    result = _detailed(ttfts=[0.080, 0.090, 0.100], latencies=[0.5, 0.6, 0.7],
                       output_lens=[16, 16, 16], itls=[[0.03] * 15] * 3)
    derived = auto.derived(result, "the baseline")
    assert derived.ttft_ms == 360.0 and derived.itl_ms == 250.0  # 4 x 90 ms, rounded up
    assert derived.auto() == [] and derived.basis.startswith(
        "4 x the baseline's single-request TTFT 90 ms")
    assert derived.describe() == "90% of requests within TTFT 360 ms and ITL 250 ms"
    both = Objective(ttft_ms="auto", itl_ms="auto", factor=3).derived(result, "the baseline")
    assert both.itl_ms == 90.0  # 3 x the mean gap of 30 ms


def test_an_auto_ceiling_is_what_the_models_kv_cache_holds(tmp_path):
    from pipeline.bench.measure import ModelRecord, ceiling_for
    from pipeline.core.variant import Variant

    w = workloads.load(str(_write(tmp_path, BASE + "slo: {ttft_ms: auto}\nsearch_ceiling: auto\n"
                                  + ENOUGH)))
    assert w.search_ceiling == 0 and w.max_tokens_per_request == 41
    record = ModelRecord(Variant.__new__(Variant))
    assert ceiling_for(w, record) == 32  # no KV cache read: the old default
    record.kv = {"kv_cache_tokens": 4096.0, "kv_block_size": 16.0}
    assert ceiling_for(w, record) == 85  # 4096 tokens / 48 (41 rounded up to whole blocks)
    record.kv = {"kv_cache_tokens": 10_000_000.0, "kv_block_size": 16.0}
    assert ceiling_for(w, record) == 1024
    with pytest.raises(ConfigError, match=r"'search_ceiling' is a number .* or 'auto'"):
        workloads.load(str(_write(tmp_path, BASE + "slo: {ttft_ms: 9}\nsearch_ceiling: all\n")))


def _points(ttft_at_miss: float, preemptions: float = 0.0) -> dict[int, dict[str, float]]:
    return {4: {"requests_per_s": 5.0, "requests_per_s_min": 4.0, "requests_per_s_max": 6.0,
                "output_tokens_per_s": 80.0, "output_tokens_per_s_min": 70.0,
                "output_tokens_per_s_max": 90.0, "ttft_ms_p99": 300.0},
            5: {"ttft_ms_p90": ttft_at_miss, "preemptions": preemptions}}


def test_capacity_figures_say_what_limits_the_capacity(tmp_path):
    w = workloads.load(str(_write(tmp_path, BASE + "slo: {ttft_ms: 500}\n" + ENOUGH)))
    point = {"good": 48, "counted": 48, "runs": 2, "attainment": 1.0, "low": 0.91, "high": 1.0,
             "verdict": MEETS}
    found = {"max_concurrency": 4, "capacity_high": 4, "censored": False, "first_miss": 5,
             "ceiling": 32, "points": {4: point, 5: {**point, "good": 0, "verdict": MISSES}}}
    kv = {"kv_cache_tokens": 4096.0, "kv_block_size": 16.0}
    figures = capacity_figures(found, _points(700.0), w, kv)
    assert figures.slo_max_concurrency == 4
    assert figures.slo_output_tokens_per_s == 80.0
    assert figures.slo_requests_per_s_min == 4.0
    assert figures.slo_attainment == 1.0 and figures.slo_capacity_high == 4
    assert figures.workload == "w"
    assert figures.limited_by.startswith("latency (compute)")
    assert "TTFT p90 700 ms" in figures.limited_by
    # the engine preempted requests at the first miss: its KV cache was full
    assert capacity_figures(found, _points(700.0, preemptions=3), w, kv
                            ).limited_by.startswith("the KV cache")
    # a cache that holds fewer requests than the load that missed
    small = {"kv_cache_tokens": 64.0, "kv_block_size": 16.0}
    assert capacity_figures(found, _points(700.0), w, small).limited_by.startswith(
        "the KV cache: it holds 1 requests")


RATE = BASE + ("slo: {ttft_ms: 500}\nsearch_by: rate\nrate_start: 1\nrate_ceiling: 16\n"
               "rate_step: 0.25\nrun_seconds: 10\n" + ENOUGH)


def test_a_rate_search_sends_poisson_arrivals_and_brackets_by_doubling_the_rate(tmp_path):
    w = workloads.load(str(_write(tmp_path, RATE)))
    assert w.by_rate and w.levels == 17 and w.doubling == 4
    assert [w.rate_of(level) for level in (1, 5, 9, 17)] == [1.0, 2.0, 4.0, 16.0]
    args = w.client_args(5)
    assert args[args.index("--request-rate") + 1] == "2"
    assert args[args.index("--burstiness") + 1] == "1" and "--max-concurrency" not in args
    assert w.num_prompts(1) == 24 and w.num_prompts(9) == 40  # 4 req/s x 10 s
    assert w.load_text(5) == "2 req/s"
    # up to 2.83 req/s (level 7) every request meets it: bracketed by doubling, then bisected
    found, visited = search_with(step_curve(7), ceiling=w.levels, bracket_step=w.doubling)
    assert list(dict.fromkeys(visited))[:3] == [1, 5, 9] and found["max_concurrency"] == 7
    assert found["capacity_high"] == 7


def test_a_rate_searchs_figures_are_requests_per_second_and_price_the_fleet(tmp_path):
    from pipeline.core.artifacts import CostTarget, Row
    from pipeline.report import cost

    w = workloads.load(str(_write(tmp_path, RATE)))
    found, _ = search_with(step_curve(7), ceiling=w.levels, bracket_step=w.doubling)
    points = {c: {"output_tokens_per_s": 10.0 * c, "output_tokens_per_s_min": 9.0 * c,
                  "output_tokens_per_s_max": 11.0 * c, "requests_per_s": 0.6 * c}
              for c in found["points"]}
    figures = capacity_figures(found, points, w, {})
    assert figures.search_by == "rate" and figures.slo_max_concurrency is None
    assert figures.slo_max_request_rate == pytest.approx(2 ** 1.5)
    assert figures.points["7"].rate == pytest.approx(2 ** 1.5)
    assert figures.traffic.startswith("open loop: Poisson arrivals")
    from pipeline.bench.table import capacity_range

    assert capacity_range(figures) == "2.83 req/s"
    row = Row(name="v", recipe="v", scheme="S", format="f", precision="p", weight_bytes=1,
              weight_ratio=1.0, serving="ok", rate_capacity=figures)
    priced = cost.figures(row, 1.0, CostTarget(target_rps=10.0))
    assert priced is not None
    assert priced.machines_for_target_rps == 4  # 10 req/s / 2.83 per machine
    assert priced.rps_from == "the arrival-rate search (open loop)"
    assert priced.rate_usd_per_million_output_tokens == pytest.approx(
        1.0 / (70.0 * 3600) * 1e6)
    assert priced.usd_per_million_output_tokens is None  # no concurrency search: no users' cost


def test_an_auto_first_rate_is_half_what_one_user_at_a_time_sends(tmp_path):
    from pipeline.bench.measure import derive

    w = workloads.load(str(_write(tmp_path, RATE.replace("rate_start: 1", "rate_start: auto")
                                  .replace("ttft_ms: 500", "ttft_ms: auto"))))
    assert w.needs_probe and w.rate_start == 0
    result = _detailed(ttfts=[0.1, 0.1, 0.1], latencies=[0.5, 0.4, 0.6], output_lens=[9, 9, 9])
    ready = derive(w, result)
    assert ready.rate_start == 1.0 and ready.slo.ttft_ms == 400.0  # 1 / 0.5 s / 2; 4 x 100 ms
    assert ready.rate_ceiling == 64.0  # at least 64x the start


def test_a_derived_first_rate_is_what_the_figures_and_the_table_use(tmp_path):
    """An ``auto`` first rate is derived in the run: the recorded search keeps the rates it
    used, and the figures are in them, not in the file's unset start."""
    w = workloads.load(str(_write(tmp_path, RATE.replace("rate_start: 1", "rate_start: auto"))))
    assert w.rate_start == 0
    found, _ = search_with(step_curve(7), ceiling=17, bracket_step=4)
    found.update(rate_start=0.75, rate_ceiling=48.0)
    figures = capacity_figures(found, {}, w, {})
    assert figures.slo_max_request_rate == pytest.approx(0.75 * 2 ** 1.5)
    assert figures.points["1"].rate == 0.75


def test_two_lucky_runs_are_judged_with_the_spread_the_other_points_showed():
    """Runs at one load on the 2-core CPU differ by ~1.5 on the log-odds: a point whose two
    runs happened to keep every request is shown to meet 90% alone, but not once another
    point of the search has shown runs that far apart (its runs then continue); a point whose
    runs were all perfect shows no spread and is not pooled."""
    lucky = Point(14, looks=4)
    lucky.per_run += [(21, 21), (21, 21)]
    assert lucky.look(0.9, 0.05) == MEETS
    assert run_spread([lucky]) is None
    neighbour = Point(12, looks=4)
    neighbour.per_run += [(21, 21), (11, 21), (20, 21)]
    spread = run_spread([neighbour, lucky])
    assert spread is not None and spread.df == 2 and spread.between > 1
    assert lucky.look(0.9, 0.05, spread) is None and lucky.decided_by[0] < 0.9
    # a clear miss is still a miss with the spread, once the spread rests on a few runs
    missing = Point(20, looks=4)
    missing.per_run += [(5, 21), (7, 21), (4, 21)]
    assert missing.look(0.9, 0.05, run_spread([neighbour, missing])) == MISSES
