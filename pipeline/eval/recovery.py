"""Percent recovery from paired per-item results: point value, an interval honest at small n and
at zero flips, flips, chance detection, and what a sample of n items can certify at best.

Pure functions (numpy and scipy's distributions). ``baseline`` and ``variant`` are per-item
scores of the same items in the same order (1/0 for accuracy, any number for other metrics):

- recovery = mean(variant) / mean(baseline) x 100 (the ratio of the two task scores);
- its 95% interval, for 0/1 scores, from the paired table (right under the baseline only:
  lost; under the variant only: gained): recovery = 1 - lost/right + gained/right. The lower
  end bounds the losses alone with Clopper-Pearson's exact one-sided 2.5% bound, so it lies
  above the true recovery at most 2.5% of the time whatever the parameters (the tests check it
  by exact enumeration); gains only raise the truth and never certify a pass, so one task's
  gains cannot buy another's losses either. The upper end adds the gains' bound to the
  losses' (1.25% each). (Newcombe's paired-difference interval divided by the baseline's score,
  used before, put its lower end above the truth up to 9% of the time at a baseline of 0.5.)
  Zero flips in n items still allow a loss of about 3.7/right, and the interval says so (a
  bootstrap would give [100, 100] at any n). Other scores: a paired bootstrap, with the 0/1
  bound as the floor when no item changed;
- above chance: (variant - chance) / (baseline - chance), the share of the skill above random
  answers that is kept, shown beside the raw ratio where a task has a chance level (on a
  2-choice task 0.80 -> 0.77 is 96.25% of the score but 90% of the skill above chance);
- certifiable: the lower end the interval would have if not one item flipped, at this n and
  this baseline score: the best recovery these items can ever certify ("131 items can certify
  at best 97.3%"); ``items_needed`` says how many would certify a threshold, and
  ``suite_items_needed`` how many a suite would need, averaged as it is;
- flips: items whose score changed, either way;
- a suite figure: the mean of its tasks' recoveries, its interval combined from theirs by
  MOVER (the same variance-recovery step Newcombe's method uses), over the tasks where
  recovery is meaningful;
- not meaningful: the baseline is within noise of chance (the lower end of its score's 95%
  Wilson interval does not clear the chance level), so a ratio to it measures noise.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats

from pipeline.core.artifacts import BOOTSTRAP, EXACT, Recovery, SuiteFigure
from pipeline.core.shares import share_bounds

BOOTSTRAP_ITERS = 2000
BOOTSTRAP_SEED = 1234
CONFIDENCE = 0.95
Z = 1.959963984540054  # two-sided 95%
NOISE_Z = Z  # the baseline must clear chance by its 95% interval
ALPHA_SIDE = (1 - CONFIDENCE) / 2  # each end of the interval


def _arrays(baseline: Sequence[float], variant: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    b = np.asarray(baseline, dtype=float)
    v = np.asarray(variant, dtype=float)
    if b.shape != v.shape or b.ndim != 1:
        raise ValueError(f"paired scores need two equal-length lists, got {b.shape} and {v.shape}")
    if b.size == 0:
        raise ValueError("paired scores are empty: no items were scored")
    return b, v


def is_binary(*scores: np.ndarray) -> bool:
    return all(bool(np.isin(s, (0.0, 1.0)).all()) for s in scores)


def ratio_pct(baseline: Sequence[float], variant: Sequence[float]) -> float | None:
    """mean(variant) / mean(baseline) x 100; None when the baseline scores 0."""
    b, v = _arrays(baseline, variant)
    total = b.sum()
    return None if total == 0 else float(v.sum() / total * 100)


def flip_counts(baseline: Sequence[float], variant: Sequence[float]) -> tuple[int, int]:
    """(gained, lost): items the variant scores higher, and lower, than the baseline."""
    b, v = _arrays(baseline, variant)
    return int((v > b).sum()), int((v < b).sum())


def wilson(successes: float, n: int, z: float = Z) -> tuple[float, float]:
    """Wilson score interval of a proportion at two-sided ``z`` (sound at 0 and n successes,
    unlike p +- z.se): scipy's ``binomtest(...).proportion_ci(method="wilson")``."""
    if n <= 0:
        return 0.0, 1.0
    ci = stats.binomtest(round(successes), n).proportion_ci(
        confidence_level=2 * stats.norm.cdf(z) - 1, method="wilson")
    return float(ci.low), float(ci.high)


def loss_bound(lost: int, right: int, alpha: float = ALPHA_SIDE) -> float:
    """Clopper-Pearson's one-sided upper bound on the share of the baseline's right items that
    the variant loses (exact: it lies above the true share with probability >= 1 - alpha)."""
    if right <= 0:
        return 1.0
    return 1.0 if lost >= right else float(stats.beta.ppf(1 - alpha, lost + 1, right - lost))


