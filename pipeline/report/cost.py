"""What a variant costs: per million output tokens at its capacity under the latency objective,
and the machines a target load needs.

Measured: the capacity (concurrency, requests/s, output tokens/s) at the objective, priced at
the hourly price of the devices that bench run's server used (its own record: TP x PP GPUs, or
the host), not of the machine that runs the comparison. A price the user did not set is an
example figure and is called one. Planned: how many requests the plan target's KV cache holds
(:mod:`pipeline.plan.capacity`), a lower bound on the devices a target number of users needs
there (its speed at the objective is not measured).
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.core import hardware, tracking
from pipeline.core.artifacts import BenchSummary, CostTarget, Price, Row
from pipeline.plan.accelerators import detect as detect_accelerator
from pipeline.serve.settings import EngineSettings

USD_PER_MTOK = "usd_per_million_output_tokens"


def devices_of(summary: BenchSummary) -> dict[str, Any]:
    """The devices a bench run's servers used: its own record, or for a run recorded before
    runs kept one, its hardware profile with the engine's TP x PP (a MIG slice known only by
    its unreported memory)."""
    if summary.devices:
        return dict(summary.devices)
    engine = EngineSettings.from_record(summary.engine)
    return hardware.serving_devices(hardware.Profile.from_dict(summary.hardware, summary.target),
                                    engine.tensor_parallel_size, engine.pipeline_parallel_size,
                                    visible="")


def price_of(target: CostTarget, devices: dict[str, Any]) -> Price:
    """The hourly price of what one server used (``devices``), where it comes from, and
    whether it is an example figure (every price the user did not set)."""
    if target.price_per_hour is not None:
        return Price(price_per_hour=target.price_per_hour, example=False,
                     source="PRICE_PER_HOUR / the campaign's cost.price_per_hour")
    if devices.get("unit") == "gpu":
        # a slice is priced as its card (the memory it reports is the slice's)
        memory = None if devices.get("mig") else devices.get("memory_mib")
        kind = str(devices.get("kind", ""))
        preset = detect_accelerator(kind, memory, exact=False)
        if preset is not None and preset.price_per_hour:
            count = int(devices.get("count") or 1)
            exact = devices.get("mig") or detect_accelerator(kind, memory) is not None
            slice_note = (": a MIG slice, priced as the whole GPU" if devices.get("mig") else
                          "" if exact else f": {kind} has no preset, priced as the nearest")
            return Price(price_per_hour=preset.price_per_hour * count, example=True,
                         source=f"{count} x {preset.name}'s example price_per_hour "
                                f"(configs/accelerators{slice_note}; TP x PP GPUs per server; "
                                "set yours: PRICE_PER_HOUR=)")
    host = devices.get("kind", "host")
    return Price(price_per_hour=target.host_price_per_hour, example=True,
                 source=f"the campaign's cost.host_price_per_hour for one {host} (an example "
                        "figure, set yours: PRICE_PER_HOUR=)")


def price_basis(priced: Price | None) -> str:
    """``example`` (a price the user did not set), ``set``, or "" where there is no price."""
    return priced.basis if priced is not None else ""


def price_text(priced: Price | None) -> str:
    """``$0.1/h example price`` or ``$7/h``: a price never shown without saying whose."""
    if priced is None:
        return "no price"
    return f"${priced.price_per_hour:g}/h" + (" example price" if priced.example else "")


def per_million_tokens(price_per_hour: float, output_tokens_per_s: float) -> float:
    """USD per million output tokens for a machine at ``price_per_hour`` producing
    ``output_tokens_per_s`` for the whole hour."""
    return price_per_hour / (output_tokens_per_s * 3600) * 1e6


def _priced(cap: dict[str, Any], price_per_hour: float, prefix: str = "") -> dict[str, Any]:
    """The cost at one search's capacity (``prefix``: ``rate_`` for a rate search's): at the
    median throughput there, the dearest end from its slowest run, the cheapest from the fastest
    run at the first level shown to miss; a censored search gives only the dearest end, an
    upper bound (``cost_bound: upper``)."""
    tps = cap.get(tracking.SLO_OUTPUT_TOKENS_PER_S)
    if not tps:
        return {}
    key = prefix + USD_PER_MTOK
    out: dict[str, Any] = {key: per_million_tokens(price_per_hour, tps)}
    slowest = cap.get(tracking.SLO_OUTPUT_TOKENS_PER_S + "_min") or tps
    out[key + "_max"] = per_million_tokens(price_per_hour, slowest)
    if cap.get("censored"):
        out[prefix + "cost_bound"] = "upper"
    else:
        fastest = cap.get(tracking.SLO_OUTPUT_TOKENS_PER_S + "_at_first_miss") or cap.get(
            tracking.SLO_OUTPUT_TOKENS_PER_S + "_max") or tps
        out[key + "_min"] = per_million_tokens(price_per_hour, max(fastest, tps))
    return out


def figures(row: Row, price_per_hour: float, target: CostTarget) -> dict[str, Any]:
    """The cost figures of one row (empty when it has no capacity at the objective).

    The cost at the capacity (the largest load shown to meet the objective) and its range
    (:func:`_priced`), from the concurrency search and, prefixed ``rate_``, from the arrival-rate
    search; the machines a target load needs: users from the concurrency search, requests/s
    from the rate search where there is one (open-loop arrivals, what a fleet is sized by),
    else from the concurrency search's requests/s (closed loop), said in ``rps_from``. A
    censored capacity's cost is an upper bound, never ranked as exact."""
    cap, rate = row.capacity, row.rate_capacity
    users = cap.get(tracking.SLO_MAX_CONCURRENCY) if cap else 0
    max_rate = rate.get(tracking.SLO_MAX_REQUEST_RATE) if rate else 0.0
    if not users and not max_rate:
        return {}
    out: dict[str, Any] = {"price_per_hour": price_per_hour}
    if users:
        out.update(_priced(cap, price_per_hour))
    if max_rate:
        out.update(_priced(rate, price_per_hour, "rate_"))
    if target.target_users and users:
        out["machines_for_target_users"] = math.ceil(target.target_users / users)
        planned = row.plan.planned_max_concurrency_paged if row.plan else None
        if planned:
            out["planned_devices_for_target_users_kv"] = math.ceil(target.target_users / planned)
    rps, source = (max_rate, "the arrival-rate search (open loop)") if max_rate else (
        cap.get(tracking.SLO_REQUESTS_PER_S) if users else 0.0,
        "the concurrency search's requests/s (closed loop)")
    if target.target_rps and rps:
        out["machines_for_target_rps"] = math.ceil(target.target_rps / rps)
        out["rps_from"] = source
    return out


