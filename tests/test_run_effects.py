"""The random-run-effect test of which loads a capacity search's runs show to meet a share."""

from __future__ import annotations

import numpy as np

from pipeline.bench import run_effects


def _runs(rng: np.random.Generator, mus: dict[int, float], sigma: float, runs: int = 4,
          requests: int = 28) -> dict[int, list[tuple[int, int]]]:
    """Each run binomial at log-odds ``mu[load] + sigma z``."""
    out = {}
    for load, mu in mus.items():
        p = 1 / (1 + np.exp(-(mu + sigma * rng.standard_normal(runs))))
        out[load] = [(int(rng.binomial(requests, q)), requests) for q in p]
    return out


def test_loads_clearly_above_and_below_the_target_are_shown_so():
    runs = {4: [(49, 50), (50, 50), (49, 50), (50, 50)],
            8: [(44, 50), (46, 50), (45, 50), (45, 50)],
            16: [(25, 50), (24, 50), (26, 50), (25, 50)]}
    verdicts, sigma = run_effects.shown(runs, 0.9, 0.025)
    assert verdicts == {4: 1, 8: 0, 16: -1}
    assert sigma <= 0.3  # the runs of each load agree: no run effect


def test_the_run_effect_is_estimated_from_every_loads_runs():
    rng = np.random.default_rng(7)
    runs = _runs(rng, {4: 2.5, 8: 1.5, 12: 0.5, 16: -0.5, 20: -1.5}, sigma=1.5, runs=8)
    _, sigma = run_effects.shown(runs, 0.9, 0.025)
    assert 0.9 <= sigma <= 2.3


def test_four_high_runs_are_no_proof_where_runs_vary():
    # 110 of 112 requests (exact 97.5% bound 0.937) clear 90% if requests were the unit;
    # under the spread the other loads' runs show, three perfect runs and a lower one are
    # what a load below 90% gives by chance
    spread = {10: [(28, 28), (15, 28), (27, 28), (28, 28)],
              20: [(20, 28), (5, 28), (28, 28), (12, 28)]}
    skewed = {14: [(28, 28), (28, 28), (28, 28), (26, 28)]}
    verdicts, sigma = run_effects.shown({**spread, **skewed}, 0.9, 0.025)
    assert sigma >= 1.0 and verdicts[14] == 0
    calm = {10: [(28, 28), (27, 28), (28, 28), (28, 28)],
            20: [(14, 28), (13, 28), (15, 28), (14, 28)]}
    verdicts, sigma = run_effects.shown({**calm, **skewed}, 0.9, 0.025)
    assert sigma == 0.0 and verdicts[14] == 1  # where runs agree, the same four runs show it
