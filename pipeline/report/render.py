"""The comparison as a terminal table, Markdown, CSV and a self-contained HTML page with plots.

Plots are drawn with matplotlib as inline SVG, so the HTML file is one file that opens anywhere
(MLflow's artifact viewer included) without a network. Every accuracy figure from the emulated
path carries the mark ``[emulated]``.
"""

from __future__ import annotations

import csv
import html
import io
from pathlib import Path
from typing import Any

from pipeline.core import tracking
from pipeline.core.fsutil import atomic_dir
from pipeline.plan import capacity
from pipeline.report.compare import BASELINE, EMULATED, Comparison, Row

FILES = ("report.html", "comparison.md", "comparison.csv", "comparison.json")


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _spread(stats: dict[str, float], metric: str, fmt: str = "{:.1f}") -> str:
    if metric not in stats:
        return "-"
    low, high = stats.get(f"{metric}_min"), stats.get(f"{metric}_max")
    body = fmt.format(stats[metric])
    return f"{body} [{fmt.format(low)}-{fmt.format(high)}]" if low is not None else body


def _suite_cell(row: Row, suite: str) -> str:
    fig = row.suites.get(suite)
    if not fig:
        return "-"
    if fig.get("recovery_pct") is None:
        return "not meaningful"
    mark = " [emulated]" if fig.get("backend") == EMULATED else ""
    return f"{fig['recovery_pct']:.1f}% [{fig['ci_low']:.1f}, {fig['ci_high']:.1f}]{mark}"


def _suites(comparison: Comparison) -> list[str]:
    return sorted({s for row in comparison.rows for s in row.suites})


def _speed_cell(row: Row) -> str:
    if row.serving == "unsupported":
        return "unsupported here"
    if row.serving == "failed":
        return "FAILED (see notes)"
    if row.name == BASELINE:
        return "1.00x (reference)" if row.headline else "-"
    cell = _spread(row.headline, tracking.SPEEDUP, "{:.2f}").replace(" [", "x [", 1)
    return cell if row.comparable else f"{cell} (other run, not compared)"


