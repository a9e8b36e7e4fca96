"""Percent recovery, paired bootstrap intervals, flips and chance detection, on hand-made cases."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from pipeline.eval import recovery


def test_ratio_is_variant_over_baseline_times_100() -> None:
    # baseline 4/5 right, variant 3/5 right: 3/4 = 75 %
    assert recovery.ratio_pct([1, 1, 1, 1, 0], [1, 1, 1, 0, 0]) == pytest.approx(75.0)
    # a variant can recover more than 100 %
    assert recovery.ratio_pct([1, 0, 0, 0], [1, 1, 0, 0]) == pytest.approx(200.0)
    # non-binary metrics: means of the scores
    assert recovery.ratio_pct([0.5, 1.5], [0.5, 0.5]) == pytest.approx(50.0)
    assert recovery.ratio_pct([0, 0], [1, 0]) is None


def test_flips_count_changes_in_either_direction() -> None:
    base = [1, 1, 0, 0, 1, 0]
    var = [1, 0, 1, 0, 0, 0]  # item 1 and 4 lost, item 2 gained
    assert recovery.flip_counts(base, var) == (1, 2)
    r = recovery.recovery(base, var, chance=0.0)
    assert (r.flips, r.gained, r.lost) == (3, 1, 2)
    assert r.flip_rate == pytest.approx(0.5)
    # same totals (2 right each), different items: recovery 100 % but flips show the churn
    r = recovery.recovery([1, 1, 0, 0], [0, 0, 1, 1], chance=0.0)
    assert r.recovery_pct == pytest.approx(100.0) and r.flips == 4


def test_bootstrap_of_two_items_matches_the_exact_distribution() -> None:
    # base [1, 1], var [1, 0]: resamples (0,0) -> 100 %, (0,1)/(1,0) -> 50 %, (1,1) -> 0 %,
    # with probabilities 1/4, 1/2, 1/4.
    draws = recovery.bootstrap_ratios([1, 1], [1, 0], iters=20000, seed=7)
    values, counts = np.unique(draws, return_counts=True)
    assert list(values) == [0.0, 50.0, 100.0]
    assert counts / counts.sum() == pytest.approx([0.25, 0.5, 0.25], abs=0.02)
    assert recovery.interval(draws) == (0.0, 100.0)


def test_zero_flips_do_not_give_a_zero_width_interval() -> None:
    """Identical answers on 8 items prove little: 0 losses in n allow a loss of about 3/n."""
    scores = [1, 0, 1, 1, 0, 1, 1, 1]
    r = recovery.recovery(scores, scores, chance=0.25)
    assert r.recovery_pct == 100.0 and r.flips == 0
    assert r.ci_low < 75 and r.ci_high > 100  # a bootstrap gave [100, 100]
    assert r.certifiable_pct == pytest.approx(r.ci_low)
    # more identical items narrow it, and no number of items can certify 100%
    lows = [recovery.recovery([1] * n + [0] * n, [1] * n + [0] * n).ci_low for n in (10, 100, 1000)]
    assert lows[0] < lows[1] < lows[2] < 100
    assert recovery.items_needed(100, 0.9) is None
    need = recovery.items_needed(99, 0.95)
    assert recovery.certifiable_pct(need, 0.95) >= 99 > recovery.certifiable_pct(need - 1, 0.95)


def test_the_interval_covers_the_true_recovery_at_small_n_and_rare_flips() -> None:
    """Simulated paired tasks: the 95% interval holds the true recovery at least ~95% of the
    time, including samples with no flip at all (where a bootstrap never covers a loss)."""
    rng = np.random.default_rng(11)
    for p_base, loss, gain, n in [(0.95, 0.02, 0.0, 131), (0.95, 0.03, 0.0, 40),
                                  (0.65, 0.05, 0.08, 95), (0.9, 0.1, 0.3, 20)]:
        truth = (p_base * (1 - loss) + (1 - p_base) * gain) / p_base * 100
        covered, zero_flip_cases, boot_covered = 0, 0, 0
        for _ in range(1500):
            b = (rng.random(n) < p_base).astype(float)
            v = np.where(b == 1, rng.random(n) >= loss, rng.random(n) < gain).astype(float)
            if b.sum() == 0:
                continue
            low, high = recovery.binary_recovery_interval(b, v)
            covered += low <= truth <= high
            if (b == v).all():
                zero_flip_cases += 1
                boot = recovery.interval(recovery.bootstrap_ratios(b, v, iters=200))
                boot_covered += boot[0] <= truth <= boot[1]
        assert covered / 1500 >= 0.94, (p_base, loss, gain, n, covered)
        if zero_flip_cases:
            assert boot_covered == 0  # what the interval replaces: [100, 100] at any n


def test_interval_is_paired_and_reproducible() -> None:
    rng = np.random.default_rng(0)
    base = (rng.random(400) < 0.8).astype(float)
    var = base.copy()
    var[:12] = 1 - var[:12]  # 12 flips out of 400
    a = recovery.recovery(base, var, chance=0.5)
    b = recovery.recovery(base, var, chance=0.5)
    assert a == b  # fixed seed
    assert a.ci_low <= a.recovery_pct <= a.ci_high
    # pairing: the interval reflects the 12 discordant items, not two independent 80 % scores;
    # unpaired it would be ~+-7 points wide, paired (and exact on the losses) ~+-4
    assert a.ci_high - a.ci_low < 9
    # the interval of an independent resample of each model would be much wider
    rng2 = np.random.default_rng(1)
    ib, iv = rng2.integers(0, 400, (2000, 400)), rng2.integers(0, 400, (2000, 400))
    unpaired = var[iv].sum(1) / base[ib].sum(1) * 100
    assert np.percentile(unpaired, 97.5) - np.percentile(unpaired, 2.5) > 2 * (a.ci_high - a.ci_low)


def test_chance_detection() -> None:
    # 2-choice task, baseline 52 % of 100 items: Wilson lower end 0.42 < 0.5
    near = [1] * 52 + [0] * 48
    assert not recovery.meaningful(near, chance=0.5)
    r = recovery.recovery(near, near, chance=0.5)
    assert not r.meaningful and r.recovery_pct is None and r.ci_low is None
    # 70 % of 100 items: Wilson lower end 0.60 > 0.5
    assert recovery.meaningful([1] * 70 + [0] * 30, chance=0.5)
    # a generation task the baseline never solves: chance 0, score 0 -> not meaningful
    assert not recovery.meaningful([0] * 50, chance=0.0)
    # 2 right of 50 with chance 0: the Wilson interval [0.011, 0.135] clears 0 (a normal
    # approximation, 0.04 - 1.96 x 0.028 < 0, did not); its recovery interval is then wide
    assert recovery.meaningful([1, 1] + [0] * 48, chance=0.0)
    rare = recovery.recovery([1, 1] + [0] * 48, [1, 0] + [0] * 48, chance=0.0)
    assert rare.ci_high - rare.ci_low > 50
    # 3 of 3 right on a 4-choice task: Wilson [0.44, 1] clears 0.25
    assert recovery.meaningful([1, 1, 1], chance=0.25)
    assert not recovery.meaningful([1, 1, 1], chance=0.5)


def test_suite_figure_is_the_mean_of_task_recoveries_not_the_ratio_of_means() -> None:
    # task a: 10 items, baseline 10 right, variant 5 -> 50 %
    # task b: 100 items, baseline 50 right, variant 50 -> 100 %
    a = ([1] * 10, [1] * 5 + [0] * 5)
    b = ([1] * 50 + [0] * 50, [1] * 50 + [0] * 50)
    fig = recovery.suite_recovery({"a": a, "b": b}, {"a": 0.0, "b": 0.0})
    assert fig.recovery_pct == pytest.approx(75.0)  # (50 + 100) / 2
    # the ratio of the pooled scores would be 55 / 60 = 91.7 %
    pooled = recovery.ratio_pct(a[0] + b[0], a[1] + b[1])
    assert pooled == pytest.approx(91.67, abs=0.01)
    assert fig.ci_low <= 75.0 <= fig.ci_high
    assert fig.tasks == ["a", "b"] and fig.skipped == []


def test_suite_figure_skips_tasks_at_chance() -> None:
    good = ([1] * 40 + [0] * 10, [1] * 38 + [0] * 12)
    at_chance = ([1] * 26 + [0] * 24, [1] * 20 + [0] * 30)
    fig = recovery.suite_recovery({"good": good, "coin": at_chance}, {"good": 0.5, "coin": 0.5})
    assert fig.tasks == ["good"] and fig.skipped == ["coin"]
    assert fig.recovery_pct == pytest.approx(95.0)
    empty = recovery.suite_recovery({"coin": at_chance}, {"coin": 0.5})
    assert empty.recovery_pct is None and empty.skipped == ["coin"]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="equal-length"):
        recovery.recovery([1, 0], [1], chance=0.0)
    with pytest.raises(ValueError, match="empty"):
        recovery.recovery([], [], chance=0.0)


@functools.lru_cache
def _lower_ends(n: int) -> tuple[np.ndarray, ...]:
    """The interval's lower end for every outcome of n items with no gains: [right][lost]."""
    return tuple(np.array([recovery.paired_interval(right - lost, lost, 0, n - right)[0]
                           for lost in range(right + 1)]) for right in range(1, n + 1))


