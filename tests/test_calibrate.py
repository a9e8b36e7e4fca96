"""The verdicts' error rates, measured by simulation against a known truth (``make calibrate``):
every wrong verdict at or under its nominal rate within the Monte-Carlo error. The fast subset
runs in ``make test-fast``, the whole table in ``make test``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.calibrate import stage
from pipeline.calibrate.scenarios import MISSES_TRUTH, Scenario, catalogue
from pipeline.core.speedup import FASTER, Looks, decided
from tests.conftest import run_cli


def _above(rows: list[dict]) -> list[str]:
    return [f"{r['scenario']}: {r['verdict']} {r['rate']:.1%} > {r['nominal']:.1%} + "
            f"{r['mc_error']:.1%}" for r in rows if not r["within"]]


def test_the_fast_subset_of_verdicts_is_within_its_nominal_error_rates() -> None:
    rows = stage.calibrate(stage.CalibrateSettings(runs=400, fast=True, noise=0.05))
    assert {r["kind"] for r in rows} >= {"speed", "recommendation", "gate-task", "gate-suite",
                                         "capacity", "cost"}
    missed = [r for r in rows if r["kind"] == "capacity" and r["verdict"] == MISSES_TRUTH]
    bias = [r for r in rows if r["kind"] == "capacity" and r["verdict"] == stage.BIAS]
    cheaper = [r for r in rows if r["kind"] == "cost" and r["verdict"] == "cheaper"]
    assert missed and all(r["nominal"] == pytest.approx(0.10) for r in missed)
    assert bias and all(r["nominal"] is not None for r in bias)  # |bias| within a bound
    assert cheaper and all(r["nominal"] == 0.05 for r in cheaper)
    assert not _above(rows), _above(rows)


@pytest.mark.slow
def test_every_verdict_is_within_its_nominal_error_rate(workspace: Path) -> None:
    result = run_cli("calibrate", "--runs", "1000", timeout=1800)  # make calibrate: 2000
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((workspace / "artifacts" / "calibration" / "calibration.json").read_text())
    rows = data["rows"]
    assert {"verdict", "scenario", "truth", "rate", "nominal", "mc_error"} <= set(rows[0])
    assert not _above(rows)
    # the cases the speed verdict was built for
    true_one = [r for r in rows if r["scenario"].startswith("true speedup 1.00")
                and r["verdict"] == FASTER]
    assert true_one and all(r["rate"] <= 0.05 + r["mc_error"] for r in true_one)
    four = [r for r in rows if r["scenario"].startswith("4 variant")
            and r["verdict"] == "recommends one"]
    assert four and all(r["rate"] <= 0.05 + r["mc_error"] for r in four)
    fp8 = [r for r in rows if "0.09" in r["scenario"] and r["verdict"] == "slower"]
    assert fp8 and all(r["rate"] > 0.99 for r in fp8)
    assert "true speedup 1.00" in result.stdout and "nominal" in result.stdout


def test_the_suite_can_fail_a_rule_that_is_wrong_too_often() -> None:
    """The old speed rule (faster when every one of 3 ratios is above 1) at a true 1.00:
    1/8 of the time per variant, measured, and refused."""
    def old_rule(rng: np.random.Generator) -> str:
        ratios = np.exp(rng.normal(0, 0.05, 3))
        return FASTER if (ratios > 1).all() else "not faster"

    bad = Scenario("speed", "min of three ratios > 1 at a true 1.00", "not faster", old_rule,
                   {FASTER: 0.05})
    rates, errors = stage.simulate(bad, 2000, np.random.default_rng(0))
    rows = stage.rows_for(bad, rates, errors, runs=2000)
    assert rates[FASTER] == pytest.approx(0.125, abs=0.025)
    assert _above(rows)


def test_the_same_seed_gives_the_same_table() -> None:
    settings = stage.CalibrateSettings(runs=60, fast=True, noise=0.05, seed=3)
    assert stage.calibrate(settings) == stage.calibrate(settings)


def test_a_clear_case_is_decided_in_two_repeats_and_noise_takes_the_cap() -> None:
    looks = Looks.of(2, 8)
    rng = np.random.default_rng(1)
    (fp8,) = [s for s in catalogue(0.05, looks, "noise 0.05") if "0.09" in s.name]
    assert fp8.draw(rng) == "slower"
    from pipeline.core.speedup import speedup

    assert speedup([0.09, 0.092], looks).n == 2  # decided at the first look
    ratios = [1.01, 0.99, 1.02, 0.98, 1.03, 0.97, 1.0, 1.01]
    stop = next(n for n in range(1, 9) if decided(ratios[:n], looks))  # as the loop stops
    same = speedup(ratios[:stop], looks)
    assert same.verdict == "within +-5%" and same.n == stop == 4  # decided before the cap (6 with
    # a Bonferroni split of ALPHA over the looks)
    noisy = speedup([1.1, 0.9, 1.08, 0.93, 1.05, 0.95, 1.0, 1.02], looks)
    assert noisy.n == 8 and noisy.verdict == "inconclusive"  # the cap: "inconclusive at n = 8"


def test_the_noise_is_this_machines_own_once_a_bench_run_measured_it(workspace: Path) -> None:
    from pipeline.core import tracking
    from pipeline.core.artifacts import BenchSummary, ModelBench, WorkloadFigures

    assert stage.measured_noise() is None  # nothing measured: the two project levels
    assert [sd for sd, _ in stage.noise_levels(stage.CalibrateSettings())] == list(
        stage.DEFAULT_NOISE)
    sweep = WorkloadFigures(points={1: {tracking.SPEEDUP_LOG_SD: 0.04},
                                    4: {tracking.SPEEDUP_LOG_SD: 0.06}})
    search = WorkloadFigures(points={2: {tracking.SPEEDUP_LOG_SD: 0.9}},
                             capacity={"workload": "capacity", "objective": "o"})
    summary = BenchSummary(baseline="B", target="cpu", key="k1", models={
        "int8": ModelBench(recipe="int8", status="ok", identity="i", format="f",
                           workloads={"chat": sweep, "capacity": search})})
    summary.write(BenchSummary.path("B", "k1"))
    sd, where = stage.measured_noise()
    assert sd == pytest.approx(0.05) and "k1" in where  # the sweeps' points, not the search's
    assert stage.noise_levels(stage.CalibrateSettings())[0][0] == pytest.approx(0.05)
