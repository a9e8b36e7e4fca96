"""Capacity at a latency objective: the search, the objective, the workload's slo block."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import pytest

from pipeline.bench import knee, table, workloads
from pipeline.bench.slo import CapacitySearch, Objective, start_wave
from pipeline.bench.summary import capacity_figures
from pipeline.calibrate.scenarios import attainment_curve
from pipeline.core.artifacts import PointFigures
from pipeline.core.errors import ConfigError


def step_curve(knee: int) -> Callable[[int], float]:
    """Every request meets the objective up to ``knee`` users, none above."""
    return lambda c: 1.0 if c <= knee else 0.0


def search_with(curve: Callable[[int], float], requests: int = 24,
                rng: random.Random | None = None, **kwargs) -> tuple[dict, list[int]]:
    """The search on a known attainment curve: each run's requests meet it at the curve's rate
    (exactly, or drawn with ``rng``)."""
    search, visited = CapacitySearch(**kwargs), []
    while (step := search.next_run()) is not None:
        concurrency, run = step
        visited.append(concurrency)
        share = curve(concurrency)
        n = search.pilot if search.is_pilot(concurrency, run) else requests
        good = (sum(rng.random() < share for _ in range(n)) if rng else round(share * n))
        search.record(concurrency, good, n)
    return search.result(), visited


@pytest.mark.parametrize("knee", [1, 3, 7, 12, 20, 31])
def test_a_sharp_knee_is_bracketed_then_refined_to_one_user(knee):
    found, visited = search_with(step_curve(knee), ceiling=32)
    assert (found["capacity"], found["capacity_high"]) == (knee, knee)
    # every run perfect or empty says nothing of how much runs vary: under a spread of 4
    # log-odds, four perfect runs of 24 requests are chance at a long-run 90%; the perfect
    # runs of a longer bracket make that spread unlikely
    assert found["capacity_low"] == (knee if knee >= 7 else 0)
    assert found["outcome"] == "estimated" and not found["censored"] and found["knee"] is None
    # bracket, a grid, a grid between the two loads it falls between: not a sweep of 1..32
    assert len(set(visited)) <= 13


def test_the_bracket_doubles_on_two_runs_then_a_grid_of_five_loads_gets_its_runs_in_turn():
    curve = attainment_curve(12, 0.95, 14, 0.85)
    found, visited = search_with(curve, requests=40, ceiling=32, max_runs=4)
    assert visited[:8] == [1, 1, 2, 2, 4, 4, 8, 8]  # 16: below 90% on its two runs
    assert visited[8:10] == [16, 16] and found["bracket"] == [8, 16]
    grid = [c for c, p in found["points"].items() if p["grid"]]
    assert grid == [8, 10, 12, 13, 14, 16]
    assert all(found["points"][c]["runs"] == 4 for c in grid)
    # one run per load in turn (fewest runs first), so that a drifting host hits them all
    assert visited[10:13] == [10, 12, 14]
    # then a finer grid between the two loads the share crosses between (12: 95%, 14: 85%),
    # (after 3 x 4 + 2 x 2 grid runs), and the fit over the two it then crosses between
    assert set(visited[10 + 16:]) == {13} and found["fitted_over"] == [13, 14]
    assert 12 <= found["knee"] <= 14 and found["capacity"] == 13
    low, high = found["capacity_low"], found["capacity_high"]
    # two neighbouring loads of 160 requests do not show a fall of 5 points at 90%: open
    assert (low is None or low <= 13) and (high is None or high >= 13)
    assert found["fit"]["dispersion"] >= 1.0
    assert all(p["fitted"] is not None for p in found["points"].values())


def test_binomial_noise_is_counted_once_and_runs_that_vary_widen_the_interval():
    """Runs that vary no more than their requests' binomial noise: dispersion 1, the plain
    binomial fit's interval (the runs' spread is not charged on top of it). Runs that vary as on
    the 2-core CPU (one run 100%, the next 50%): a dispersion above 1 and a wider interval."""
    loads = [8, 8, 10, 10, 12, 12, 14, 14, 16, 16]
    steady = [84, 84, 82, 82, 77, 77, 68, 68, 50, 50]
    calm = knee.fit(loads, steady, [84] * 10, 0.9)
    assert calm is not None and calm.dispersion == 1.0 and 12 < calm.knee < 14
    varied = [84, 84, 84, 80, 84, 70, 84, 52, 62, 38]
    wild = knee.fit(loads, varied, [84] * 10, 0.9)
    assert wild is not None and wild.dispersion > 2
    assert wild.high is None or (wild.high - wild.low) > (calm.high - calm.low)
    # no fall: no knee
    assert knee.fit([4, 4, 8, 8], [10, 10, 20, 20], [24] * 4, 0.9) is None


def test_a_pilot_run_is_never_pooled_with_full_runs():
    """One pilot miss (3 of 4) on a model that meets easily: the old log-odds pooling made it
    capacity 0 in 1.4% of searches; pilots now only tell a hopeless model."""
    search = CapacitySearch(ceiling=4, target=0.9, max_runs=2, pilot=4)
    for load, run, good, counted in [(1, 0, 3, 4), (1, 1, 4, 4), (1, 2, 21, 21),
                                     (1, 3, 21, 21)]:
        assert search.next_run() == (load, run) and search.is_pilot(1, run) == (run < 2)
        search.record(load, good, counted)
    assert search.points[1].good == 42 and search.points[1].counted == 42
    assert search.next_run() == (2, 0)
    found = search.result()
    assert found["points"][1]["pilots"] == 2 and found["points"][1]["attainment"] == 1.0


def test_two_pilot_runs_decide_a_hopeless_model_in_eight_requests():
    search = CapacitySearch(ceiling=32, target=0.9, max_runs=4, pilot=4)
    search.record(1, 0, 4)
    search.record(1, 0, 4)
    assert search.done and search.next_run() is None
    found = search.result()
    assert found["capacity"] == 0 and found["outcome"].startswith("misses at the first load")


def test_a_model_that_misses_at_one_and_one_that_reaches_the_ceiling():
    never, visited = search_with(step_curve(0), ceiling=32)
    assert never["capacity"] == 0 and never["outcome"] == "misses at the first load"
    assert visited == [1] * 4  # its two bracketing runs, then up to four to show it
    always, _ = search_with(step_curve(1000), ceiling=32)
    assert always["capacity"] == 32 and always["censored"] and always["capacity_high"] is None


def test_censored_means_the_ceiling_was_shown_to_meet_undecided_is_not(tmp_path):
    shown, _ = search_with(step_curve(1000), ceiling=32)
    unsure, _ = search_with(lambda c: 0.92, ceiling=32)  # 92% of 96: not shown to clear 90%
    assert shown["outcome"] == "censored" and shown["capacity_low"] == 32
    assert unsure["outcome"] == "undecided at the ceiling" and not unsure["censored"]
    assert unsure["capacity_low"] is None
    work = workloads.load("capacity")
    caps = [capacity_figures({**found, "slo": work.slo.model_dump()}, {}, work, {})
            for found in (shown, unsure)]
    assert caps[0].text() == ">= 32 (censored)" and caps[1].text().startswith("32?")
    assert "raise search_ceiling" in caps[0].limited_by
    assert "raise repeats" in caps[1].limited_by and "search_ceiling" not in caps[1].limited_by
    # no export carries either as a plain capacity
    assert "slo_max_concurrency" not in caps[0].metrics()
    assert caps[0].metrics()["slo_max_concurrency_lower_bound"] == 32
    assert "slo_max_concurrency" not in caps[1].metrics()


def test_a_start_above_one_that_misses_searches_below_it():
    found, _ = search_with(step_curve(3), ceiling=32, start=8)
    assert (found["capacity"], found["capacity_low"], found["capacity_high"]) == (3, 3, 3)


def test_noisy_requests_on_a_smooth_knee_give_an_interval_that_holds_the_truth():
    """A 90% interval: over 40 searches (fixed seeds) it holds the truth in at least 32 (a
    rule whose intervals held it 80% of the time would pass this 59% of the time, one at 90%
    98%), and the point is within a load of it in most."""
    curve = attainment_curve(12, 0.95, 14, 0.85)  # the truth: 13 users at >= 90%
    held = near = 0
    for seed in range(40):
        found, _ = search_with(curve, requests=36, rng=random.Random(seed), ceiling=32)
        low, high = found["capacity_low"], found["capacity_high"]
        held += (low is None or low <= 13) and (high is None or high >= 13)
        near += abs(found["capacity"] - 13) <= 1
    assert held >= 32 and near >= 30


def search_by_run(share: Callable[[int, int], float], requests: int = 40,
                  **kwargs) -> tuple[dict, list[int]]:
    """The search where a run's share depends on its load and its index at that load: two
    bracketing runs that land on the wrong side of the target by chance."""
    search, visited = CapacitySearch(**kwargs), []
    while (step := search.next_run()) is not None:
        concurrency, run = step
        visited.append(concurrency)
        search.record(concurrency, round(share(concurrency, run) * requests), requests)
    return search.result(), visited


def test_a_grid_whose_top_still_meets_is_extended_up_to_the_knee():
    """16 users: its two bracketing runs 80% (below 90%) by chance, its next two 100%; the knee
    is at 20. The grid over 8-16 ends on a load that meets, so loads are added above it."""
    def share(c: int, run: int) -> float:
        if c == 16 and run < 2:
            return 0.8
        return 1.0 if c <= 20 else 0.0
    found, visited = search_by_run(share, ceiling=64)
    assert found["bracket"] == [8, 16] and found["points"][16]["attainment"] == 0.9
    assert {18, 22}.issubset(visited)  # one grid step (2) above the top, then 4 more
    assert (found["capacity"], found["capacity_low"], found["capacity_high"]) == (20, 20, 20)
    assert found["outcome"] == "estimated"


def test_a_grid_whose_bottom_misses_is_extended_down_to_the_knee():
    """8 users: its two bracketing runs 100%, its next two 60% (pooled 80%); the knee is at 5."""
    def share(c: int, run: int) -> float:
        if c == 8:
            return 1.0 if run < 2 else 0.6
        return 1.0 if c <= 5 else 0.5
    found, visited = search_by_run(share, ceiling=64)
    assert found["bracket"] == [8, 16] and found["points"][8]["attainment"] == 0.8
    assert 6 in visited and found["first_below"] == 6 and {5, 6} <= set(found["fitted_over"])
    assert found["capacity"] in (4, 5)


def test_the_crossing_is_read_on_shares_made_to_fall_with_load():
    """12: 87.5%, 14: 92.5% (noise about a share near 90% at both): the crossing is not at 12
    but past 14, where the share falls for good (16: 50%)."""
    shares = {8: 1.0, 10: 0.975, 12: 0.875, 14: 0.925, 16: 0.5}

    def share(c: int, run: int) -> float:
        return shares.get(c, 1.0 if c < 16 else 0.5)
    found, _ = search_by_run(share, ceiling=32)
    assert found["first_below"] == 16 and found["fitted_over"][-1] == 16
    assert found["capacity"] >= 14


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


def _points(ttft_at_miss: float, preemptions: float = 0.0) -> dict[int, PointFigures]:
    return {4: PointFigures(metrics={
                "requests_per_s": 5.0, "requests_per_s_min": 4.0, "requests_per_s_max": 6.0,
                "output_tokens_per_s": 80.0, "output_tokens_per_s_min": 70.0,
                "output_tokens_per_s_max": 90.0, "ttft_ms_p99": 300.0}),
            5: PointFigures(metrics={"ttft_ms_p90": ttft_at_miss, "preemptions": preemptions})}


def test_capacity_figures_say_what_limits_the_capacity(tmp_path):
    w = workloads.load(str(_write(tmp_path, BASE + "slo: {ttft_ms: 500}\n" + ENOUGH)))
    found, _ = search_with(step_curve(4), ceiling=32)  # 4 meets, 5 (the first below) misses
    assert found["first_below"] == 5
    kv = {"kv_cache_tokens": 4096.0, "kv_block_size": 16.0}
    figures = capacity_figures(found, _points(700.0), w, kv)
    assert figures.slo_max_concurrency == 4
    assert figures.slo_output_tokens_per_s == 80.0
    assert figures.slo_requests_per_s_min == 4.0
    assert figures.slo_capacity_low == figures.slo_capacity_high == 4
    # a closed interval of one load is shown as one: 4 shown to meet and 5 to miss
    assert figures.text(" users") == "4 [4-4] users"
    assert "(90% CI, this session; " in table.capacity_text(figures)
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
    # up to 2.83 req/s (level 7) every request meets it: bracketed by doubling, then a grid
    found, visited = search_with(step_curve(7), ceiling=w.levels, bracket_step=w.doubling)
    assert list(dict.fromkeys(visited))[:3] == [1, 5, 9] and found["capacity"] == 7
    assert found["bracket"] == [5, 9] and found["capacity_high"] == 7


def test_a_rate_searchs_figures_are_requests_per_second_and_price_the_fleet(tmp_path):
    from pipeline.core.artifacts import CostTarget, Price, Row
    from pipeline.report import cost

    w = workloads.load(str(_write(tmp_path, RATE)))
    found, _ = search_with(step_curve(7), ceiling=w.levels, bracket_step=w.doubling)
    points = {c: PointFigures(metrics={
        "output_tokens_per_s": 10.0 * c, "output_tokens_per_s_min": 9.0 * c,
        "output_tokens_per_s_max": 11.0 * c, "requests_per_s": 0.6 * c})
              for c in found["points"]}
    figures = capacity_figures(found, points, w, {})
    assert figures.search_by == "rate" and figures.slo_max_concurrency is None
    assert figures.slo_max_request_rate == pytest.approx(2 ** 1.5)
    assert figures.points["7"].rate == pytest.approx(2 ** 1.5)
    assert figures.traffic.startswith("open loop: Poisson arrivals")
    # a step between levels 7 and 8: the rate at which it falls lies between their rates
    assert figures.text() == "2.83 [2.83-3.36] req/s"
    row = Row(name="v", recipe="v", scheme="S", format="f", precision="p", weight_bytes=1,
              weight_ratio=1.0, serving="ok", rate_capacity=figures)
    priced = cost.figures(row, CostTarget(target_rps=10.0), Price(price_per_hour=1.0))
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