def _lower_end_above_truth(n: int, base_p: float, truth: float) -> float:
    """Exactly: the probability that the interval's lower end lies above the true recovery
    ``truth`` (a share), summed over every outcome of n items: the baseline right on each with
    ``base_p``, the variant losing each of those with 1 - truth, gaining none (gains only raise
    the truth, and the lower end ignores them)."""
    from scipy.stats import binom

    total = 0.0
    right_p = binom.pmf(np.arange(n + 1), n, base_p)
    for right, lows in enumerate(_lower_ends(n), start=1):
        if right_p[right] >= 1e-12:
            lost_p = binom.pmf(np.arange(right + 1), right, 1 - truth)
            total += right_p[right] * lost_p[lows > truth * 100].sum()
    return total


@pytest.mark.parametrize("n", [40, 100, pytest.param(286, marks=pytest.mark.slow)])
def test_the_lower_end_is_above_the_true_recovery_at_most_its_nominal_share(n: int) -> None:
    """A pass is claimed at 97.5% one-sided: the lower end may lie above the truth at most
    2.5% of the time, at every baseline score and true recovery (Newcombe's paired-difference
    interval over the baseline's score did 4.0% at n = 100 with 3 items lost, and up to 9% at a
    baseline of 0.5)."""
    worst = max(_lower_end_above_truth(n, base_p, truth) for base_p in (0.5, 0.8, 0.95)
                for truth in (0.9, 0.95, 0.96, 0.97, 0.98, 0.99, 0.995))
    assert worst <= 0.025


