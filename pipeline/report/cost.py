"""What a variant costs: per million output tokens at its capacity under the latency objective,
and the machines a target load needs.

Measured: the capacity (concurrency, requests/s, output tokens/s) at the objective on the
machine the speed was measured on, priced at that machine's hourly price. Planned: how many
requests the plan target's KV cache holds (:mod:`pipeline.plan.capacity`), a lower bound on the
devices a target number of users needs there (its speed at the objective is not measured).
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.core import tracking
from pipeline.core.artifacts import CostTarget, Row
from pipeline.plan import capacity

USD_PER_MTOK = "usd_per_million_output_tokens"


def per_million_tokens(price_per_hour: float, output_tokens_per_s: float) -> float:
    """USD per million output tokens for a machine at ``price_per_hour`` producing
    ``output_tokens_per_s`` for the whole hour."""
    return price_per_hour / (output_tokens_per_s * 3600) * 1e6


def figures(row: Row, price_per_hour: float, target: CostTarget) -> dict[str, Any]:
    """The cost figures of one row (empty when its capacity at the objective is unknown)."""
    cap = row.capacity
    if not cap or not cap.get(tracking.SLO_MAX_CONCURRENCY):
        return {}
    out: dict[str, Any] = {"price_per_hour": price_per_hour}
    tps = cap.get(tracking.SLO_OUTPUT_TOKENS_PER_S)
    if tps:
        out[USD_PER_MTOK] = per_million_tokens(price_per_hour, tps)
        # the slowest repeat costs the most
        for bound, src in (("_min", "_max"), ("_max", "_min")):
            if cap.get(tracking.SLO_OUTPUT_TOKENS_PER_S + src):
                out[USD_PER_MTOK + bound] = per_million_tokens(
                    price_per_hour, cap[tracking.SLO_OUTPUT_TOKENS_PER_S + src])
    users = cap[tracking.SLO_MAX_CONCURRENCY]
    if target.target_users:
        out["machines_for_target_users"] = math.ceil(target.target_users / users)
        planned = row.plan.get(capacity.MAX_CONCURRENCY_PAGED)
        if planned:
            out["planned_devices_for_target_users_kv"] = math.ceil(target.target_users / planned)
    rps = cap.get(tracking.SLO_REQUESTS_PER_S)
    if target.target_rps and rps:
        out["machines_for_target_rps"] = math.ceil(target.target_rps / rps)
    return out
