"""The comparison as a terminal table, Markdown, CSV and a self-contained HTML page (a jinja2
template, ``templates/report.html.j2``) with the plots of :mod:`pipeline.report.plots` inline.
Every accuracy figure from the emulated path carries the mark ``[emulated]``."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from pipeline.bench.table import SPEED_METHOD, lengths_text
from pipeline.core import tracking
from pipeline.core.artifacts import EMULATED, Comparison, PointFigures, Prediction, Row
from pipeline.core.fsutil import atomic_dir
from pipeline.core.variant import BASELINE
from pipeline.plan import capacity
from pipeline.report.cost import USD_PER_MTOK, price_basis, price_text, range_text
from pipeline.report.plots import PLOTS
from pipeline.report.recommend import OBJECTIVE_TEXT
from pipeline.serve import is_too_slow

TEMPLATES = Path(__file__).with_name("templates")


FILES = ("report.html", "comparison.md", "comparison.csv", "comparison.json")


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _spread(at: PointFigures, metric: str, fmt: str = "{:.1f}") -> str:
    if metric not in at.metrics:
        return "-"
    low, high = at.get(f"{metric}_min"), at.get(f"{metric}_max")
    body = fmt.format(at.metrics[metric])
    return f"{body} [{fmt.format(low)}-{fmt.format(high)}]" if low is not None else body


def _suite_cell(row: Row, suite: str) -> str:
    fig = row.suites.get(suite)
    if fig is None:
        return "-"
    if fig.recovery_pct is None:
        return "not meaningful"
    mark = " [emulated]" if fig.backend == EMULATED else ""
    return f"{fig.recovery_pct:.1f}% [{fig.ci_low:.1f}, {fig.ci_high:.1f}]{mark}"


def _speed_cell(row: Row) -> str:
    if row.serving == "unsupported":
        return "too slow here" if is_too_slow(row.serving_reason) else "unsupported here"
    if row.serving == "failed":
        return "FAILED (see notes)"
    if row.name == BASELINE:
        return "1.00x (reference)" if row.headline else "-"
    found = row.headline.speedup
    if found is None:
        return "-"
    cell = f"{found.text()} {found.verdict}"
    return cell if row.comparable else f"{cell} (other run, not compared)"


def _rated(comparison: Comparison) -> bool:
    """Whether any row has a rate search (its columns are shown then)."""
    return any(r.rate_capacity is not None for r in comparison.rows)


def _capacity_cell(row: Row, field: str = "capacity") -> str:
    cap = getattr(row, field)
    if row.serving != "ok" or cap is None:
        return "-"
    cell = cap.text()
    return cell + (" (other objective, not ranked)" if cap.other_objective else "")


def _cost_cell(row: Row, prefix: str = "") -> str:
    return range_text(row.cost, prefix, unit="")


def _price_label(comparison: Comparison) -> str:
    """The price the cost column is at: the one every priced row shares, else "each run's"."""
    priced = {price_text(r.price) for r in comparison.rows if r.price}
    if len(priced) > 1:
        return "each run's own price, see below"
    return priced.pop() if priced else price_text(comparison.price)


def table_rows(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and cells shared by the terminal and Markdown tables."""
    ctx = comparison.plan_target.context
    header = ["variant", "precision", "weights (x base)", "KV tokens (vLLM)",
              f"max conc. @{ctx} served", f"planned {comparison.planned_on} paged/worst",
              "out tok/s [min-max]",
              "speedup [interval], n, verdict", "TTFT p50 ms", "ITL p50 ms", "users @objective",
              f"$/M out tok @objective ({_price_label(comparison)})",
              *(["req/s @objective", "$/M out tok @req/s"] if _rated(comparison) else []),
              *[f"recovery {s} [95% CI]" for s in comparison.suites], "gate", "figures from"]
    cells = []
    for row in comparison.rows:
        plan = row.plan
        conc = (f"{plan.planned_max_concurrency_paged:,}/"
                f"{plan.planned_max_concurrency_worst_case:,}" if plan else "-")
        gate_cell = "-" if row.name == BASELINE else row.gate_status
        if row.threshold is not None and row.name != BASELINE:
            gate_cell += f" (>= {row.threshold:g}%)"
        served = {"ok": "served", "unsupported": "unsupported", "failed": "failed"}.get(
            row.serving, "not benched")
        run = row.measurement.split(" ")[1][:8] if row.measurement else ""
        speed = f"{served} (bench {run})" if run else served
        origin = speed if row.name == BASELINE else f"speed {speed}, accuracy {row.figures_from}"
        served_as = comparison.measurement.get("reference_dtype", "")
        reference = f", served in {served_as}" if row.name == BASELINE and served_as not in (
            "", "bfloat16") else ""
        cells.append([
            row.name, f"{row.precision} ({row.scheme}{reference})"
            + (f" + {row.kv_dtype} KV" if row.kv_dtype != "bf16" else ""),
            f"{row.weight_bytes / 1e6:,.1f} MB ({row.weight_ratio:.2f})",
            _num(row.kv.get(tracking.KV_CACHE_TOKENS), "{:,.0f}"),
            _num(row.served_concurrency(ctx), "{:,}"), conc,
            "-" if row.serving != "ok" else _spread(row.headline, tracking.OUTPUT_TOKENS_PER_S),
            _speed_cell(row),
            _num(row.headline.get(tracking.TTFT_MS_P50), "{:,.0f}"),
            _num(row.headline.get(tracking.ITL_MS_P50)), _capacity_cell(row), _cost_cell(row),
            *([_capacity_cell(row, "rate_capacity"), _cost_cell(row, "rate_")]
              if _rated(comparison) else []),
            *[_suite_cell(row, s) for s in comparison.suites], gate_cell, origin])
    return header, cells


