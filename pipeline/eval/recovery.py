"""Percent recovery from paired per-item results: point value, an interval honest at small n and
at zero flips, flips, chance detection, and what a sample of n items can certify at best.

Pure functions (numpy only). ``baseline`` and ``variant`` are per-item scores of the same items
in the same order (1/0 for accuracy, any number for other metrics):

- recovery = mean(variant) / mean(baseline) x 100 (the ratio of the two task scores);
- its 95% interval, for 0/1 scores: Newcombe's hybrid score interval for a paired difference
  of proportions (Newcombe 1998, method 10: Wilson intervals of both scores, combined with the
  correlation of the pairs), divided by the baseline's score. It does not collapse when no item
  flips: 0 flips in n items still allow a loss of about 3/n, and the interval says so (a
  bootstrap would give [100, 100] at any n). Other scores: a paired bootstrap, with the 0/1
  bound as the floor when no item changed;
- certifiable: the lower end the interval would have if not one item flipped, at this n and
  this baseline score: the best recovery these items can ever certify ("131 items can certify
  at best 97.3%"); ``items_needed`` says how many would certify a threshold;
- flips: items whose score changed, either way;
- a suite figure: the mean of its tasks' recoveries, its interval combined from theirs by
  MOVER (the same variance-recovery step Newcombe's method uses), over the tasks where
  recovery is meaningful;
- not meaningful: the baseline is within noise of chance (the lower end of its score's 95%
  Wilson interval does not clear the chance level), so a ratio to it measures noise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

BOOTSTRAP_ITERS = 2000
BOOTSTRAP_SEED = 1234
CONFIDENCE = 0.95
Z = 1.959963984540054  # two-sided 95%
NOISE_Z = Z  # the baseline must clear chance by its 95% interval
NEWCOMBE, BOOTSTRAP = "newcombe", "bootstrap"


@dataclass(frozen=True)
class Recovery:
    """Recovery of one task and metric; percentages, None where undefined."""

    n: int
    baseline_score: float
    variant_score: float
    chance: float
    meaningful: bool
    recovery_pct: float | None  # None: not meaningful, or a zero baseline
    ci_low: float | None
    ci_high: float | None
    flips: int
    flip_rate: float
    gained: int  # wrong (lower) under the baseline, right (higher) under the variant
    lost: int
    certifiable_pct: float | None = None  # the lower end with zero flips: the best n can show
    method: str = NEWCOMBE

    def as_dict(self) -> dict:
        return asdict(self)


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
    """Wilson score interval of a proportion (sound at 0 and n successes, unlike p +- z.se)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes <= 0 else max(0.0, centre - half)  # exact ends, not rounding noise
    high = 1.0 if successes >= n else min(1.0, centre + half)
    return low, high


def paired_difference_interval(both: int, lost: int, gained: int, neither: int,
                               z: float = Z) -> tuple[float, float]:
    """Newcombe's method 10 interval for p_variant - p_baseline from a paired 2x2 table.

    ``lost``: right under the baseline only; ``gained``: right under the variant only.
    """
    n = both + lost + gained + neither
    p1, p2 = (both + lost) / n, (both + gained) / n  # baseline, variant
    l1, u1 = wilson(both + lost, n, z)
    l2, u2 = wilson(both + gained, n, z)
    num = both * neither - lost * gained
    if num > 0:  # Newcombe's continuity correction of the correlation
        num = max(num - n / 2, 0.0)
    margins = (both + lost) * (gained + neither) * (both + gained) * (lost + neither)
    phi = num / math.sqrt(margins) if margins > 0 else 0.0
    delta = p2 - p1
    low = delta - math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2)
                                + (p2 - l2) ** 2, 0.0))
    high = delta + math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2)
                                 + (u2 - p2) ** 2, 0.0))
    return max(low, -1.0), min(high, 1.0)