def cheaper(variant: dict[str, Any], baseline: dict[str, Any]) -> tuple[bool | None, str]:
    """Whether a variant is shown cheaper than the baseline: its dearest end below the
    baseline's cheapest (True), its cheapest above the baseline's dearest (False), else
    None; with the reason in words."""
    if USD_PER_MTOK not in baseline:
        return None, "the baseline has no cost figure (no capacity at the objective)"
    v_high, b_low = variant[USD_PER_MTOK + "_max"], baseline.get(USD_PER_MTOK + "_min")
    if b_low is None:
        return None, ("the baseline's capacity reached the search ceiling: its cost is only an "
                      f"upper bound (<= ${baseline[USD_PER_MTOK + '_max']:.2f})")
    if v_high < b_low:
        return True, f"${v_high:.2f} at most against the baseline's ${b_low:.2f} at least"
    v_low = variant.get(USD_PER_MTOK + "_min")
    if v_low is not None and v_low > baseline[USD_PER_MTOK + "_max"]:
        return False, (f"dearer than the baseline: ${v_low:.2f} at least against its "
                       f"${baseline[USD_PER_MTOK + '_max']:.2f} at most")
    return None, (f"its cost range {range_text(variant)} overlaps the baseline's "
                  f"{range_text(baseline)}")


def range_text(c: dict[str, Any], prefix: str = "", unit: str = "$") -> str:
    """``$0.12 [0.10-0.15]``, or ``<= $0.15`` for a censored capacity's bound (``prefix``:
    ``rate_`` for the rate search's; ``unit: ""`` where a column header says USD)."""
    key = prefix + USD_PER_MTOK
    if key not in c:
        return "-"
    if c.get(prefix + "cost_bound") == "upper":
        return f"<= {unit}{c[key + '_max']:.2f}"
    return f"{unit}{c[key]:.2f} [{c[key + '_min']:.2f}-{c[key + '_max']:.2f}]"