def test_above_chance_recovery_shows_the_skill_that_is_gone() -> None:
    base = [1] * 80 + [0] * 20
    var = [0] * 3 + [1] * 77 + [0] * 20  # 0.80 -> 0.77 on a 2-choice task
    r = recovery.recovery(base, var, chance=0.5)
    assert r.recovery_pct == pytest.approx(96.25)
    assert r.above_chance_pct == pytest.approx(90.0)  # a tenth of the skill above chance
    assert recovery.recovery(base, var, chance=0.0).above_chance_pct is None


def test_items_a_suite_needs_are_counted_as_the_suite_is_averaged() -> None:
    """Three tasks at baseline 0.8, averaged: many more items than one pooled task needs."""
    pooled = recovery.items_needed(99, 0.8)
    suite = recovery.suite_items_needed([(100, 0.8)] * 3, 99)
    assert pooled is not None and suite is not None and suite > 1.6 * pooled
    # and that many items do certify it (as the suite's figure is computed), one fewer not
    each = -(-suite // 3)
    tasks = {f"t{i}": recovery.Recovery(
        n=each, baseline_score=0.8, variant_score=0.8, chance=0.25, meaningful=True,
        recovery_pct=100.0, ci_low=0.0, ci_high=0.0, flips=0, flip_rate=0.0, gained=0, lost=0,
        certifiable_pct=recovery.certifiable_pct(each, 0.8)) for i in range(3)}
    assert recovery.suite_from_tasks(tasks).certifiable_pct >= 99
