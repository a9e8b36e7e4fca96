"""The knee of an attainment curve: the load at which the share of requests within a latency
objective falls to its target, estimated from a capacity search's runs, with an interval.

Near the knee the share's log-odds falls about linearly with load. Each run counts requests
within the objective out of those it sent (binomial), and runs of one load differ beyond that
(the machine's state: on the 2-core CPU one run at a load kept 100% while the next kept 50%).
So the fit is a quasi-binomial logistic regression of the runs' counts on load (iteratively
reweighted least squares): its variance is the binomial one times a dispersion, estimated
from the runs' Pearson residuals and never below 1. Binomial noise is counted once, in the
model's own variance; the dispersion is what runs add to it. Each run weighs by its requests;
a search's short pilot runs are not given to it. What it estimates is the share over runs, a
fleet's long-run share at that load (population-averaged), not one run's.

The knee is where the fitted share equals the target; its interval is Fieller's for that ratio
of estimates (a slope near zero makes it wide, or unbounded, rather than wrong), with Student's
t at the runs' degrees of freedom, kept with the fit. Over the two loads a search fits it
on, that interval is open more often than not at four runs a load, so the capacity's interval
is not this one but what each load's runs show (:mod:`pipeline.bench.run_effects`, used by
:mod:`pipeline.bench.slo`); ``make calibrate`` measures its coverage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.core.shares import t_quantile

LEVEL = 0.90  # the knee's interval: two-sided, 5% each side


@dataclass(frozen=True)
class KneeFit:
    """The fitted curve (log-odds ``intercept + slope x (load - centre)``), the load at which it
    crosses the target, and that load's interval (None: unbounded on that side)."""

    knee: float
    low: float | None
    high: float | None
    intercept: float
    slope: float
    centre: float
    dispersion: float
    runs: int
    level: float = LEVEL

    def attainment(self, load: float) -> float:
        """The fitted share of requests within the objective at ``load``."""
        return 1 / (1 + math.exp(-(self.intercept + self.slope * (load - self.centre))))

    def as_dict(self) -> dict[str, float | int | None]:
        return {"knee": self.knee, "low": self.low, "high": self.high,
                "intercept": self.intercept, "slope": self.slope, "centre": self.centre,
                "dispersion": self.dispersion, "runs": self.runs, "level": self.level}


def _irls(x: np.ndarray, good: np.ndarray, counted: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Logistic regression of ``good`` of ``counted`` on ``x``: coefficients, their unscaled
    covariance, and the fitted shares."""
    design = np.column_stack([np.ones_like(x), x])
    share = (good.sum() + 0.5) / (counted.sum() + 1)
    beta = np.array([math.log(share / (1 - share)), 0.0])
    for _ in range(50):
        eta = np.clip(design @ beta, -30, 30)
        p = 1 / (1 + np.exp(-eta))
        weight = counted * p * (1 - p) + 1e-9
        working = eta + (good - counted * p) / weight
        info = (design.T * weight) @ design + 1e-9 * np.eye(2)
        new = np.clip(np.linalg.solve(info, (design.T * weight) @ working), -50, 50)
        done = float(np.max(np.abs(new - beta))) < 1e-9
        beta = new
        if done:
            break
    p = 1 / (1 + np.exp(-np.clip(design @ beta, -30, 30)))
    weight = counted * p * (1 - p) + 1e-9
    return beta, np.linalg.inv((design.T * weight) @ design + 1e-9 * np.eye(2)), p


def _fieller(a: float, b: float, cov: np.ndarray, target_logit: float, q: float
             ) -> tuple[float | None, float | None]:
    """The x with ``(a + b x - L)^2 <= q^2 Var(a + b x)``: a bounded interval where the slope
    is shown to fall at this level, else unbounded (None, None)."""
    qa = b * b - q * q * cov[1, 1]
    qb = 2 * ((a - target_logit) * b - q * q * cov[0, 1])
    qc = (a - target_logit) ** 2 - q * q * cov[0, 0]
    disc = qb * qb - 4 * qa * qc
    if qa <= 0 or disc < 0:
        return None, None
    root = math.sqrt(disc)
    return (-qb - root) / (2 * qa), (-qb + root) / (2 * qa)


def fit(loads: Sequence[float], good: Sequence[int], counted: Sequence[int], target: float,
        level: float = LEVEL) -> KneeFit | None:
    """The knee from runs at ``loads`` (one entry per run); None where the fitted share does
    not fall with load (no knee in these runs) or fewer than two loads were run."""
    x, g, n = (np.asarray(v, dtype=float) for v in (loads, good, counted))
    if len(set(x.tolist())) < 2 or len(x) < 3 or float(n.sum()) <= 0:
        return None
    centre = float(np.average(x, weights=n))
    beta, unscaled, p = _irls(x - centre, g, n)
    a, b = float(beta[0]), float(beta[1])
    if b >= 0:
        return None
    runs = len(x)
    pearson = float(np.sum((g - n * p) ** 2 / np.maximum(n * p * (1 - p), 1e-9)))
    dispersion = max(1.0, pearson / max(1, runs - 2))
    target_logit = math.log(target / (1 - target))
    q = t_quantile(0.5 + level / 2, max(1, runs - 2))
    low, high = _fieller(a, b, dispersion * unscaled, target_logit, q)
    return KneeFit(knee=centre + (target_logit - a) / b,
                   low=None if low is None else centre + low,
                   high=None if high is None else centre + high,
                   intercept=a, slope=b, centre=centre, dispersion=dispersion, runs=runs,
                   level=level)