def paired_interval(both: int, lost: int, gained: int, neither: int
                    ) -> tuple[float, float] | None:
    """The 95% interval of recovery (%) from the paired 2x2 table; None when the baseline
    scores 0. Recovery = 1 - lost/right + gained/right (right: the baseline's right items):

    - the lower end bounds the losses alone (Clopper-Pearson, one-sided 2.5%): exact, so it
      lies above the true recovery at most 2.5% of the time whatever the gains (which only
      raise the truth); gains never certify a pass;
    - the upper end adds the bound of the gains to that of the losses (each one-sided 1.25%).
    """
    right, wrong = both + lost, gained + neither
    if right == 0:
        return None
    lost_high = loss_bound(lost, right)
    lost_low, _ = share_bounds(lost, right, ALPHA_SIDE / 2)
    _, gained_high = share_bounds(gained, wrong, ALPHA_SIDE / 2)
    return 100 * (1 - lost_high), 100 * (1 - lost_low + gained_high * wrong / right)


def binary_recovery_interval(b: np.ndarray, v: np.ndarray) -> tuple[float, float] | None:
    """The 95% interval of recovery (%) for 0/1 scores; None when the baseline scores 0."""
    both = int(((b == 1) & (v == 1)).sum())
    lost = int(((b == 1) & (v == 0)).sum())
    gained = int(((b == 0) & (v == 1)).sum())
    return paired_interval(both, lost, gained, b.size - both - lost - gained)


def certifiable_pct(n: int, baseline_score: float) -> float | None:
    """The lower end of the interval if the variant matched the baseline on all ``n`` items:
    no sample of n items at this baseline score can certify more."""
    right = round(baseline_score * n)
    if n <= 0 or right == 0:
        return None
    return 100 * (1 - loss_bound(0, right))


def items_needed(threshold_pct: float, baseline_score: float, limit: int = 10**7) -> int | None:
    """The fewest items (at this baseline score, zero flips) whose interval clears the
    threshold; None if no number up to ``limit`` does (a threshold of 100% never can)."""
    def ok(n: int) -> bool:
        best = certifiable_pct(n, baseline_score)
        return best is not None and best >= threshold_pct

    if threshold_pct >= 100 or not ok(limit):
        return None
    low, high = 1, 1
    while not ok(high):
        low, high = high, high * 2
    while low < high:  # the lower end grows with n: the first n that clears it
        mid = (low + high) // 2
        low, high = (mid + 1, high) if not ok(mid) else (low, mid)
    return high


def suite_items_needed(tasks: Sequence[tuple[int, float]], threshold_pct: float,
                       limit: int = 10**7) -> int | None:
    """The fewest items in all (each task grown in proportion to its ``n``, at its baseline
    score, zero flips) whose suite interval, averaged as :func:`suite_from_tasks` averages,
    clears the threshold; None if no number up to ``limit`` does."""
    total = sum(n for n, _ in tasks)
    if not tasks or threshold_pct >= 100 or total <= 0:
        return None

    def best(scale: float) -> float | None:
        ends = [certifiable_pct(max(1, round(n * scale)), score) for n, score in tasks]
        if any(e is None for e in ends):
            return None
        return _mover([100.0] * len(ends), [float(e) for e in ends if e is not None], -1)

    def ok(items: int) -> bool:
        found = best(items / total)
        return found is not None and found >= threshold_pct

    if not ok(limit):
        return None
    low, high = 1, max(1, total)
    while not ok(high):
        low, high = high, high * 2
    while low < high:
        mid = (low + high) // 2
        low, high = (mid + 1, high) if not ok(mid) else (low, mid)
    return high


def above_chance_pct(baseline_score: float, variant_score: float, chance: float) -> float | None:
    """The share of the baseline's skill above chance that the variant keeps, in percent."""
    if chance <= 0 or baseline_score <= chance:
        return None
    return (variant_score - chance) / (baseline_score - chance) * 100