def headline_line(comparison: Comparison) -> str:
    if comparison.load_point:
        m = comparison.measurement
        return (f"speed: workload {comparison.workload}, concurrency {comparison.load_point}, "
                f"from {m.get('run', '?')} (tok/s: median of the repeats [min-max]; speedup: "
                f"{SPEED_METHOD}; {m.get('pairing') or 'pairing not recorded'})"
                + (f"; reference: {m['reference']}" if m.get("reference") else ""))
    return "speed: not measured yet (make bench)"


def recommendation_line(comparison: Comparison) -> str:
    if comparison.recommendation:
        return f"recommendation: ship {comparison.reason}"
    return f"recommendation: none. {comparison.reason}"


def terminal(comparison: Comparison) -> str:
    header, cells = table_rows(comparison)
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    lines = [f"qpipe comparison: {comparison.baseline}",
             "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
    lines += ["", headline_line(comparison), _plan_line(comparison), *_notes(comparison), "",
              recommendation_line(comparison)]
    return "\n".join(lines)


def _plan_line(comparison: Comparison) -> str:
    t = comparison.plan_target
    note = f" ({comparison.plan_note})" if comparison.plan_note else ""
    return (f"max concurrency{note}: 'served' is the KV cache vLLM reported here divided by "
            f"{t.context:,}-token requests; 'planned' is the capacity planner on "
            f"{comparison.planned_on} with each variant's weights, {t.context:,} tokens per "
            f"request (paged) or {t.max_context:,} reserved (worst case)")


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def capacity_lines(comparison: Comparison) -> list[str]:
    """What 'users @objective' and the cost column mean, and the crossover of each variant."""
    out = []
    searched = next((r.capacity for r in comparison.rows if r.capacity is not None), None)
    objective = searched.objective if searched is not None else None
    if searched is not None and objective and searched.objective_basis:
        objective += f" ({searched.objective_basis})"
    where = comparison.hardware or "the machine of the bench run"
    if objective:
        out.append(f"users @objective: the max concurrency at which {objective} (the knee "
                   "of the attainment curve, fitted over a grid of 5 loads in the bracket, in "
                   "steady state; [90% interval] for the knee in the session it was "
                   "measured in, ? where unbounded, coverage measured by make calibrate; "
                   "sessions differ, so a fleet figure needs searches in several; >= where the "
                   f"ceiling was shown to meet it; measured on {where}); "
                   "its cost: USD per device-hour x the devices of the run that measured it, "
                   "over the output tokens/s at the capacity [from the slowest run at the "
                   "interval's low end to the fastest at its high end; <= a bound where the "
                   "search was censored]")
    rated = next((r.rate_capacity for r in comparison.rows if r.rate_capacity is not None),
                 None)
    if rated is not None and rated.objective:
        basis = f" ({rated.objective_basis})" if rated.objective_basis else ""
        closed = searched.traffic if searched is not None and searched.traffic else \
            "a closed loop"
        out.append(f"req/s @objective: the arrival rate at which "
                   f"{rated.objective}{basis} ({rated.traffic or 'open loop'}); users "
                   f"@objective assumes {closed}; each cost is at its own search's capacity")
    sources = {(price_text(r.price), r.price.source or "?") for r in comparison.rows
               if r.price is not None}
    for label, source in sorted(sources):
        who = "" if len(sources) == 1 else " (" + ", ".join(
            r.name for r in comparison.rows if r.price and price_text(r.price) == label) + ")"
        out.append(f"price{who}: {label}: {source}")
    target = comparison.cost_target
    for row in comparison.rows:
        cap, c = row.capacity, row.cost
        if cap is not None and row.serving == "ok":
            out.append(f"{row.name}: capacity limited by {cap.limited_by or '?'}")
        if c is not None and c.machines_for_target_users:
            planned = c.planned_devices_for_target_users_kv
            out.append(f"{row.name}: {target.target_users:,} concurrent users need "
                       f"{_count(c.machines_for_target_users, 'machine')} like the one "
                       "measured (its capacity measured there)"
                       + (f"; on {comparison.planned_on} the KV cache alone needs at least "
                          f"{_count(planned, 'device')} (planned; its latency there is not "
                          "measured)" if planned else ""))
        if c is not None and c.machines_for_target_rps:
            out.append(f"{row.name}: {target.target_rps:g} requests/s need "
                       f"{_count(c.machines_for_target_rps, 'machine')} like the one "
                       f"measured (from {c.rps_from or 'its capacity measured there'})")
        if row.crossover and row.comparable:
            out.append(f"{row.name}: {row.crossover}")
    return out


def search_lines(comparison: Comparison) -> list[str]:
    """Predicted (the sensitivity model: units' damages summed) against measured (the whole
    model on the held-out text) KL, per variant that has a prediction."""
    out = []
    low, high = Prediction.HELD
    for row in comparison.rows:
        if row.search is None:
            continue
        predicted = row.search.predicted_kl
        measured = row.divergence.get("kl_div_mean")
        ratio, held = row.search.ratio(measured), row.search.held(measured)
        if ratio is None:
            tail = "not measured (make eval runs the held-out check)"
        else:
            tail = (f"measured {measured:.4f} on the held-out check text (the whole model, "
                    f"emulated) = {ratio:.2f}x the prediction: "
                    + (("it held" if low <= ratio <= high else
                        f"it held (within {Prediction.FLOOR:g} nats/token: the check's bf16 "
                        "arithmetic, not the prediction)") if held else
                       "a shipped recipe, quantized by its own method, not the scan's "
                       "round-to-nearest: the ratio is what that method does here against "
                       "round-to-nearest (METHOD=gptq searches calibrate by it)"
                       if row.search.uniform else f"WARNING: it did not hold (held: within "
                       f"{low:g}-{high:g}x); this variant's predicted damage is not to be "
                       "trusted, its measured KL is"))
        out.append(f"{row.name}: predicted KL {predicted:.4f} nats/token (its units' damages "
                   f"summed; {row.search.basis}), {tail}")
        if row.search.predicted_speedup:
            found = row.headline.speedup
            slow, shigh = row.search.predicted_speedup_low, row.search.predicted_speedup_high
            ends = f" [{slow:.2f}, {shigh:.2f}]" if slow and shigh else ""
            out.append(f"{row.name}: predicted speedup {row.search.predicted_speedup:.2f}x"
                       f"{ends} (from the uniform variants' measured speedups), "
                       + (f"measured {found.text()} {found.verdict}" if found is not None
                          else "its speed not measured (make bench)"))
    if out:
        out.insert(0, "precision search, predicted against measured: the search predicts a "
                   "recipe's damage as the sum of each unit's damage when quantized alone "
                   "(round-to-nearest, on the scan's text)")
    return out


def _notes(comparison: Comparison) -> list[str]:
    out = [f"objective {comparison.objective}: {OBJECTIVE_TEXT[comparison.objective]} "
           "(OBJECTIVE=speed|memory|capacity|cost)", *capacity_lines(comparison),
           *search_lines(comparison)]
    if comparison.hardware:
        out.append(f"speed measured on: {comparison.hardware}")
    for name, lengths in comparison.traffic.items():
        out.append(f"workload {name} (your requests, from a file): {lengths_text(lengths)}")
    for failure in comparison.failures:
        log = f" (log {failure.log})" if failure.log else ""
        out.append(f"FAILED: {failure.variant} in {failure.stage}: {failure.reason}{log}"
                   "; the other variants were measured without it, and it cannot be recommended")
    for row in comparison.rows:
        if row.serving == "unsupported":
            out.append(f"{row.name}: vLLM cannot serve {row.format} "
                       f"{'at a measurable speed ' if is_too_slow(row.serving_reason) else ''}"
                       f"on this hardware: {row.serving_reason}")
        if row.eval_backend == EMULATED:
            out.append(f"{row.name}: accuracy from the emulated path (lm-eval hf backend on "
                       "de-compressed weights), not from a serving engine")
        out += [f"{row.name}: {note}" for note in row.notes]
    return out


def markdown(comparison: Comparison) -> str:
    header, cells = table_rows(comparison)
    esc = [[c.replace("|", "\\|") for c in cell] for cell in cells]
    lines = [f"# qpipe comparison: {comparison.baseline}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell) + " |" for cell in esc]
    lines += ["", f"- {headline_line(comparison)}", f"- {_plan_line(comparison)}",
              *[f"- {n}" for n in _notes(comparison)], "",
              f"**{recommendation_line(comparison)}**", ""]
    return "\n".join(lines)


CSV_FIELDS = ("variant", "recipe", "scheme", "format", "precision", "weight_bytes",
              "weight_ratio", "kv_cache_tokens", "max_concurrency",
              "served_concurrency_at_context", capacity.MAX_CONCURRENCY_PAGED,
              capacity.MAX_CONCURRENCY_WORST_CASE, "serving_status", "output_tokens_per_s",
              "output_tokens_per_s_min", "output_tokens_per_s_max", "speedup",
              tracking.SPEEDUP_CI_LOW, tracking.SPEEDUP_CI_HIGH, tracking.SPEEDUP_N,
              "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
              "capacity_outcome", tracking.SLO_MAX_CONCURRENCY,
              tracking.SLO_MAX_CONCURRENCY + "_lower_bound", tracking.SLO_CAPACITY_LOW,
              tracking.SLO_CAPACITY_HIGH, tracking.SLO_REQUESTS_PER_S,
              tracking.SLO_OUTPUT_TOKENS_PER_S, tracking.SLO_MAX_REQUEST_RATE,
              tracking.SLO_MAX_REQUEST_RATE + "_lower_bound", tracking.SLO_REQUEST_RATE_LOW,
              tracking.SLO_REQUEST_RATE_HIGH, "rate_" + USD_PER_MTOK,
              USD_PER_MTOK, USD_PER_MTOK + "_min", USD_PER_MTOK + "_max",
              USD_PER_MTOK + "_upper_bound", "price_per_hour", "price_per_device_hour",
              "devices", "price_basis",
              "eval_backend", "gate", "threshold_pct", "engine_scheme", "kl_div_mean",
              "predicted_kl",
              tracking.ENGINE_WEIGHT_MEMORY_BYTES, tracking.KV_CACHE_MEMORY_BYTES, "measurement",
              "comparable")


def csv_text(comparison: Comparison) -> str:
    suites = comparison.suites
    fields = [*CSV_FIELDS, *[f"recovery_pct.{s}{x}" for s in suites for x in ("", "_ci_low",
                                                                              "_ci_high")]]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in comparison.rows:
        h = row.headline.flat()  # the figures under their metric names, as MLflow has them
        record: dict[str, Any] = {
            "variant": row.name, "recipe": row.recipe, "scheme": row.scheme,
            "format": row.format, "precision": row.precision, "weight_bytes": row.weight_bytes,
            "weight_ratio": round(row.weight_ratio, 4),
            "kv_cache_tokens": row.kv.get(tracking.KV_CACHE_TOKENS),
            "max_concurrency": row.kv.get(tracking.MAX_CONCURRENCY),
            "served_concurrency_at_context": row.served_concurrency(
                comparison.plan_target.context),
            capacity.MAX_CONCURRENCY_PAGED:
                row.plan.planned_max_concurrency_paged if row.plan else None,
            capacity.MAX_CONCURRENCY_WORST_CASE:
                row.plan.planned_max_concurrency_worst_case if row.plan else None,
            "serving_status": row.serving, "eval_backend": row.eval_backend or "",
            "gate": "" if row.name == BASELINE else row.gate_status,
            "threshold_pct": row.threshold, "engine_scheme": row.engine.scheme,
            tracking.ENGINE_WEIGHT_MEMORY_BYTES: row.engine.engine_weight_memory_bytes,
            tracking.KV_CACHE_MEMORY_BYTES: row.kv.get(tracking.KV_CACHE_MEMORY_BYTES),
            "measurement": row.measurement, "comparable": row.comparable,
            "kl_div_mean": row.divergence.get("kl_div_mean"),
            "predicted_kl": row.search.predicted_kl if row.search else None,
            "price_per_hour": row.price.price_per_hour if row.price else None,
            "price_per_device_hour": row.price.price_per_device_hour if row.price else None,
            "devices": row.price.devices if row.price else None,
            "price_basis": price_basis(row.price),
            "capacity_outcome": row.capacity.outcome if row.capacity else ""}
        # the figures as exported to MLflow: a bound under a name that says so
        searched = [found.metrics() if found is not None else {}
                    for found in (row.capacity, row.rate_capacity, row.cost)]
        for key in CSV_FIELDS:
            for source in (h, *searched):
                if key in source and key not in record:
                    record[key] = source[key]
        for s in suites:
            fig = row.suites.get(s)
            record[f"recovery_pct.{s}"] = fig.recovery_pct if fig else None
            record[f"recovery_pct.{s}_ci_low"] = fig.ci_low if fig else None
            record[f"recovery_pct.{s}_ci_high"] = fig.ci_high if fig else None
        writer.writerow(record)
    return buf.getvalue()


def html_page(comparison: Comparison, meta: dict[str, str] | None = None) -> str:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True)
    header, cells = table_rows(comparison)
    return env.get_template("report.html.j2").render(
        baseline=comparison.baseline, recommended=bool(comparison.recommendation),
        advice=recommendation_line(comparison), header=header, rows=cells,
        notes=[headline_line(comparison), _plan_line(comparison), *_notes(comparison)],
        plots=[plot(comparison) for plot in PLOTS], meta=meta or {})


def write(comparison: Comparison, directory: Path, meta: dict[str, str] | None = None
          ) -> list[Path]:
    """All four files into ``directory``, replaced as a whole once complete."""
    with atomic_dir(directory) as tmp:
        (tmp / "report.html").write_text(html_page(comparison, meta))
        (tmp / "comparison.md").write_text(markdown(comparison))
        (tmp / "comparison.csv").write_text(csv_text(comparison))
        (tmp / Comparison.FILE).write_text(json.dumps(
            {**comparison.as_dict(), "meta": meta or {}}, indent=2, default=str))
    return [directory / name for name in FILES]
