"""The speed verdict: a paired speedup's interval, the sequential rule that stops repeating as
soon as it is decided, and the family-wise correction of a recommendation among k variants.

Each repeat r gives one ratio: the variant's output throughput over the baseline's run of the
same prompts in the same repeat. The interval is Student's t on the log ratios (the ratios of a
repeat multiply, so their logs add; t is exact for normal log ratios at any n >= 2). Repeats
are looked at after each one from ``min_repeats`` to ``max_repeats`` (the looks); at each look
the interval is taken at a one-sided level that spends part of ``ALPHA``: a quarter at the first
look (a clear case is decided in two repeats), half over the looks between (one common level),
a quarter at the last. The levels are those that spend exactly those shares for normal log
ratios, found once per schedule by a seeded simulation (the t statistic's null law does not
depend on the noise's size): successive looks share most of their data, so the common level is
~3x what a Bonferroni split of the same half gives (0.44% against 0.15% over looks 3-19 of 20),
and a speedup is decided in about three quarters of the repeats, for the same power at the
cap. Stopping at the first decisive look cannot raise the error rate above ``ALPHA``; ``make
calibrate`` measures it, on noise that is not normal too. A look decides:

- faster: the interval's low end is above 1 (a false "faster" at most ``ALPHA`` = 5%);
- slower: its high end is below 1;
- within +-5%: the whole interval lies within [0.95, 1.05];
- otherwise repeats go on; at ``max_repeats`` it is inconclusive at that n.

A recommendation among k variants is family-wise: Holm's step-down over the variants'
sequential p-values for "faster", so that the chance of recommending any variant when none is
faster stays at ``ALPHA`` whatever k is.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

from pipeline.core.shares import t_quantile

ALPHA = 0.05  # one-sided: a false "faster" (and a false "slower") per variant
EQUIVALENCE = 0.05  # "within +-5%" of the baseline's speed
# ALPHA spent: a quarter at the first look (a clear case is decided in two repeats), half over
# the looks between (one common level, _boundary), a quarter at the last
FIRST_SHARE, MIDDLE_SHARE = 0.25, 0.5
# the boundary's simulation: null sequences of normal log ratios, seeded (the same boundary in
# every process), and the overall levels the p-values are read back on (_p_faster)
SIMULATIONS, SEED = 200_000, 20261203
_GRID = np.geomspace(1e-4, 1.0, 241)
FASTER, SLOWER, SAME, INCONCLUSIVE = "faster", "slower", "within +-5%", "inconclusive"
METHOD = "t on log ratios, sequential"


@dataclass(frozen=True)
class Looks:
    """When the interval is looked at: after each repeat from ``first`` to ``last``."""

    first: int
    last: int

    @classmethod
    def of(cls, min_repeats: int, max_repeats: int) -> Looks:
        first = max(2, min_repeats)  # one ratio has no spread: no interval
        return cls(first, max(first, max_repeats))

    @property
    def count(self) -> int:
        return self.last - self.first + 1

    def level(self, n: int, alpha: float = ALPHA) -> float:
        """The one-sided level of the interval at the look after repeat ``n``."""
        if self.count == 1:
            return alpha
        if n <= self.first:
            return alpha * FIRST_SHARE
        middle, last = _boundary(self.first, self.last, alpha)
        return last if n >= self.last else middle


def _t_pvalues(x: np.ndarray, first: int) -> np.ndarray:
    """One-sided t p-values of "mean > 0" for each row of ``x`` at every look from ``first``
    (columns: looks ``first`` .. ``x.shape[-1]``)."""
    k = np.arange(first, x.shape[-1] + 1)
    sums, squares = np.cumsum(x, axis=-1)[..., k - 1], np.cumsum(x * x, axis=-1)[..., k - 1]
    mean = sums / k
    var = np.maximum(squares - k * mean * mean, 0.0) / (k - 1)
    se = np.sqrt(var / k)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(se > 0, stats.t.sf(mean / np.where(se > 0, se, 1.0), k - 1),
                        np.where(mean > 0, 0.0, 1.0))


@functools.lru_cache(maxsize=16)
def _null(first: int, last: int) -> dict[str, np.ndarray]:
    """Simulated null sequences: each one's p-value at the first look, the smallest over the
    looks between, and at the last look; with the orders that sort the latter two."""
    x = np.random.default_rng(SEED).standard_normal((SIMULATIONS, last))
    p = _t_pvalues(x, first)
    middle = p[:, 1:-1].min(axis=1) if p.shape[1] > 2 else np.ones(len(p))
    return {"first": p[:, 0], "middle": middle, "last": p[:, -1],
            "by_middle": np.argsort(middle), "by_last": np.argsort(p[:, -1])}


def _largest_within(values: np.ndarray, order: np.ndarray, eligible: np.ndarray,
                    budget: float) -> float:
    """The largest level c such that at most ``budget`` (a share of the simulations) of the
    eligible sequences have ``values <= c``."""
    allowed = int(budget * SIMULATIONS)
    counted = np.cumsum(eligible[order])
    at = int(np.searchsorted(counted, allowed + 1))  # the first sequence over the budget
    return float(np.nextafter(values[order][at], 0.0)) if at < len(order) else 1.0


@functools.lru_cache(maxsize=4096)
def _boundary(first: int, last: int, alpha: float) -> tuple[float, float]:
    """(the common level of the looks between the first and the last, the last look's) such
    that under the null P(crossed at the first look) = FIRST_SHARE x alpha, P(first crossed
    between) = MIDDLE_SHARE x alpha and P(first crossed at the last) = the rest. Never below a
    Bonferroni split of the same shares, which is valid whatever the simulation says."""
    null = _null(first, last)
    between = last - first - 1
    middle_share = MIDDLE_SHARE if between else 0.0
    last_share = 1 - FIRST_SHARE - middle_share
    open_ = null["first"] > alpha * FIRST_SHARE
    middle = 0.0
    if between:
        middle = max(alpha * middle_share / between,
                     _largest_within(null["middle"], null["by_middle"], open_,
                                     alpha * middle_share))
        open_ = open_ & (null["middle"] > middle)
    end = max(alpha * last_share,
              _largest_within(null["last"], null["by_last"], open_, alpha * last_share))
    return middle, end


@functools.lru_cache(maxsize=16)
def _grid(first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    """The boundary at every overall level of _GRID, both levels made non-decreasing in it
    (lowered where a larger level's is lower: only more conservative), so that "crossed at
    level a" grows with a and the smallest such a is a valid p-value."""
    pairs = np.array([_boundary(first, last, float(a)) for a in _GRID])
    rising = np.minimum.accumulate(pairs[::-1], axis=0)[::-1]
    return rising[:, 0], rising[:, 1]


@dataclass(frozen=True)
class Speedup:
    """A variant's speedup at one load point, and what it says."""

    point: float  # the geometric mean of the per-repeat ratios
    low: float | None  # the interval at the look that decided (or the last); None: n < 2
    high: float | None
    n: int  # repeats used
    level: float  # two-sided confidence of that interval
    verdict: str
    p_faster: float  # sequential one-sided p-value of "faster"
    method: str = METHOD

    def as_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        """``1.08x [1.03, 1.13], n=5``."""
        if self.low is None or self.high is None:
            return f"{self.point:.2f}x (n={self.n}, no interval)"
        return f"{self.point:.2f}x [{self.low:.2f}, {self.high:.2f}], n={self.n}"


def verdict_of(low: float | None, high: float | None) -> str:
    """The verdict an interval gives: the one rule, for the loop and for every report."""
    if low is None or high is None:
        return INCONCLUSIVE
    if low > 1:
        return FASTER
    if high < 1:
        return SLOWER
    if low >= 1 - EQUIVALENCE and high <= 1 + EQUIVALENCE:
        return SAME
    return INCONCLUSIVE


def _look(logs: Sequence[float], alpha: float) -> tuple[float, float]:
    """(low, high) of the mean log ratio at one-sided ``alpha`` (its p-values: _p_faster)."""
    n = len(logs)
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    se = sd / math.sqrt(n)
    if se == 0:  # identical ratios: as sure as it gets
        return mean, mean
    half = t_quantile(1 - alpha, n - 1) * se
    return mean - half, mean + half


def _p_faster(logs: Sequence[float], looks: Looks) -> float:
    """The sequential p-value of "faster": the smallest overall level (on a grid, rounded up)
    whose boundary the looks so far have crossed, at most 1."""
    p = _t_pvalues(np.asarray(logs, dtype=float), looks.first)
    if looks.count == 1:
        return float(min(1.0, p[-1]))
    found = p[0] / FIRST_SHARE
    middle, end = _grid(looks.first, looks.last)
    crossed = np.zeros(len(_GRID), dtype=bool)
    between = p[1:looks.count - 1]
    if len(between):
        crossed |= middle >= between.min()
    if len(p) == looks.count:
        crossed |= end >= p[-1]
    if crossed.any():
        found = min(found, float(_GRID[int(np.argmax(crossed))]))
    return float(min(1.0, found))


def speedup(ratios: Sequence[float], looks: Looks, alpha: float = ALPHA) -> Speedup:
    """The verdict on the ratios in repeat order, at the last look they reach (the measurement
    loop stops at the first look that settles it, so that is the look reported); the
    p-value of "faster" is over every look so far (valid however the loop chose to stop)."""
    if not ratios or any(r <= 0 for r in ratios):
        raise ValueError(f"speedup ratios must be positive, got {list(ratios)}")
    logs = [math.log(r) for r in ratios]
    n = min(len(logs), looks.last)
    if n < looks.first:
        return Speedup(math.exp(sum(logs) / len(logs)), None, None, len(logs), 0.0,
                       INCONCLUSIVE, 1.0)
    p_faster = _p_faster(logs[:n], looks)
    spend = looks.level(n, alpha)
    low, high = _look(logs[:n], spend)
    low, high = math.exp(low), math.exp(high)
    return Speedup(math.exp(sum(logs[:n]) / n), low, high, n, 1 - 2 * spend,
                   verdict_of(low, high), p_faster)


def decided(ratios: Sequence[float], looks: Looks) -> bool:
    """Whether the measurement may stop: decided, or at the last look."""
    if len(ratios) >= looks.last:
        return True
    return len(ratios) >= looks.first and speedup(ratios, looks).verdict != INCONCLUSIVE


def undecided(ratios: Mapping[str, Sequence[float]], looks: Looks) -> list[str]:
    """The variants (of one load point, each with its ratios so far) that need another repeat:
    not yet decided, or "faster" but not yet after Holm's correction over all of them (a
    recommendation needs the family's evidence, so the loop gathers it). Every p-value stays
    valid however long a variant runs: it is a bound over all the looks up to the cap."""
    found = {name: speedup(r, looks) for name, r in ratios.items() if len(r) >= looks.first}
    family = holm({name: s.p_faster for name, s in found.items()})
    out = []
    for name, r in ratios.items():
        if len(r) >= looks.last:
            continue
        verdict = found[name].verdict if name in found else INCONCLUSIVE
        if verdict == INCONCLUSIVE or (verdict == FASTER and name not in family):
            out.append(name)
    return out


def holm(p_values: Mapping[str, float], alpha: float = ALPHA) -> set[str]:
    """The names whose "faster" survives Holm's step-down at family-wise ``alpha``."""
    passed: set[str] = set()
    ordered = sorted(p_values.items(), key=lambda item: item[1])
    for i, (name, p) in enumerate(ordered):
        if p > alpha / (len(ordered) - i):
            break
        passed.add(name)
    return passed
