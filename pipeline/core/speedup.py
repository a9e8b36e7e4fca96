"""The speed verdict: a paired speedup's interval, the sequential rule that stops repeating as
soon as it is decided, and the family-wise correction of a recommendation among k variants.

Each repeat r gives one ratio: the variant's output throughput over the baseline's run of the
same prompts in the same repeat. The interval is Student's t on the log ratios (the ratios of a
repeat multiply, so their logs add; t is exact for normal log ratios at any n >= 2). Repeats
are looked at after each one from ``min_repeats`` to ``max_repeats`` (the looks); at each look
the interval is taken at a level that spends a share of ``ALPHA``: half of it spread evenly
over the early looks, half at the last one (a weighted Bonferroni split, so stopping at the
first decisive look cannot raise the error rate above ``ALPHA``; ``make calibrate`` measures
it). A look decides:

- faster: the interval's low end is above 1 (a false "faster" at most ``ALPHA`` = 5%);
- slower: its high end is below 1;
- within +-5%: the whole interval lies within [0.95, 1.05];
- otherwise repeats go on; at ``max_repeats`` it is inconclusive at that n.

A recommendation among k variants is family-wise: Holm's step-down over the variants'
sequential p-values for "faster", so that the chance of recommending any variant when none is
faster stays at ``ALPHA`` whatever k is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

from pipeline.core.shares import t_quantile

ALPHA = 0.05  # one-sided: a false "faster" (and a false "slower") per variant
EQUIVALENCE = 0.05  # "within +-5%" of the baseline's speed
# ALPHA spent per look: a quarter at the first (a clear case is decided in two repeats), half at
# the last (the most data), the rest evenly over those between
FIRST_SHARE, LAST_SHARE = 0.25, 0.5
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

    def share(self, n: int) -> float:
        """The share of ALPHA spent at the look after repeat ``n`` (the shares sum to 1)."""
        if self.count == 1:
            return 1.0
        if self.count == 2:
            return LAST_SHARE if n == self.last else 1 - LAST_SHARE
        if n == self.first:
            return FIRST_SHARE
        if n == self.last:
            return LAST_SHARE
        return (1 - FIRST_SHARE - LAST_SHARE) / (self.count - 2)


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
    """The sequential p-value of "faster": at each look k from ``looks.first``, the one-sided t
    p-value of the first k log ratios over its share of ALPHA; the smallest (at most 1). All
    looks in one vectorised call (the calibration draws make millions)."""
    x = np.asarray(logs, dtype=float)
    k = np.arange(looks.first, len(x) + 1)
    sums, squares = np.cumsum(x)[k - 1], np.cumsum(x * x)[k - 1]
    mean = sums / k
    var = np.maximum(squares - k * mean * mean, 0.0) / (k - 1)
    se = np.sqrt(var / k)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(se > 0, stats.t.sf(mean / np.where(se > 0, se, 1.0), k - 1),
                     np.where(mean > 0, 0.0, 1.0))
    shares = np.array([looks.share(int(j)) for j in k])
    return float(min(1.0, np.min(p / shares)))


def speedup(ratios: Sequence[float], looks: Looks, alpha: float = ALPHA) -> Speedup:
    """The verdict on the ratios in repeat order, at the last look they reach (the measurement
    loop stops at the first look that settles it, so that is the look reported); the
    p-value of "faster" is the smallest over every look so far, each over its share of
    ``alpha`` (valid however the loop chose to stop)."""
    if not ratios or any(r <= 0 for r in ratios):
        raise ValueError(f"speedup ratios must be positive, got {list(ratios)}")
    logs = [math.log(r) for r in ratios]
    n = min(len(logs), looks.last)
    if n < looks.first:
        return Speedup(math.exp(sum(logs) / len(logs)), None, None, len(logs), 0.0,
                       INCONCLUSIVE, 1.0)
    p_faster = _p_faster(logs[:n], looks)
    spend = alpha * looks.share(n)
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
