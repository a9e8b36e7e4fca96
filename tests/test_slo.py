"""Capacity at a latency objective: the search, the objective, the workload's slo block."""

from __future__ import annotations

import random

import pytest

from pipeline.bench import workloads
from pipeline.bench.slo import CapacitySearch, Objective
from pipeline.bench.summary import capacity_figures
from pipeline.core.errors import ConfigError


def fake_run(knee: float, noise: float = 0.0, rng: random.Random | None = None):
    """A latency curve with a known knee: TTFT p99 = 100 ms x concurrency / knee x 5, so the
    objective TTFT p99 <= 500 ms holds exactly up to ``knee``."""
    def run(concurrency: int) -> dict[str, float]:
        jitter = 1 + (rng.uniform(-noise, noise) if rng else 0.0)
        return {"p99_ttft_ms": 500 * concurrency / knee * jitter, "p99_itl_ms": 20.0}
    return run


def search_with(run, objective: Objective, **kwargs) -> tuple[dict, list[int]]:
    search, visited = CapacitySearch(**kwargs), []
    while (step := search.next_run()) is not None:
        concurrency, _ = step
        visited.append(concurrency)
        search.record(concurrency, not objective.misses(run(concurrency)))
    return search.result(), visited


OBJECTIVE = Objective(ttft_ms=500)


@pytest.mark.parametrize("knee", [1, 3, 7, 12, 20, 31])
def test_the_search_finds_a_known_knee_to_its_precision(knee):
    found, visited = search_with(fake_run(knee), OBJECTIVE, ceiling=32, repeats=3,
                                 precision=0.0)
    assert found["max_concurrency"] == knee
    assert found["first_miss"] == knee + 1
    assert not found["censored"]
    # bracket then bisect: a few points, not a sweep of 1..32
    assert len(set(visited)) <= 2 * 5 + 1


def test_precision_trades_points_for_a_coarser_answer():
    exact, visited_exact = search_with(fake_run(20), OBJECTIVE, ceiling=64, precision=0.0)
    coarse, visited_coarse = search_with(fake_run(20), OBJECTIVE, ceiling=64, precision=0.25)
    assert exact["max_concurrency"] == 20
    assert 16 <= coarse["max_concurrency"] <= 20  # a point that met it, within 25%
    assert coarse["first_miss"] - coarse["max_concurrency"] <= coarse["max_concurrency"] * 0.25
    assert len(set(visited_coarse)) < len(set(visited_exact))


def test_a_point_is_decided_by_the_majority_of_its_repeats_and_no_more_runs():
    search = CapacitySearch(ceiling=8, repeats=3)
    assert search.next_run() == (1, 0)
    search.record(1, True)
    assert search.next_run() == (1, 1)
    search.record(1, True)  # 2 of 3: decided, the third repeat is not run
    assert search.next_run() == (2, 0)
    search.record(2, False)
    search.record(2, True)
    assert search.next_run() == (2, 2)  # 1-1: the third repeat decides
    search.record(2, False)
    assert search.done
    assert search.result()["max_concurrency"] == 1
    assert search.result()["points"] == {1: [True, True], 2: [False, True, False]}


def test_noisy_runs_still_land_near_the_knee():
    rng = random.Random(0)
    found, _ = search_with(fake_run(10, noise=0.1, rng=rng), OBJECTIVE, ceiling=32,
                           precision=0.0)
    assert 9 <= found["max_concurrency"] <= 11


def test_a_model_that_misses_at_one_and_one_that_meets_the_ceiling():
    never, visited = search_with(fake_run(0.5), OBJECTIVE, ceiling=32)
    assert never["max_concurrency"] == 0 and visited == [1, 1]  # two misses decide it
    always, _ = search_with(fake_run(1000), OBJECTIVE, ceiling=32)
    assert always["max_concurrency"] == 32 and always["censored"]


def test_a_start_above_one_that_misses_searches_downwards():
    found, _ = search_with(fake_run(3), OBJECTIVE, ceiling=32, start=8, precision=0.0)
    assert found["max_concurrency"] == 3


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


def test_a_workload_with_an_slo_searches_instead_of_sweeping(tmp_path):
    w = workloads.load(str(_write(tmp_path, BASE + "slo: {ttft_ms: 300, percentile: 90}\n")))
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
    assert w.slo is not None and w.slo.bounds() == {"ttft": 500.0, "itl": 250.0}
    assert w.search_ceiling >= 8


def _points(ttft_at_miss: float, preemptions: float = 0.0) -> dict[int, dict[str, float]]:
    return {4: {"requests_per_s": 5.0, "requests_per_s_min": 4.0, "requests_per_s_max": 6.0,
                "output_tokens_per_s": 80.0, "output_tokens_per_s_min": 70.0,
                "output_tokens_per_s_max": 90.0, "ttft_ms_p99": 300.0},
            5: {"ttft_ms_p99": ttft_at_miss, "preemptions": preemptions}}


def test_capacity_figures_say_what_limits_the_capacity(tmp_path):
    w = workloads.load(str(_write(tmp_path, BASE + "slo: {ttft_ms: 500}\n")))
    found = {"max_concurrency": 4, "censored": False, "first_miss": 5, "ceiling": 32,
             "points": {4: [True, True], 5: [False, False]}}
    kv = {"kv_cache_tokens": 4096.0, "kv_block_size": 16.0}
    figures = capacity_figures(found, _points(700.0), w, kv)
    assert figures["slo_max_concurrency"] == 4
    assert figures["slo_output_tokens_per_s"] == 80.0
    assert figures["slo_requests_per_s_min"] == 4.0
    assert figures["limited_by"].startswith("latency (compute)")
    assert "TTFT p99 700 ms" in figures["limited_by"]
    # the engine preempted requests at the first miss: its KV cache was full
    assert capacity_figures(found, _points(700.0, preemptions=3), w, kv)[
        "limited_by"].startswith("the KV cache")
    # a cache that holds fewer requests than the load that missed
    small = {"kv_cache_tokens": 64.0, "kv_block_size": 16.0}
    assert capacity_figures(found, _points(700.0), w, small)["limited_by"].startswith(
        "the KV cache: it holds 1 requests")