def binary_recovery_interval(b: np.ndarray, v: np.ndarray) -> tuple[float, float] | None:
    """The 95% interval of recovery (%) for 0/1 scores; None when the baseline scores 0."""
    both = int(((b == 1) & (v == 1)).sum())
    lost = int(((b == 1) & (v == 0)).sum())
    gained = int(((b == 0) & (v == 1)).sum())
    neither = b.size - both - lost - gained
    p1 = (both + lost) / b.size
    if p1 == 0:
        return None
    low, high = paired_difference_interval(both, lost, gained, neither)
    return 100 * (1 + low / p1), 100 * (1 + high / p1)


def certifiable_pct(n: int, baseline_score: float) -> float | None:
    """The lower end of the interval if the variant matched the baseline on all ``n`` items:
    no sample of n items at this baseline score can certify more."""
    right = round(baseline_score * n)
    if n <= 0 or right == 0:
        return None
    low, _ = paired_difference_interval(right, 0, 0, n - right)
    return 100 * (1 + low / (right / n))


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


def bootstrap_ratios(baseline: Sequence[float], variant: Sequence[float],
                     iters: int = BOOTSTRAP_ITERS, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """Recovery (%) of ``iters`` paired resamples; NaN where a resample's baseline sums to 0."""
    b, v = _arrays(baseline, variant)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, b.size, size=(iters, b.size))
    bs, vs = b[idx].sum(axis=1), v[idx].sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(bs != 0, vs / bs * 100, np.nan)


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
        certifiable_pct=best, method=NEWCOMBE if binary else BOOTSTRAP)


@dataclass(frozen=True)
class SuiteRecovery:
    """Mean of per-task recoveries over the meaningful tasks, with a MOVER interval."""

    recovery_pct: float | None
    ci_low: float | None
    ci_high: float | None
    tasks: tuple[str, ...]  # the tasks that entered the mean
    skipped: tuple[str, ...]  # not meaningful (or a zero baseline)
    items: int = 0  # items of the tasks that entered the mean
    certifiable_pct: float | None = None  # the best lower end these tasks could give together

    def as_dict(self) -> dict:
        return asdict(self)


def _mover(points: list[float], ends: list[float], sign: int) -> float:
    """MOVER (Zou & Donner 2008) for the mean of independent estimates: the distance of the
    mean to its limit is the root of the summed squared distances, over their count."""
    k = len(points)
    return float(np.mean(points)) + sign * math.sqrt(
        sum((p - e) ** 2 for p, e in zip(points, ends, strict=True))) / k


def suite_from_tasks(tasks: Mapping[str, Recovery | Mapping]) -> SuiteRecovery:
    """The suite figure from its tasks' own recoveries (objects or their ``as_dict``)."""
    used, skipped = [], []
    rows = []
    for name, r in sorted(tasks.items()):
        d = r.as_dict() if isinstance(r, Recovery) else dict(r)
        if d.get("recovery_pct") is None or d.get("ci_low") is None:
            skipped.append(name)
            continue
        used.append(name)
        rows.append(d)
    if not used:
        return SuiteRecovery(None, None, None, (), tuple(skipped))
    points = [d["recovery_pct"] for d in rows]
    low = _mover(points, [d["ci_low"] for d in rows], -1)
    high = _mover(points, [d["ci_high"] for d in rows], +1)
    best = None
    if all(d.get("certifiable_pct") is not None for d in rows):
        best = _mover([100.0] * len(rows), [d["certifiable_pct"] for d in rows], -1)
    return SuiteRecovery(float(np.mean(points)), low, high, tuple(used), tuple(skipped),
                         sum(int(d["n"]) for d in rows), best)


def suite_recovery(pairs: dict[str, tuple[Sequence[float], Sequence[float]]],
                   chances: dict[str, float]) -> SuiteRecovery:
    """Mean of the per-task recoveries, from each task's paired scores."""
    return suite_from_tasks({task: recovery(b, v, chances.get(task, 0.0))
                             for task, (b, v) in pairs.items()})