def table_rows(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and cells shared by the terminal and Markdown tables."""
    ctx = comparison.plan_target.context
    header = ["variant", "precision", "weights (x base)", "KV tokens (vLLM)",
              f"max conc. @{ctx} served", f"planned {_where(comparison)} paged/worst",
              "out tok/s [min-max]",
              "speedup [min-max]", "TTFT p50 ms", "ITL p50 ms",
              *[f"recovery {s} [95% CI]" for s in _suites(comparison)], "gate", "figures from"]
    cells = []
    for row in comparison.rows:
        plan = row.plan
        conc = (f"{plan[capacity.MAX_CONCURRENCY_PAGED]:,}/"
                f"{plan[capacity.MAX_CONCURRENCY_WORST_CASE]:,}" if plan else "-")
        gate_cell = "-" if row.name == BASELINE else row.gate_status
        if row.threshold is not None and row.name != BASELINE:
            gate_cell += f" (>= {row.threshold:g}%)"
        served = {"ok": "served", "unsupported": "unsupported", "failed": "failed"}.get(
            row.serving, "not benched")
        run = row.measurement.split(" ")[1][:8] if row.measurement else ""
        speed = f"{served} (bench {run})" if run else served
        origin = speed if row.name == BASELINE else f"speed {speed}, accuracy {row.figures_from}"
        cells.append([
            row.name, f"{row.precision} ({row.scheme})",
            f"{row.weight_bytes / 1e6:,.1f} MB ({row.weight_ratio:.2f})",
            _num(row.kv.get(tracking.KV_CACHE_TOKENS), "{:,.0f}"),
            _num(row.served_concurrency(ctx), "{:,}"), conc,
            "-" if row.serving != "ok" else _spread(row.headline, tracking.OUTPUT_TOKENS_PER_S),
            _speed_cell(row),
            _num(row.headline.get(tracking.TTFT_MS_P50), "{:,.0f}"),
            _num(row.headline.get(tracking.ITL_MS_P50)),
            *[_suite_cell(row, s) for s in _suites(comparison)], gate_cell, origin])
    return header, cells


def headline_line(comparison: Comparison) -> str:
    if comparison.load_point:
        m = comparison.measurement
        return (f"speed: workload {comparison.workload}, concurrency {comparison.load_point}, "
                f"from {m.get('run', '?')} (median of the repeats [min-max]; speedup: the "
                f"median of the per-repeat ratios to the baseline [min-max], "
                f"{m.get('pairing') or 'pairing not recorded'})")
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


def _where(comparison: Comparison) -> str:
    t = comparison.plan_target
    return f"{t.memory_gb:g} GB" if t.memory_gb is not None else t.gpu


def _plan_line(comparison: Comparison) -> str:
    t = comparison.plan_target
    note = f" ({comparison.plan_note})" if comparison.plan_note else ""
    return (f"max concurrency{note}: 'served' is the KV cache vLLM reported here divided by "
            f"{t.context:,}-token requests; 'planned' is the capacity planner on "
            f"{_where(comparison)} with each variant's weights, {t.context:,} tokens per request "
            f"(paged) or {t.max_context:,} reserved (worst case)")


def _notes(comparison: Comparison) -> list[str]:
    from pipeline.report.compare import OBJECTIVE_TEXT

    out = [f"objective {comparison.objective}: {OBJECTIVE_TEXT[comparison.objective]} "
           "(OBJECTIVE=speed|memory|capacity)"]
    if comparison.hardware:
        out.append(f"speed measured on: {comparison.hardware}")
    for failure in comparison.failures:
        log = f" (log {failure['log']})" if failure.get("log") else ""
        out.append(f"FAILED: {failure['variant']} in {failure['stage']}: {failure['reason']}{log}"
                   "; the other variants were measured without it, and it cannot be recommended")
    for row in comparison.rows:
        if row.serving == "unsupported":
            out.append(f"{row.name}: vLLM cannot serve {row.format} on this hardware: "
                       f"{row.serving_reason}")
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
              "output_tokens_per_s_min", "output_tokens_per_s_max", "speedup", "speedup_min",
              "speedup_max", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
              "eval_backend", "gate", "threshold_pct", "engine_scheme",
              tracking.ENGINE_WEIGHT_MEMORY_BYTES, tracking.KV_CACHE_MEMORY_BYTES, "measurement",
              "comparable")


def csv_text(comparison: Comparison) -> str:
    suites = _suites(comparison)
    fields = [*CSV_FIELDS, *[f"recovery_pct.{s}{x}" for s in suites for x in ("", "_ci_low",
                                                                              "_ci_high")]]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in comparison.rows:
        h = row.headline
        record: dict[str, Any] = {
            "variant": row.name, "recipe": row.recipe, "scheme": row.scheme,
            "format": row.format, "precision": row.precision, "weight_bytes": row.weight_bytes,
            "weight_ratio": round(row.weight_ratio, 4),
            "kv_cache_tokens": row.kv.get(tracking.KV_CACHE_TOKENS),
            "max_concurrency": row.kv.get(tracking.MAX_CONCURRENCY),
            "served_concurrency_at_context": row.served_concurrency(
                comparison.plan_target.context),
            capacity.MAX_CONCURRENCY_PAGED: row.plan.get(capacity.MAX_CONCURRENCY_PAGED),
            capacity.MAX_CONCURRENCY_WORST_CASE: row.plan.get(
                capacity.MAX_CONCURRENCY_WORST_CASE),
            "serving_status": row.serving, "eval_backend": row.eval_backend or "",
            "gate": "" if row.name == BASELINE else row.gate_status,
            "threshold_pct": row.threshold, "engine_scheme": row.engine.get("scheme", ""),
            tracking.ENGINE_WEIGHT_MEMORY_BYTES: row.engine.get(
                tracking.ENGINE_WEIGHT_MEMORY_BYTES),
            tracking.KV_CACHE_MEMORY_BYTES: row.kv.get(tracking.KV_CACHE_MEMORY_BYTES),
            "measurement": row.measurement, "comparable": row.comparable}
        for key in CSV_FIELDS:
            if key in h:
                record[key] = h[key]
        for s in suites:
            fig = row.suites.get(s, {})
            record[f"recovery_pct.{s}"] = fig.get("recovery_pct")
            record[f"recovery_pct.{s}_ci_low"] = fig.get("ci_low")
            record[f"recovery_pct.{s}_ci_high"] = fig.get("ci_high")
        writer.writerow(record)
    return buf.getvalue()


# --- plots -------------------------------------------------------------------------------------
def _svg(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: inline SVG


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "svg.fonttype": "none"})
    return plt


def _primary_suite(comparison: Comparison) -> str | None:
    suites = _suites(comparison)
    meaningful = [s for s in suites if any(r.suites.get(s, {}).get("recovery_pct") is not None
                                           for r in comparison.rows)]
    return meaningful[0] if meaningful else None


def plot_pareto(comparison: Comparison) -> tuple[str, str]:
    """Recovery (first meaningful suite, with its interval) against speedup."""
    plt = _pyplot()
    suite = _primary_suite(comparison)
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = 0
    for row in comparison.rows:
        fig_s = row.suites.get(suite or "", {})
        if row.name == BASELINE:
            if row.headline:
                ax.scatter([1.0], [100.0], marker="*", s=120, color="black", zorder=3)
                ax.annotate("baseline", (1.0, 100.0), textcoords="offset points", xytext=(6, 4))
            continue
        if row.speedup is None or fig_s.get("recovery_pct") is None:
            continue
        y, low, high = fig_s["recovery_pct"], fig_s["ci_low"], fig_s["ci_high"]
        ax.errorbar([row.speedup], [y], yerr=[[y - low], [high - y]], fmt="o", capsize=4,
                    label=f"{row.name} (gate {row.gate_status})")
        label = row.name + (" [emulated]" if fig_s.get("backend") == EMULATED else "")
        ax.annotate(label, (row.speedup, y), textcoords="offset points", xytext=(6, 4))
        drawn += 1
    ax.axhline(100, color="grey", lw=0.6, ls=":")
    ax.set_xlabel(f"speedup vs baseline (output tok/s, concurrency {comparison.load_point})")
    ax.set_ylabel(f"recovery, suite {suite} (%), 95% CI" if suite else "recovery (%)")
    ax.set_title("Recovery against speedup (up and right is better)")
    if drawn:
        ax.legend(fontsize=7, loc="lower left")
    else:
        ax.text(0.5, 0.5, "no variant has both a speedup and a recovery yet",
                transform=ax.transAxes, ha="center")
    return "pareto", _svg(fig)


def plot_memory(comparison: Comparison) -> tuple[str, str]:
    """Weight memory and planned max concurrency per variant."""
    plt = _pyplot()
    names = [r.name for r in comparison.rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    left.bar(names, [r.weight_bytes / 1e6 for r in comparison.rows], color="#4c72b0")
    left.set_ylabel("weight memory (MB, measured on disk)")
    left.set_title("Weights")
    t = comparison.plan_target
    paged = [r.plan.get(capacity.MAX_CONCURRENCY_PAGED, 0) for r in comparison.rows]
    worst = [r.plan.get(capacity.MAX_CONCURRENCY_WORST_CASE, 0) for r in comparison.rows]
    xs = range(len(names))
    right.bar([x - 0.2 for x in xs], paged, width=0.4, label=f"paged ({t.context:,} tokens)")
    right.bar([x + 0.2 for x in xs], worst, width=0.4,
              label=f"worst case ({t.max_context:,} reserved)")
    right.set_xticks(list(xs), names)
    right.set_ylabel("max concurrent requests (planned)")
    right.set_title(f"Planned concurrency on {_where(comparison)}")
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
    return "memory", _svg(fig)


def plot_latency(comparison: Comparison) -> tuple[str, str]:
    """TTFT and ITL percentiles per load point, one line per served model."""
    plt = _pyplot()
    fig, (ttft, itl) = plt.subplots(1, 2, figsize=(8, 3.2))
    loads: set[int] = set()
    for row in comparison.rows:
        if row.serving != "ok" or not row.sweep:
            continue
        points = sorted(row.sweep)
        loads.update(points)
        for ax, metric in ((ttft, "ttft_ms"), (itl, "itl_ms")):
            line = ax.plot(points, [row.sweep[p].get(f"{metric}_p50") for p in points],
                           marker="o", label=f"{row.name} p50")[0]
            ax.plot(points, [row.sweep[p].get(f"{metric}_p99") for p in points], ls="--",
                    color=line.get_color(), label=f"{row.name} p99")
    for ax, title in ((ttft, "time to first token (ms)"), (itl, "inter-token latency (ms)")):
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        if loads:  # the load points themselves, not powers of two
            ax.set_xticks(sorted(loads), [str(p) for p in sorted(loads)])
            ax.minorticks_off()
        if ax.lines:
            ax.legend(fontsize=6)
    return "latency", _svg(fig)


def plot_tasks(comparison: Comparison) -> tuple[str, str]:
    """Recovery per task with its 95% interval, per variant."""
    plt = _pyplot()
    entries = []
    for row in comparison.rows:
        for task, t in sorted(row.tasks.items()):
            r = t["recovery"].get(t["primary_metric"], {})
            if r.get("recovery_pct") is not None and r.get("ci_low") is not None:
                mark = " [emulated]" if t.get("backend") == EMULATED else ""
                entries.append((f"{row.name}: {task}{mark}", r["recovery_pct"], r["ci_low"],
                                r["ci_high"]))
    fig, ax = plt.subplots(figsize=(6, 0.3 * len(entries) + 1.2))
    for i, (_, y, low, high) in enumerate(entries):
        ax.errorbar([y], [i], xerr=[[y - low], [high - y]], fmt="o", capsize=3)
    ax.set_yticks(range(len(entries)), [e[0] for e in entries])
    ax.axvline(100, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("recovery (%), 95% paired-bootstrap interval")
    ax.set_title("Recovery per task")
    if not entries:
        ax.text(0.5, 0.5, "no meaningful task recovery yet (make eval)", transform=ax.transAxes,
                ha="center")
    return "tasks", _svg(fig)


PLOTS = (plot_pareto, plot_memory, plot_latency, plot_tasks)


def html_page(comparison: Comparison, meta: dict[str, str] | None = None) -> str:
    header, cells = table_rows(comparison)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cell) + "</tr>"
                   for cell in cells)
    figures = "".join(f'<figure class="plot" id="plot-{name}">{svg}</figure>'
                      for name, svg in (plot(comparison) for plot in PLOTS))
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in
                    [headline_line(comparison), _plan_line(comparison), *_notes(comparison)])
    facts = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                    for k, v in (meta or {}).items())
    verdict = "ok" if comparison.recommendation else "none"
    advice = html.escape(recommendation_line(comparison))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>qpipe comparison: {html.escape(comparison.baseline)}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 12px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 6px; text-align: left; }}
th {{ background: #f3f3f3; }}
.recommendation {{ font-size: 16px; padding: 0.6em; border-left: 4px solid #2a7; }}
.recommendation.none {{ border-color: #c44; }}
figure.plot {{ display: inline-block; margin: 1em; vertical-align: top; }}
</style></head><body>
<h1>qpipe comparison: {html.escape(comparison.baseline)}</h1>
<p class="recommendation {verdict}" id="recommendation">{advice}</p>
<table id="comparison"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
<ul>{notes}</ul>
<section id="plots">{figures}</section>
<table id="meta">{facts}</table>
</body></html>
"""


def write(comparison: Comparison, directory: Path, meta: dict[str, str] | None = None
          ) -> list[Path]:
    """All four files into ``directory``, replaced as a whole once complete."""
    import json

    with atomic_dir(directory) as tmp:
        (tmp / "report.html").write_text(html_page(comparison, meta))
        (tmp / "comparison.md").write_text(markdown(comparison))
        (tmp / "comparison.csv").write_text(csv_text(comparison))
        (tmp / "comparison.json").write_text(json.dumps(
            {**comparison.as_dict(), "meta": meta or {}}, indent=2, default=str))
    return [directory / name for name in FILES]

