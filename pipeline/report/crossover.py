"""Where a variant's speedup crosses 1: the load at which quantization stops (or starts) paying.

Weight-only formats typically win at low concurrency, where decoding is bound by reading the
weights, and lose at high concurrency, where the engine is compute-bound and dequantization is
extra work. Read from one sweep's paired speedups (median of the per-repeat ratios per load
point); the crossing is interpolated linearly in log concurrency between the two points whose
medians lie either side of 1.
"""

from __future__ import annotations

import itertools

from pipeline.core.tracking import SPEEDUP


def crossings(sweep: dict[int, dict[str, float]]) -> list[float]:
    """The loads at which the median speedup crosses 1, in order."""
    points = [(c, st[SPEEDUP]) for c, st in sorted(sweep.items()) if SPEEDUP in st]
    found = []
    for (c1, s1), (c2, s2) in itertools.pairwise(points):
        if (s1 > 1) != (s2 > 1) and s1 != s2:
            share = (s1 - 1) / (s1 - s2)
            found.append(c1 * (c2 / c1) ** share)
    return found


def sentence(sweep: dict[int, dict[str, float]]) -> str:
    """One sentence: faster or slower than the baseline, and up to which load ("" unmeasured)."""
    points = [(c, st) for c, st in sorted(sweep.items()) if SPEEDUP in st]
    if not points:
        return ""
    measured = ", ".join(f"{st[SPEEDUP]:.2f}x at {c}" for c, st in points)
    first = "faster" if points[0][1][SPEEDUP] > 1 else "slower"
    other = "slower" if first == "faster" else "faster"
    found = crossings(sweep)
    if not found:
        loads = f"concurrency {points[0][0]}" + (f"-{points[-1][0]}" if len(points) > 1 else "")
        text = f"{first} than the baseline at every load measured ({loads}: {measured})"
    else:
        text = (f"{first} than the baseline up to about {found[0]:.1f} concurrent requests, "
                f"{other} beyond ({measured})")
        if len(found) > 1:
            text += f"; it crosses 1 {len(found)} times"
    unclear = [str(c) for c, st in points
               if st.get(f"{SPEEDUP}_min", 0) <= 1 <= st.get(f"{SPEEDUP}_max", 0)]
    if unclear:
        text += (f"; at concurrency {', '.join(unclear)} its repeats straddle 1 (not shown "
                 "either way)")
    return text
