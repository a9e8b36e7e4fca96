"""The order of the interleaved runs: random per repeat, so that a drifting host's speed is
uncorrelated with which model runs where (the t interval's assumption)."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np

from pipeline.bench.measure import run_order
from pipeline.calibrate.scenarios import DRIFT_RHO, DRIFT_SD
from pipeline.core.variant import BASELINE

NAMES = [BASELINE, "int4", "int8", "fp8"]


def test_each_repeat_is_a_permutation_and_the_same_in_every_bench() -> None:
    for repeat in range(50):
        order = run_order(NAMES, repeat)
        assert sorted(order) == sorted(NAMES)
        assert order == run_order(list(NAMES), repeat)
    assert len({tuple(run_order(NAMES, r)) for r in range(50)}) > 10


def test_the_baseline_and_a_variant_are_exchangeable() -> None:
    """Each variant runs just before the baseline as often as just after it, and the
    baseline takes every position alike (counted over 4,000 repeats)."""
    before, after, where = Counter(), Counter(), Counter()
    for repeat in range(4000):
        order = run_order(NAMES, repeat)
        i = order.index(BASELINE)
        where[i] += 1
        if i > 0:
            before[order[i - 1]] += 1
        if i < len(order) - 1:
            after[order[i + 1]] += 1
    assert all(abs(where[i] / 4000 - 0.25) < 0.03 for i in range(4))
    for name in NAMES[1:]:
        assert abs(before[name] - after[name]) / 4000 < 0.03


def _successive_ratio_correlation(order_of, repeats: int = 20, draws: int = 2000) -> float:
    """The correlation of successive log ratios (one variant at 1.00, the baseline) measured
    run by run in ``order_of(names, repeat)`` on the drifting host that make calibrate
    simulates (AR(1) from run to run)."""
    rng = np.random.default_rng(7)
    innovation = DRIFT_SD * math.sqrt(1 - DRIFT_RHO ** 2)
    pairs = []
    for _ in range(draws):
        level = rng.normal(0, DRIFT_SD)
        logs: list[float] = []
        for repeat in range(repeats):
            speed = {}
            for name in order_of([BASELINE, "v"], repeat):
                level = DRIFT_RHO * level + rng.normal(0, innovation)
                speed[name] = level
            logs.append(speed["v"] - speed[BASELINE])
        pairs += list(itertools.pairwise(logs))
    x = np.array(pairs)
    return float(np.corrcoef(x[:, 0], x[:, 1])[0, 1])


def test_successive_ratios_are_uncorrelated_on_a_drifting_host() -> None:
    """Over the chat sweep's 20 repeats at most: the rule before (baseline first, reversed
    every other repeat) put the baseline's runs of two repeats side by side, so successive
    ratios correlated (~0.11) and the t interval was too narrow; in a random order ~0.02."""
    def alternating(names: list[str], repeat: int) -> list[str]:
        return names if repeat % 2 == 0 else names[::-1]

    assert _successive_ratio_correlation(alternating) > 0.08
    assert abs(_successive_ratio_correlation(run_order)) < 0.05
