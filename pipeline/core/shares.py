"""Exact bounds on a share of independent trials (Clopper-Pearson), for every verdict that
rests on a count: the gate's losses, a load point's SLO attainment; Student's t quantile
(both cached: the calibration's draws ask the same few thousand of them millions of times);
and the log-odds scale on which a load point's runs are pooled."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import stats

# Gauss-Hermite (probabilists') nodes and weights: the mean of a logit-normal share
_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(20)
_WEIGHTS = _WEIGHTS / _WEIGHTS.sum()


@lru_cache(maxsize=4096)
def t_quantile(q: float, df: int) -> float:
    """Student's t quantile ``q`` at ``df`` degrees of freedom."""
    return float(stats.t.ppf(q, df))


def logit(good: int, total: int) -> float:
    """The log-odds of ``good`` of ``total``, half a count added to each side (finite at 0
    and at ``total``)."""
    return math.log((good + 0.5) / (total - good + 0.5))


def logit_normal_mean(mu: float, sd: float) -> float:
    """The mean share of runs whose log-odds are normal(``mu``, ``sd``)."""
    return float(np.sum(_WEIGHTS / (1 + np.exp(-(mu + sd * _NODES)))))


@lru_cache(maxsize=65536)
def share_bounds(count: int, total: int, alpha: float) -> tuple[float, float]:
    """Clopper-Pearson's one-sided lower and upper bounds of a share, each at ``alpha``: the
    lower lies below the true share, the upper above it, each with probability >= 1 - alpha."""
    if total <= 0:
        return 0.0, 0.0
    low = 0.0 if count <= 0 else float(stats.beta.ppf(alpha, count, total - count + 1))
    high = 1.0 if count >= total else float(stats.beta.ppf(1 - alpha, count + 1, total - count))
    return low, high
