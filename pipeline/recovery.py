"""Percent recovery from paired per-sample results: point value, bootstrap interval, flips.

Pure functions (numpy only). ``baseline`` and ``variant`` are per-item scores of the same items
in the same order (1/0 for accuracy, any number for other metrics):

- recovery = mean(variant) / mean(baseline) x 100 (the ratio of the two task scores);
- its 95% interval: paired bootstrap, resampling items (both models together) with a fixed seed;
- flips: items whose score changed, either way;
- a suite figure: the mean of the per-task recoveries (not the ratio of the averaged scores),
  over the tasks where recovery is meaningful;
- not meaningful: the baseline is within noise of chance (its score minus 1.96 standard errors
  does not clear the chance level), so a ratio to it measures noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

BOOTSTRAP_ITERS = 2000
BOOTSTRAP_SEED = 1234
CONFIDENCE = 0.95
NOISE_Z = 1.96  # the baseline must clear chance by this many standard errors


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


def ratio_pct(baseline: Sequence[float], variant: Sequence[float]) -> float | None:
    """mean(variant) / mean(baseline) x 100; None when the baseline scores 0."""
    b, v = _arrays(baseline, variant)
    total = b.sum()
    return None if total == 0 else float(v.sum() / total * 100)


def flip_counts(baseline: Sequence[float], variant: Sequence[float]) -> tuple[int, int]:
    """(gained, lost): items the variant scores higher, and lower, than the baseline."""
    b, v = _arrays(baseline, variant)
    return int((v > b).sum()), int((v < b).sum())


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
    """True when the baseline's mean clears ``chance`` by more than ``z`` standard errors."""
    b = np.asarray(baseline, dtype=float)
    return bool(b.mean() - z * standard_error(b) > chance)


def recovery(baseline: Sequence[float], variant: Sequence[float], chance: float = 0.0,
             iters: int = BOOTSTRAP_ITERS, seed: int = BOOTSTRAP_SEED) -> Recovery:
    """Everything about one task and metric; ``chance`` is the score of random answers."""
    b, v = _arrays(baseline, variant)
    gained, lost = flip_counts(b, v)
    ok = meaningful(b, chance)
    pct = ratio_pct(b, v) if ok else None
    ci = interval(bootstrap_ratios(b, v, iters, seed)) if pct is not None else None
    return Recovery(
        n=int(b.size), baseline_score=float(b.mean()), variant_score=float(v.mean()),
        chance=float(chance), meaningful=ok, recovery_pct=pct,
        ci_low=ci[0] if ci else None, ci_high=ci[1] if ci else None,
        flips=gained + lost, flip_rate=(gained + lost) / b.size, gained=gained, lost=lost)


@dataclass(frozen=True)
class SuiteRecovery:
    """Mean of per-task recoveries over the meaningful tasks, with a bootstrap interval."""

    recovery_pct: float | None
    ci_low: float | None
    ci_high: float | None
    tasks: tuple[str, ...]  # the tasks that entered the mean
    skipped: tuple[str, ...]  # not meaningful (or a zero baseline)

    def as_dict(self) -> dict:
        return asdict(self)


def suite_recovery(pairs: dict[str, tuple[Sequence[float], Sequence[float]]],
                   chances: dict[str, float], iters: int = BOOTSTRAP_ITERS,
                   seed: int = BOOTSTRAP_SEED) -> SuiteRecovery:
    """Mean of the per-task recoveries; each task resampled on its own, replicate by replicate."""
    used, skipped, points, draws = [], [], [], []
    for offset, (task, (b, v)) in enumerate(sorted(pairs.items())):
        r = recovery(b, v, chances.get(task, 0.0), iters=1)
        if r.recovery_pct is None:
            skipped.append(task)
            continue
        used.append(task)
        points.append(r.recovery_pct)
        draws.append(bootstrap_ratios(b, v, iters, seed + offset))
    if not used:
        return SuiteRecovery(None, None, None, (), tuple(skipped))
    ci = interval(np.mean(np.vstack(draws), axis=0))
    return SuiteRecovery(float(np.mean(points)), ci[0] if ci else None, ci[1] if ci else None,
                         tuple(used), tuple(skipped))
