"""Exact bounds on a share of independent trials (Clopper-Pearson), for every verdict that
rests on a count: the gate's losses, a load point's SLO attainment; and Student's t quantile.
Both cached: the calibration's draws ask the same few thousand of them millions of times."""

from __future__ import annotations

from functools import lru_cache

from scipy import stats


@lru_cache(maxsize=4096)
def t_quantile(q: float, df: int) -> float:
    """Student's t quantile ``q`` at ``df`` degrees of freedom."""
    return float(stats.t.ppf(q, df))


@lru_cache(maxsize=65536)
def share_bounds(count: int, total: int, alpha: float) -> tuple[float, float]:
    """Clopper-Pearson's one-sided lower and upper bounds of a share, each at ``alpha``: the
    lower lies below the true share, the upper above it, each with probability >= 1 - alpha."""
    if total <= 0:
        return 0.0, 0.0
    low = 0.0 if count <= 0 else float(stats.beta.ppf(alpha, count, total - count + 1))
    high = 1.0 if count >= total else float(stats.beta.ppf(1 - alpha, count + 1, total - count))
    return low, high
