"""Which loads a capacity search's runs show to meet, or to miss, a share of requests within
an objective, when runs of one load differ by more than their requests' binomial noise.

A run's share varies with the machine's state (on the 2-core CPU one run at a load kept 32 of
32 requests within the objective, the next 16 of 32), and that spread makes the share of a few
runs skewed: several runs near 100% and the odd low one. A t bound on four runs' shares reads
four high runs as proof (simulated at a run spread of 2 log-odds: a load whose long-run share
was 86% was "shown" to meet 90% in a quarter of the searches). So each run's requests are
binomial at its own log-odds ``mu[load] + sigma z``, ``z`` standard normal per run (a random
run effect; one ``sigma`` for the machine, estimated from every load's runs); the share at a
load is the long-run average over runs, ``E[expit(mu + sigma z)]`` (what a fleet sees); and a
load is shown to meet (or miss) the target where the profile likelihood-ratio test of "its
long-run share is the target" rejects on that side at ``alpha``, ``sigma`` and the other
loads' ``mu`` free.

The marginal likelihood is integrated on a fixed grid of log-odds (a run's binomial
likelihood there, convolved with the run effect's normal density): exact to the grid's step
however peaked a run's likelihood is, where Gauss-Hermite nodes in ``z`` are too coarse once
``sigma`` x a run's precision is large. ``mu`` and ``sigma`` are profiled on grids, ``mu``'s
maximum refined by a parabola through the three grid values about it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist

import numpy as np
from threadpoolctl import threadpool_limits

STEP = 0.1  # the log-odds grid's step
CAP = 12.0  # |mu| at most: a load whose runs are all perfect (or all missed) sits at the cap
SIGMAS = np.arange(0.0, 4.0 + 1e-9, 0.25)  # the run effect's sd (log-odds), profiled on these
_ETA = np.arange(-CAP - 4 * SIGMAS[-1], CAP + 4 * SIGMAS[-1] + STEP / 2, STEP)  # integrated on
_MU = np.flatnonzero(np.abs(_ETA) <= CAP + 1e-9)  # the grid points mu may take
_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(48)
_WEIGHTS = _WEIGHTS / _WEIGHTS.sum()


def _normal(mu: np.ndarray, sigma: float) -> np.ndarray:
    """(grid, len(mu)): the run effect's density about each ``mu`` on the grid, each column
    summing to 1 (a point mass at ``sigma`` 0)."""
    if sigma == 0:
        out = np.zeros((len(_ETA), len(mu)))
        out[np.clip(np.rint((mu - _ETA[0]) / STEP).astype(int), 0, len(_ETA) - 1),
            np.arange(len(mu))] = 1.0
        return out
    density = np.exp(-0.5 * ((_ETA[:, None] - mu[None, :]) / sigma) ** 2)
    return density / density.sum(axis=0, keepdims=True)


@functools.cache
def _kernels() -> tuple[np.ndarray, ...]:
    """Per grid ``sigma``, the density about every grid ``mu`` (built once)."""
    return tuple(_normal(_ETA[_MU], float(s)) for s in SIGMAS)


def mu_at(target: float) -> np.ndarray:
    """At each grid ``sigma``, the ``mu`` whose long-run average share is ``target``."""
    mu = np.full(len(SIGMAS), math.log(target / (1 - target)))
    for _ in range(60):
        p = 1 / (1 + np.exp(-(mu[:, None] + SIGMAS[:, None] * _NODES[None, :])))
        gap = (p * _WEIGHTS).sum(axis=1) - target
        mu = mu - gap / np.maximum((p * (1 - p) * _WEIGHTS).sum(axis=1), 1e-12)
        if float(np.max(np.abs(gap))) < 1e-10:
            break
    return mu


def _peak(values: np.ndarray) -> np.ndarray:
    """The maximum over the last axis, refined by a parabola through the grid's three values
    about it (the log-likelihood is smooth in ``mu``)."""
    j = values.argmax(axis=-1)
    inner = np.clip(j, 1, values.shape[-1] - 2)
    y0, y1, y2 = (np.take_along_axis(values, (inner + d)[..., None], -1)[..., 0]
                  for d in (-1, 0, 1))
    curve = y0 - 2 * y1 + y2
    vertex = y1 - (y0 - y2) ** 2 / np.minimum(8 * curve, -1e-12)
    top = values.max(axis=-1)
    return np.where((j == inner) & (curve < 0), np.maximum(vertex, top), top)


def shown(runs: Mapping[int, Sequence[tuple[int, int]]], target: float, alpha: float
          ) -> tuple[dict[int, int], float]:
    """For each load of ``runs`` (load -> [(within, counted) per run]): +1 where its runs show
    its long-run share at or above ``target``, -1 where they show it below, 0 where they show
    neither, each one-sided at ``alpha``; and the run effect's estimated sd (log-odds). Every
    load's runs inform ``sigma``."""
    # one BLAS thread: the products are small, and threads beside a busy core only contend
    # (20x slower measured on the 2-core CPU with a search running beside)
    with threadpool_limits(1, user_api="blas"):
        return _shown(runs, target, alpha)


def _shown(runs: Mapping[int, Sequence[tuple[int, int]]], target: float, alpha: float
           ) -> tuple[dict[int, int], float]:
    names = sorted(c for c, rs in runs.items() if any(n for _, n in rs))
    if not names:
        return {}, 0.0
    rows = [(i, g, n) for i, c in enumerate(names) for g, n in runs[c] if n]
    of_load = np.zeros((len(rows), len(names)))
    of_load[np.arange(len(rows)), [r[0] for r in rows]] = 1.0
    good = np.array([r[1] for r in rows], dtype=float)[:, None]
    counted = np.array([r[2] for r in rows], dtype=float)[:, None]
    # each run's binomial log-likelihood on the grid, shifted so its largest value is 0
    log_f = good * _ETA - counted * np.logaddexp(0.0, _ETA)
    shift = log_f.max(axis=1, keepdims=True)
    f = np.exp(log_f - shift)
    null_mu = mu_at(target)
    own = np.empty((len(SIGMAS), len(names)))  # each load's log-likelihood, its mu at best
    null = np.empty_like(own)  # ... with its long-run share at the target
    above = np.empty_like(own, dtype=bool)
    for s, (sigma, kernel) in enumerate(zip(SIGMAS, _kernels(), strict=True)):
        per_run = np.log(np.maximum(f @ kernel, 1e-300)) + shift  # (runs, grid mu)
        per_load = of_load.T @ per_run  # (loads, grid mu)
        own[s] = _peak(per_load)
        at_null = np.log(np.maximum(f @ _normal(null_mu[s:s + 1], float(sigma)), 1e-300))
        null[s] = of_load.T @ (at_null + shift)[:, 0]
        above[s] = _ETA[_MU][per_load.argmax(axis=1)] >= null_mu[s]
    profile = own.sum(axis=1)
    best = int(np.argmax(profile))
    critical = NormalDist().inv_cdf(1 - alpha)
    out: dict[int, int] = {}
    for i, c in enumerate(names):
        constrained = profile - own[:, i] + null[:, i]
        ratio = max(0.0, 2 * float(profile[best] - constrained.max()))
        shown_ = math.sqrt(ratio) >= critical
        out[c] = (1 if above[best, i] else -1) if shown_ else 0
    return out, float(SIGMAS[best])
