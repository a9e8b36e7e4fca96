"""What a variant costs: per million output tokens at its capacity under the latency objective,
and the machines a target load needs.

Measured: the capacity (concurrency, requests/s, output tokens/s) at the objective, priced in
one unit, USD per device-hour, times the devices that the server of the run that measured that
capacity used (its own record: TP x PP GPUs, or the host), not those of the machine that runs
the comparison nor of another run. The cost's range is the capacity's 90% interval: the
dearest end at its low end (the slowest run there), the cheapest at its high end (the fastest).
A price the user did not set is an example figure and is called one. Planned: how many
requests the plan target's KV cache holds (:mod:`pipeline.plan.capacity`), a lower bound on the
devices a target number of users needs there (its speed at the objective is not measured).
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.core import hardware
from pipeline.core.artifacts import BenchSummary, Capacity, CostFigures, CostTarget, Price, Row
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
    """The hourly price of what one server used (``devices``): the price per device-hour
    (the one given, else the accelerator preset's example, else the host's example) times its
    devices, where it comes from, and whether it is an example figure."""
    gpu = devices.get("unit") == "gpu"
    count = int(devices.get("count") or 1) if gpu else 1
    what = "GPUs (TP x PP)" if gpu else str(devices.get("kind", "host"))
    if target.price_per_device_hour is not None:
        return Price(price_per_hour=target.price_per_device_hour * count, devices=count,
                     price_per_device_hour=target.price_per_device_hour, example=False,
                     source=f"{count} x PRICE_PER_DEVICE_HOUR (the campaign's "
                            f"cost.price_per_device_hour), {what}")
    if gpu:
        # a slice is priced as its card (the memory it reports is the slice's)
        memory = None if devices.get("mig") else devices.get("memory_mib")
        kind = str(devices.get("kind", ""))
        preset = detect_accelerator(kind, memory, exact=False)
        if preset is not None and preset.price_per_device_hour:
            exact = devices.get("mig") or detect_accelerator(kind, memory) is not None
            slice_note = (": a MIG slice, priced as the whole GPU" if devices.get("mig") else
                          "" if exact else f": {kind} has no preset, priced as the nearest")
            return Price(price_per_hour=preset.price_per_device_hour * count, devices=count,
                         price_per_device_hour=preset.price_per_device_hour, example=True,
                         source=f"{count} x {preset.name}'s example price_per_device_hour "
                                f"(configs/accelerators{slice_note}; TP x PP GPUs per server; "
                                "set yours: PRICE_PER_DEVICE_HOUR=)")
    return Price(price_per_hour=target.host_price_per_device_hour, devices=1,
                 price_per_device_hour=target.host_price_per_device_hour, example=True,
                 source=f"the campaign's cost.host_price_per_device_hour for one {what} (an "
                        "example figure, set yours: PRICE_PER_DEVICE_HOUR=)")


def price_basis(priced: Price | None) -> str:
    """``example`` (a price the user did not set), ``set``, or "" where there is no price."""
    return priced.basis if priced is not None else ""


def price_text(priced: Price | None) -> str:
    """``$0.1/h example price`` or ``$12/h (4 x $3 per device-hour)``: a price never shown
    without saying whose."""
    if priced is None:
        return "no price"
    per_device = (f" ({priced.devices} x ${priced.price_per_device_hour:g} per device-hour)"
                  if priced.devices > 1 and priced.price_per_device_hour else "")
    return f"${priced.price_per_hour:g}/h{per_device}" + \
        (" example price" if priced.example else "")


def capacity_price(row: Row, fallback: Price | None) -> Price | None:
    """The price a row's cost is shown at: that of the run that measured its capacity (the
    concurrency search's, else the rate search's), else ``fallback`` (its speed run's)."""
    return next((c.price for c in (row.capacity, row.rate_capacity)
                 if c is not None and c.price is not None), fallback)


def per_million_tokens(price_per_hour: float, output_tokens_per_s: float) -> float:
    """USD per million output tokens for a machine at ``price_per_hour`` producing
    ``output_tokens_per_s`` for the whole hour."""
    return price_per_hour / (output_tokens_per_s * 3600) * 1e6


def _priced(cap: Capacity, price_per_hour: float, prefix: str = "") -> dict[str, Any]:
    """The cost at one search's capacity (``prefix``: ``rate_`` for a rate search's): at the
    throughput there, the dearest end at its interval's low end (the slowest run there), the
    cheapest at its high end (the fastest; None where the interval is unbounded); a censored
    search gives only the dearest end, an upper bound (``cost_bound: upper``)."""
    tps = cap.slo_output_tokens_per_s
    if not tps:
        return {}
    key = prefix + USD_PER_MTOK
    if cap.censored:  # the capacity is at least the ceiling: its cost at most the ceiling's
        return {key + "_max": per_million_tokens(price_per_hour, tps),
                prefix + "cost_bound": "upper"}
    out: dict[str, Any] = {key: per_million_tokens(price_per_hour, tps)}
    low, high = cap.interval
    slowest, fastest = cap.slo_output_tokens_per_s_at_low, cap.slo_output_tokens_per_s_at_high
    if low and slowest:
        out[key + "_max"] = per_million_tokens(price_per_hour, min(slowest, tps))
    if high and fastest:
        out[key + "_min"] = per_million_tokens(price_per_hour, max(fastest, tps))
    return out


def figures(row: Row, target: CostTarget, price: Price | None = None) -> CostFigures | None:
    """The cost figures of one row (None when it has no capacity at the objective to rank: a
    capacity searched at another objective, or undecided, is not priced).

    The cost at the capacity and its range (:func:`_priced`), from the concurrency search and,
    prefixed ``rate_``, from the arrival-rate search, each priced on the devices of the run
    that measured it (its ``price``, else ``price``); the machines a target load needs: users
    from the concurrency search, requests/s from the rate search where there is one
    (open-loop arrivals, what a fleet is sized by), else from the concurrency search's
    requests/s (closed loop), said in ``rps_from``. A censored capacity's cost is an upper
    bound, never ranked as exact."""
    def usable(found: Capacity | None) -> Capacity | None:
        return found if found is not None and not found.other_objective and \
            not found.undecided else None
    cap, rate = usable(row.capacity), usable(row.rate_capacity)
    users = (cap.slo_max_concurrency or 0) if cap is not None else 0
    max_rate = (rate.slo_max_request_rate or 0.0) if rate is not None else 0.0
    if not users and not max_rate:
        return None
    def hourly(found: Capacity | None) -> float | None:
        priced = (found.price if found is not None and found.price is not None else price)
        return priced.price_per_hour if priced is not None else None
    cap_price, rate_price = hourly(cap), hourly(rate)
    if cap_price is None and rate_price is None:
        return None
    out: dict[str, Any] = {"price_per_hour": cap_price or rate_price,
                           "rate_price_per_hour": rate_price}
    if cap is not None and users and cap_price is not None:
        out.update(_priced(cap, cap_price))
    if rate is not None and max_rate and rate_price is not None:
        out.update(_priced(rate, rate_price, "rate_"))
    if target.target_users and users:
        out["machines_for_target_users"] = math.ceil(target.target_users / users)
        planned = row.plan.planned_max_concurrency_paged if row.plan else None
        if planned:
            out["planned_devices_for_target_users_kv"] = math.ceil(target.target_users / planned)
    rps, source = (max_rate, "the arrival-rate search (open loop)") if max_rate else (
        (cap.slo_requests_per_s or 0.0) if cap is not None and users else 0.0,
        "the concurrency search's requests/s (closed loop)")
    if target.target_rps and rps:
        out["machines_for_target_rps"] = math.ceil(target.target_rps / rps)
        out["rps_from"] = source
    return CostFigures.model_validate(out)


def cheaper(variant: CostFigures, baseline: CostFigures | None) -> tuple[bool | None, str]:
    """Whether a variant is shown cheaper than the baseline: its dearest end below the
    baseline's cheapest (True), its cheapest above the baseline's dearest (False), else
    None; with the reason in words. An unbounded end shows nothing on that side."""
    if baseline is None or (baseline.at()[2] is None and baseline.at()[0] is None):
        return None, "the baseline has no cost figure (no capacity at the objective)"
    _, v_low, v_high, _ = variant.at()
    _, b_low, b_high, b_bound = baseline.at()
    if b_bound:
        return None, ("the baseline's capacity reached the search ceiling: its cost is only an "
                      f"upper bound (<= ${b_high:.2f})")
    if v_high is not None and b_low is not None and v_high < b_low:
        return True, f"${v_high:.2f} at most against the baseline's ${b_low:.2f} at least"
    if v_low is not None and b_high is not None and v_low > b_high:
        return False, (f"dearer than the baseline: ${v_low:.2f} at least against its "
                       f"${b_high:.2f} at most")
    return None, (f"its cost range {range_text(variant)} overlaps the baseline's "
                  f"{range_text(baseline)}")


def range_text(c: CostFigures | None, prefix: str = "", unit: str = "$") -> str:
    """``$0.12 [0.10-0.15]`` (``?``: an end the capacity's interval leaves unbounded), or
    ``<= $0.15`` for a censored capacity's bound (``prefix``: ``rate_`` for the rate search's;
    ``unit: ""`` where a column header says USD)."""
    if c is None:
        return "-"
    mid, low, high, bound = c.at(prefix)
    if bound and high is not None:
        return f"<= {unit}{high:.2f}"
    if mid is None:
        return "-"
    def end(v: float | None) -> str:
        return f"{v:.2f}" if v is not None else "?"
    return f"{unit}{mid:.2f} [{end(low)}-{end(high)}]"
