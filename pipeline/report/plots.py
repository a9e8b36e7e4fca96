"""The report's plots, drawn with matplotlib as inline SVG: the HTML file is one file that opens
anywhere (MLflow's artifact viewer included) without a network."""

from __future__ import annotations

import io
from typing import Any

from pipeline.core.artifacts import EMULATED, Comparison
from pipeline.core.variant import BASELINE


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
    suites = comparison.suites
    meaningful = [s for s in suites if any(r.suites[s].meaningful for r in comparison.rows
                                           if s in r.suites)]
    return meaningful[0] if meaningful else None


def plot_pareto(comparison: Comparison) -> tuple[str, str]:
    """Recovery (first meaningful suite, with its interval) against speedup."""
    plt = _pyplot()
    suite = _primary_suite(comparison)
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = 0
    for row in comparison.rows:
        fig_s = row.suites.get(suite or "")
        if row.name == BASELINE:
            if row.headline:
                ax.scatter([1.0], [100.0], marker="*", s=120, color="black", zorder=3)
                ax.annotate("baseline", (1.0, 100.0), textcoords="offset points", xytext=(6, 4))
            continue
        if row.speedup is None or fig_s is None or fig_s.recovery_pct is None:
            continue
        y, low, high = fig_s.recovery_pct, fig_s.ci_low, fig_s.ci_high
        x = row.speedup
        found = row.headline.speedup
        x_low = found.low if found and found.low is not None else x
        x_high = found.high if found and found.high is not None else x
        other = "" if row.comparable else ", other run: not compared"
        ax.errorbar([x], [y], yerr=[[y - low], [high - y]], xerr=[[x - x_low], [x_high - x]],
                    fmt="o" if row.comparable else "x", capsize=4, alpha=1 if row.comparable
                    else 0.5, label=f"{row.name} (gate {row.gate_status}{other})")
        label = row.name + (" [emulated]" if fig_s.backend == EMULATED else "") + (
            " (other run)" if not row.comparable else "")
        ax.annotate(label, (row.speedup, y), textcoords="offset points", xytext=(6, 4))
        drawn += 1
    ax.axhline(100, color="grey", lw=0.6, ls=":")
    ax.set_xlabel(f"speedup vs baseline (output tok/s, concurrency {comparison.load_point}), "
                  "with its interval")
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
    paged = [r.plan.planned_max_concurrency_paged if r.plan else 0 for r in comparison.rows]
    worst = [r.plan.planned_max_concurrency_worst_case if r.plan else 0
             for r in comparison.rows]
    xs = range(len(names))
    right.bar([x - 0.2 for x in xs], paged, width=0.4, label=f"paged ({t.context:,} tokens)")
    right.bar([x + 0.2 for x in xs], worst, width=0.4,
              label=f"worst case ({t.max_context:,} reserved)")
    right.set_xticks(list(xs), names)
    right.set_ylabel("max concurrent requests (planned)")
    right.set_title(f"Planned concurrency on {comparison.planned_on}")
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
            r = t.primary()
            if r is not None and r.recovery_pct is not None and r.ci_low is not None \
                    and r.ci_high is not None:
                mark = " [emulated]" if t.backend == EMULATED else ""
                entries.append((f"{row.name}: {task}{mark}", r.recovery_pct, r.ci_low,
                                r.ci_high))
    fig, ax = plt.subplots(figsize=(6, 0.3 * len(entries) + 1.2))
    for i, (_, y, low, high) in enumerate(entries):
        ax.errorbar([y], [i], xerr=[[y - low], [high - y]], fmt="o", capsize=3)
    ax.set_yticks(range(len(entries)), [e[0] for e in entries])
    ax.axvline(100, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("recovery (%), 95% interval")
    ax.set_title("Recovery per task")
    if not entries:
        ax.text(0.5, 0.5, "no meaningful task recovery yet (make eval)", transform=ax.transAxes,
                ha="center")
    return "tasks", _svg(fig)


def plot_capacity(comparison: Comparison) -> tuple[str, str]:
    """The capacity search: each load's SLO attainment with its bounds against the target,
    the fitted curve, the knee (dotted) and its 90% interval (shaded) (first panel), then each
    bounded latency percentile against load with the objective drawn as a line."""
    plt = _pyplot()
    found = [(r, r.capacity) for r in comparison.rows
             if r.serving == "ok" and r.capacity is not None and r.capacity.points]
    rows = [r for r, _ in found]
    bounds = found[0][1].bounds if found else {}
    panels = 1 + len(bounds)
    fig, axes = plt.subplots(1, panels, figsize=(4 * panels, 3.2), squeeze=False)
    ax = axes[0][0]
    for row, cap in found:
        points = {int(c): p for c, p in cap.points.items()}
        xs = sorted(points)
        ys = [points[c].attainment for c in xs]
        err = [[y - points[c].low for c, y in zip(xs, ys, strict=True)],
               [points[c].high - y for c, y in zip(xs, ys, strict=True)]]
        line = ax.errorbar(xs, ys, yerr=err, marker="o", capsize=2, ls="none",
                           label=row.name)[0]
        fitted = [(c, p.fitted) for c, p in sorted(points.items()) if p.fitted is not None]
        if fitted:  # the curve the knee was fitted on, over the loads it was fitted over
            ax.plot([c for c, _ in fitted], [f for _, f in fitted], color=line.get_color(),
                    lw=1)
        low, high = cap.capacity_low, cap.capacity_high
        if cap.knee is not None:
            ax.axvspan(low if low is not None else min(xs), high if high is not None
                       else max(xs), color=line.get_color(), alpha=0.12)
            ax.axvline(cap.knee, color=line.get_color(), lw=1, ls=":")
    if found:
        target = found[0][1].target
        ax.axhline(target, color="#c44", lw=1, ls="--", label=f"target {target:.0%}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency (dotted: the knee; shaded: its 90% interval)")
    ax.set_ylabel("requests within the objective (fit: line)")
    ax.set_title("SLO attainment against load")
    if rows:
        ax.legend(fontsize=6)
    for ax, (key, bound) in zip(axes[0][1:], bounds.items(), strict=False):
        for row, cap in found:
            curve = {int(c): v for c, v in cap.curve.items() if key in v}
            points = sorted(curve)
            line = ax.plot(points, [curve[p][key] for p in points], marker="o",
                           label=row.name)[0]
            best = cap.slo_max_concurrency
            if best in curve:
                ax.scatter([best], [curve[best][key]], s=90, facecolors="none",
                           edgecolors=line.get_color(), zorder=3)
        ax.axhline(bound, color="#c44", lw=1, ls="--", label=f"objective {bound:g} ms")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(f"{key} (median of the runs)")
        ax.set_title(f"{key} against load")
        ax.legend(fontsize=6)
    if not rows:
        axes[0][0].text(0.5, 0.5, "no capacity search measured (the capacity workload)",
                        transform=axes[0][0].transAxes, ha="center")
    return "capacity", _svg(fig)


def plot_size(comparison: Comparison) -> tuple[str, str]:
    """The memory Pareto front: recovery against weight bytes (left), and measured held-out KL
    against weight bytes with the sensitivity model's prediction beside it (right)."""
    plt = _pyplot()
    suite = _primary_suite(comparison)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.8))
    fig.subplots_adjust(wspace=0.38)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, row in enumerate(comparison.rows):
        mb = row.weight_bytes / 1e6
        color = colors[i % len(colors)]
        fig_s = row.suites.get(suite or "")
        if row.name == BASELINE:
            left.scatter([mb], [100.0], marker="*", s=120, color="black", zorder=3)
            left.annotate("baseline", (mb, 100.0), textcoords="offset points", xytext=(-30, 8))
        elif fig_s is not None and fig_s.recovery_pct is not None:
            y, low, high = fig_s.recovery_pct, fig_s.ci_low, fig_s.ci_high
            left.errorbar([mb], [y], yerr=[[y - low], [high - y]], fmt="o", capsize=4,
                          color=color, label=row.name)
        measured = row.divergence.get("kl_div_mean")
        if measured is not None and row.name != BASELINE:
            right.scatter([mb], [measured], color=color, label=f"{row.name} measured")
        if row.search is not None:
            right.scatter([mb], [row.search.predicted_kl], facecolors="none",
                          edgecolors=color, s=70, label=f"{row.name} predicted")
    left.set_xlabel("weights (MB, measured on disk)")
    left.set_ylabel(f"recovery % ({suite or 'no suite'}, 95% interval)")
    left.set_title("Recovery against weight memory")
    right.set_xlabel("weights (MB, measured on disk)")
    right.set_ylabel("KL per token on held-out text (nats)")
    right.set_yscale("log")
    right.set_title("Damage: measured (filled) vs predicted (hollow)")
    for ax in (left, right):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    return "size", _svg(fig)


PLOTS = (plot_pareto, plot_size, plot_memory, plot_latency, plot_capacity, plot_tasks)
