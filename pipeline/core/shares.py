"""Exact bounds on a share of independent trials (Clopper-Pearson), for every verdict that
rests on a count: the gate's losses, a load point's SLO attainment."""

from __future__ import annotations

from scipy import stats


def share_bounds(count: int, total: int, alpha: float) -> tuple[float, float]:
    """Clopper-Pearson's one-sided lower and upper bounds of a share, each at ``alpha``: the
    lower lies below the true share, the upper above it, each with probability >= 1 - alpha."""
    if total <= 0:
        return 0.0, 0.0
    low = 0.0 if count <= 0 else float(stats.beta.ppf(alpha, count, total - count + 1))
    high = 1.0 if count >= total else float(stats.beta.ppf(1 - alpha, count + 1, total - count))
    return low, high