def _ratio_pct(baseline: np.ndarray, variant: np.ndarray, axis: int = -1) -> np.ndarray:
    """Recovery (%) of each resample along ``axis``; NaN where its baseline sums to 0."""
    bs, vs = baseline.sum(axis=axis), variant.sum(axis=axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(bs != 0, vs / bs * 100, np.nan)


def bootstrap_ratios(baseline: Sequence[float], variant: Sequence[float],
                     iters: int = BOOTSTRAP_ITERS, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """Recovery (%) of ``iters`` paired resamples (scipy's ``bootstrap(paired=True)``); NaN
    where a resample's baseline sums to 0 (:func:`interval` drops those)."""
    b, v = _arrays(baseline, variant)
    with warnings.catch_warnings():  # its own interval is not used: NaNs are dropped below
        warnings.simplefilter("ignore")
        found = stats.bootstrap((b, v), _ratio_pct, paired=True, vectorized=True,
                                n_resamples=iters, method="percentile", rng=seed)
    return found.bootstrap_distribution


def interval(samples: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Percentile interval of bootstrap samples (NaNs dropped); None if none is finite."""
    finite = samples[np.isfinite(samples)]
    if finite.size == 0:
        return None
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(finite, [tail, 100 - tail])
    return float(low), float(high)


def standard_error(scores: Sequence[float]) -> float:
    """Standard error of the mean (population variance, as lm-eval's acc_stderr for 0/1)."""
    x = np.asarray(scores, dtype=float)
    return float(x.std() / math.sqrt(x.size)) if x.size else float("nan")


def meaningful(baseline: Sequence[float], chance: float, z: float = NOISE_Z) -> bool:
    """True when the baseline's score clears ``chance`` by its 95% interval (Wilson for 0/1
    scores, which stays honest for tiny samples; mean - z standard errors otherwise)."""
    b = np.asarray(baseline, dtype=float)
    if b.size == 0:
        return False
    if is_binary(b):
        return wilson(float(b.sum()), int(b.size), z)[0] > chance
    return bool(b.mean() - z * standard_error(b) > chance)


def recovery(baseline: Sequence[float], variant: Sequence[float], chance: float = 0.0,
             iters: int = BOOTSTRAP_ITERS, seed: int = BOOTSTRAP_SEED) -> Recovery:
    """Everything about one task and metric; ``chance`` is the score of random answers."""
    b, v = _arrays(baseline, variant)
    gained, lost = flip_counts(b, v)
    ok = meaningful(b, chance)
    pct = ratio_pct(b, v) if ok else None
    binary = is_binary(b, v)
    ci: tuple[float, float] | None = None
    best = None
    if pct is not None:
        base_score = float(b.mean())
        best = certifiable_pct(int(b.size), min(base_score, 1.0)) if base_score <= 1 else None
        if binary:
            ci = binary_recovery_interval(b, v)
        else:
            ci = interval(bootstrap_ratios(b, v, iters, seed))
            if ci is not None and best is not None and gained + lost == 0:
                ci = (min(ci[0], best), max(ci[1], 200 - best))  # no change seen: not [100, 100]
    return Recovery(
        n=int(b.size), baseline_score=float(b.mean()), variant_score=float(v.mean()),
        chance=float(chance), meaningful=ok, recovery_pct=pct,
        ci_low=ci[0] if ci else None, ci_high=ci[1] if ci else None,
        flips=gained + lost, flip_rate=(gained + lost) / b.size, gained=gained, lost=lost,
        certifiable_pct=best, method=EXACT if binary else BOOTSTRAP,
        above_chance_pct=above_chance_pct(float(b.mean()), float(v.mean()), chance)
        if pct is not None else None)


def _mover(points: list[float], ends: list[float], sign: int) -> float:
    """MOVER (Zou & Donner 2008) for the mean of independent estimates: the distance of the
    mean to its limit is the root of the summed squared distances, over their count."""
    k = len(points)
    return float(np.mean(points)) + sign * math.sqrt(
        sum((p - e) ** 2 for p, e in zip(points, ends, strict=True))) / k


def suite_from_tasks(tasks: Mapping[str, Recovery]) -> SuiteFigure:
    """The suite figure from its tasks' own recoveries (its ``backend`` is the caller's to
    set)."""
    used, skipped = [], []
    rows: list[Recovery] = []
    for name, r in sorted(tasks.items()):
        if r.recovery_pct is None or r.ci_low is None or r.ci_high is None:
            skipped.append(name)
            continue
        used.append(name)
        rows.append(r)
    if not used:
        return SuiteFigure(recovery_pct=None, ci_low=None, ci_high=None, skipped=skipped)
    points = [r.recovery_pct for r in rows if r.recovery_pct is not None]
    low = _mover(points, [r.ci_low for r in rows if r.ci_low is not None], -1)
    high = _mover(points, [r.ci_high for r in rows if r.ci_high is not None], +1)
    best = None
    ends = [r.certifiable_pct for r in rows if r.certifiable_pct is not None]
    if len(ends) == len(rows):
        best = _mover([100.0] * len(rows), ends, -1)
    return SuiteFigure(recovery_pct=float(np.mean(points)), ci_low=low, ci_high=high,
                       tasks=used, skipped=skipped, items=sum(r.n for r in rows),
                       certifiable_pct=best)


def suite_recovery(pairs: dict[str, tuple[Sequence[float], Sequence[float]]],
                   chances: dict[str, float]) -> SuiteFigure:
    """Mean of the per-task recoveries, from each task's paired scores."""
    return suite_from_tasks({task: recovery(b, v, chances.get(task, 0.0))
                             for task, (b, v) in pairs.items()})
