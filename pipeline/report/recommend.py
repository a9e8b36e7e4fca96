"""The verdict: which variant to ship for an explicit objective, or none and why not."""

from __future__ import annotations

import math

from pipeline.core.artifacts import EMULATED, OBJECTIVES, Row
from pipeline.core.speedup import FASTER, INCONCLUSIVE, SAME, SLOWER, holm
from pipeline.core.variant import BASELINE
from pipeline.eval import gate
from pipeline.report import cost
from pipeline.report.cost import price_text

__all__ = ["OBJECTIVES", "OBJECTIVE_TEXT", "recommend"]
SPEED_BASIS = "geometric mean [interval], t on log ratios, sequential"
OBJECTIVE_TEXT = {
    "speed": "the fastest variant that passes its gate and is shown faster than the baseline "
             "(its speedup's interval above 1, and still so after Holm's correction over the "
             "variants that pass their gates)",
    "memory": "the variant with the smallest weights that passes its gate",
    "capacity": "the variant that holds the most concurrent requests at the plan target and "
                "passes its gate",
    "cost": "the variant with the lowest cost per million output tokens at the latency "
            "objective that passes its gate and is shown cheaper than the baseline (its cost "
            "range's dearest end below the baseline's cheapest); ranked by that dearest end",
}


def _suites_text(row: Row) -> str:
    return ", ".join(f"{s} {v.recovery_pct:.1f}% [{v.ci_low:.1f}, {v.ci_high:.1f}]"
                     for s, v in sorted(row.suites.items()) if v.recovery_pct is not None)


def speed_text(row: Row) -> str:
    """``1.08x [1.03, 1.13], n=5`` (the interval at the look that decided)."""
    found = row.headline.speedup
    return found.text() if found is not None else "not measured"


def compared(rows: list[Row]) -> dict[str, float]:
    """Each variant that passes its gate with a measured, comparable speedup: its one-sided
    p-value of "faster". A variant its gate rules out (on the scores, not on the speed
    figures) is never recommended, so it is no part of the family a chance "faster" could
    come from; the calibration's family-wise scenarios measure both cases."""
    return {r.name: found.p_faster for r in rows if r.name != BASELINE and r.comparable
            and r.gate_status == gate.PASS and (found := r.headline.speedup) is not None}


def _why_not(row: Row, objective: str, family: set[str], base: Row | None = None,
             n_compared: int = 0) -> str | None:
    """Why ``row`` cannot be recommended for ``objective``; None when it can."""
    if row.gate_status != gate.PASS:
        detail = f": {row.gate_reason}" if row.gate_reason else ""
        return f"gate {row.gate_status}{detail}"
    if row.serving == "failed":
        return f"passes its gate but failed while served ({row.serving_reason})"
    if row.serving != "ok" or row.speedup is None:
        why = row.serving_reason or "its speed was not measured (make bench)"
        return f"passes its gate but was not served here ({why})"
    if not row.comparable:
        return f"passes its gate but its speed is from another measurement ({row.measurement})"
    if objective == "cost" and (row.cost is None or (row.cost.at()[2] is None and
                                row.cost.usd_per_million_output_tokens is None)):
        why = ("its capacity is at another objective than the baseline's"
               if row.capacity is not None and row.capacity.other_objective else
               f"its capacity is {row.capacity.outcome}" if row.capacity is not None and
               row.capacity.undecided else
               "its capacity at the latency objective was not measured or is 0 (the capacity "
               "search: make all OBJECTIVE=cost runs it, or make bench WORKLOAD=capacity)")
        return f"passes its gate but has no cost figure: {why}"
    if objective == "cost":
        shown, why = cost.cheaper(row.cost, base.cost if base is not None else None)
        if not shown:
            verdict = "is not cheaper than the baseline" if shown is False else \
                "is not shown cheaper than the baseline"
            return f"passes its gate but {verdict}: {why}"
    found = row.headline.speedup
    if objective == "speed" and (found is None or found.verdict != FASTER):
        verdict = found.verdict if found is not None else INCONCLUSIVE
        what = {SLOWER: "is slower than the baseline",
                SAME: "is within 5% of the baseline's speed"}.get(
            verdict, "is not shown faster than the baseline (its interval holds 1: "
                     f"inconclusive at n = {found.n if found else 0})")
        return f"passes its gate but {what}: {speed_text(row)}"
    if objective == "speed" and row.name not in family:
        return (f"passes its gate and its interval is above 1 ({speed_text(row)}), but not "
                f"after Holm's correction over the {n_compared} variants that pass their gates "
                "(one of several shown faster by chance is likely): more repeats settle it")
    return None


def recommend(rows: list[Row], objective: str = "speed") -> tuple[str | None, str]:
    """The variant that best meets ``objective`` among those that pass their gate on every
    suite, were served here and were measured in the comparison's reference run; else why
    none does, variant by variant."""
    eligible, why_not = [], []
    p_values = compared(rows)
    # the family a recommendation is chosen from: "faster" surviving Holm's correction over
    # every variant that passes its gate with a measured, comparable speedup
    family = holm(p_values)
    base = next((r for r in rows if r.name == BASELINE), None)
    for row in rows:
        if row.name == BASELINE:
            continue
        why = _why_not(row, objective, family, base, len(p_values))
        if why is None:
            eligible.append(row)
        else:
            why_not.append(f"{row.name}: {why}")
    if not eligible:
        return None, (f"objective {objective} ({OBJECTIVE_TEXT[objective]}): no variant "
                      "qualifies: " + ("; ".join(why_not) if why_not else
                                       "no variant on disk (make quantize)"))
    if objective == "speed":  # the largest lower end: the speed it is shown to have at least
        best = max(eligible, key=lambda r: r.headline.speedup.low or 0.0
                   if r.headline.speedup else 0.0)
    elif objective == "memory":
        best = min(eligible, key=lambda r: r.weight_bytes)
    elif objective == "cost":  # the cost each is shown to stay under
        best = min(eligible, key=lambda r: r.cost.at()[2] or math.inf if r.cost else math.inf)
    else:
        best = max(eligible, key=lambda r: (r.plan.planned_max_concurrency_paged if r.plan else 0,
                                            -r.weight_bytes))
    reason = (f"{best.name} (objective {objective}: {OBJECTIVE_TEXT[objective]}): "
              f"{speed_text(best)} the baseline's throughput ({SPEED_BASIS}), "
              f"{best.weight_ratio:.2f}x its weight memory")
    if best.plan:
        reason += (f", {best.plan.planned_max_concurrency_paged:,} concurrent "
                   "requests planned")
    if best.cost and best.cost.at()[2] is not None and best.capacity:
        reason += (f", {cost.range_text(best.cost)} per million output tokens at "
                   f"{best.capacity.text()} concurrent requests within the latency "
                   f"objective (capacity measured; priced at {price_text(best.price)})")
    whose = ", the campaign's" if best.threshold_from == "campaign" else ""
    reason += f", recovery {_suites_text(best)} (threshold {best.threshold:g}%{whose})"
    if best.eval_backend == EMULATED:
        reason += " [accuracy emulated]"
    return best.name, reason
