"""The speed verdict's parts: the interval's looks, the verdict an interval gives, the sequential
stop and Holm's correction (their error rates are measured in test_calibrate)."""

from __future__ import annotations

import math

import pytest

from pipeline.core import speedup as sp


@pytest.mark.parametrize(("first", "last"), [(2, 2), (2, 3), (2, 8), (3, 10)])
def test_the_shares_of_alpha_over_the_looks_sum_to_one(first: int, last: int) -> None:
    looks = sp.Looks.of(first, last)
    assert math.isclose(sum(looks.share(n) for n in range(looks.first, looks.last + 1)), 1.0)


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
