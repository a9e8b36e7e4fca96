"""Where a variant's speedup crosses 1: the load at which quantization stops (or starts) paying.

Weight-only formats typically win at low concurrency, where decoding is bound by reading the
weights, and lose at high concurrency, where the engine is compute-bound and dequantization is
extra work. Read from one sweep's paired speedups and their verdicts per load point
(:mod:`pipeline.core.speedup`); a crossing is claimed only between two loads whose intervals
are decided either way, interpolated linearly in log concurrency between their estimates.
"""

from __future__ import annotations

import itertools

from pipeline.core.artifacts import PointFigures
from pipeline.core.speedup import FASTER, SLOWER


def crossings(sweep: dict[int, PointFigures]) -> list[float]:
    """The loads at which the median speedup crosses 1, in order."""
    points = [(c, at.speedup.point) for c, at in sorted(sweep.items()) if at.speedup]
    found = []
    for (c1, s1), (c2, s2) in itertools.pairwise(points):
        if (s1 > 1) != (s2 > 1) and s1 != s2:
            share = (s1 - 1) / (s1 - s2)
            found.append(c1 * (c2 / c1) ** share)
    return found


def sentence(sweep: dict[int, PointFigures]) -> str:
    """One sentence: each load's verdict (its interval, n), and where the speedup crosses 1
    between two loads decided either way ("" unmeasured). "At every load" is said only when
    every load's interval is decided the same way."""
    points = [(c, found) for c, at in sorted(sweep.items()) if (found := at.speedup)]
    if not points:
        return ""
    measured = "; ".join(f"{found.verdict} at {c} ({found.text()})" for c, found in points)
    verdicts = {found.verdict for _, found in points}
    loads = f"concurrency {points[0][0]}" + (f"-{points[-1][0]}" if len(points) > 1 else "")
    if len(verdicts) == 1 and verdicts <= {FASTER, SLOWER}:
        return f"{points[0][1].verdict} than the baseline at every load measured ({loads}: " \
               f"{measured})"
    decided = [(c, found) for c, found in points if found.verdict in (FASTER, SLOWER)]
    turns = [(a, b) for (a, fa), (b, fb) in itertools.pairwise(decided)
             if fa.verdict != fb.verdict]
    found = crossings({c: sweep[c] for c, _ in decided})
    if turns and found:
        first = decided[0][1].verdict
        return (f"{first} than the baseline up to about {found[0]:.1f} concurrent requests, "
                f"{SLOWER if first == FASTER else FASTER} beyond ({measured})")
    return f"not one verdict over {loads}: {measured}"
