"""The speed verdict's parts: the interval's looks, the verdict an interval gives, the sequential
stop and Holm's correction (their error rates are measured in test_calibrate)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.core import speedup as sp


@pytest.mark.parametrize(("first", "last"), [(2, 3), (2, 8), (2, 20), (3, 10)])
def test_the_boundary_holds_its_level_over_every_look_on_fresh_null_draws(first: int,
                                                                          last: int) -> None:
    """The chance of a false "faster" at any look is ALPHA (its own simulation, another seed):
    above a Bonferroni split's (which wastes repeats) and not above the nominal."""
    looks = sp.Looks.of(first, last)
    x = np.random.default_rng(7).standard_normal((40_000, last))
    p = sp._t_pvalues(x, first)
    levels = np.array([looks.level(n) for n in range(first, last + 1)])
    rate = float(np.mean((p <= levels).any(axis=1)))
    mc_error = 3 * math.sqrt(sp.ALPHA * (1 - sp.ALPHA) / len(x))
    assert abs(rate - sp.ALPHA) <= mc_error
    bonferroni = sp.ALPHA * (1 - sp.FIRST_SHARE) / (last - first)
    assert looks.level(last) > 2 * bonferroni or last - first == 1


def test_the_sequential_p_value_agrees_with_the_looks_verdicts() -> None:
    """A sequence is "faster" at ALPHA exactly when its p-value is at most ALPHA (rounded up
    on the grid: never below it)."""
    looks = sp.Looks.of(2, 20)
    rng = np.random.default_rng(3)
    for _ in range(200):
        logs = rng.normal(0.06, 0.1, size=int(rng.integers(2, 21)))
        ratios = np.exp(logs).tolist()
        found = sp.speedup(ratios, looks)
        crossed = any(sp.speedup(ratios[:n], looks).verdict == sp.FASTER
                      for n in range(2, len(ratios) + 1))
        assert (found.p_faster <= sp.ALPHA) <= crossed
        if not crossed:
            assert found.p_faster > sp.ALPHA


def test_one_repeat_has_no_interval_and_is_inconclusive() -> None:
    found = sp.speedup([1.3], sp.Looks.of(1, 1))
    assert found.low is None and found.verdict == sp.INCONCLUSIVE
    assert "no interval" in found.text()
    assert sp.Looks.of(1, 1).first == 2  # an interval needs two ratios


@pytest.mark.parametrize(("low", "high", "verdict"), [
    (1.01, 1.2, sp.FASTER), (0.8, 0.99, sp.SLOWER), (0.96, 1.04, sp.SAME),
    (0.97, 1.08, sp.INCONCLUSIVE), (None, None, sp.INCONCLUSIVE)])
def test_an_interval_gives_one_verdict(low: float | None, high: float | None,
                                       verdict: str) -> None:
    assert sp.verdict_of(low, high) == verdict


def test_the_loop_stops_at_the_first_decisive_look_and_the_summary_agrees() -> None:
    looks = sp.Looks.of(2, 8)
    ratios = [1.10, 1.12, 1.11]
    assert not sp.decided(ratios[:1], looks)
    found = sp.speedup(ratios, looks)
    assert found.verdict == sp.FASTER and found.low > 1
    assert sp.decided(ratios[:found.n], looks)
    assert sp.speedup(ratios[:found.n], looks) == found  # the same look, read again


def test_holm_keeps_only_what_survives_the_family() -> None:
    assert sp.holm({"a": 0.01, "b": 0.04}) == {"a", "b"}  # 0.01 <= 0.025, 0.04 <= 0.05
    assert sp.holm({"a": 0.03, "b": 0.04}) == set()  # 0.03 > 0.025: the step-down stops
    assert sp.holm({"a": 0.001, "b": 0.3, "c": 0.01}) == {"a", "c"}
    assert sp.holm({}) == set()


def test_ratios_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        sp.speedup([1.0, 0.0], sp.Looks.of(2, 4))


def test_the_p90_of_ten_values_is_the_ninth_not_the_largest() -> None:
    from pipeline.bench.summary import length_distribution, nearest_rank

    assert nearest_rank(10, 0.9) == 8 and nearest_rank(11, 0.9) == 9 and nearest_rank(1, 0.9) == 0
    lengths = length_distribution([{"input_lens": list(range(1, 11)),
                                    "output_lens": list(range(1, 11))}])
    assert lengths is not None and lengths["input_tokens_p90"] == 9


def test_point_figures_carry_a_typed_verdict_and_flatten_only_for_mlflow() -> None:
    from pipeline.bench.summary import point_figures
    from pipeline.core import tracking
    from pipeline.core.artifacts import PointFigures, WorkloadFigures

    base = [{"output_throughput": 100.0 + r} for r in range(6)]
    var = [{"output_throughput": 130.0 + 2 * r} for r in range(6)]
    at = point_figures(var, base, sp.Looks(6, 6))
    assert at.speedup is not None and at.speedup.verdict == sp.FASTER and at.speedup.n == 6
    assert at.metrics[tracking.OUTPUT_TOKENS_PER_S] == pytest.approx(135.0)  # the median
    assert at.speedup_log_sd is not None and at.speedup_log_sd > 0
    flat = at.flat()
    assert flat[tracking.SPEEDUP] == at.speedup.point
    assert flat[tracking.SPEEDUP_CI_LOW] == at.speedup.low and flat[tracking.SPEEDUP_N] == 6
    # on disk and back: the verdict is read, not re-derived from string keys
    again = WorkloadFigures.model_validate_json(WorkloadFigures(points={4: at}).model_dump_json())
    assert again.points[4] == at
    # a bench summary written before the verdict was typed (one flat dict) reads the same
    old = PointFigures.model_validate(flat)
    assert old.speedup is not None and old.speedup.verdict == sp.FASTER
    assert old.speedup.point == at.speedup.point and old.metrics == at.metrics
    assert not PointFigures() and PointFigures(metrics={tracking.TTFT_MS_P50: 1.0})
    with pytest.raises(ValueError):
        PointFigures.model_validate({"metrics": {}, "speedup_verdict": "faster"})
