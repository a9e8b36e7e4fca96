"""The terminal view of a bench run: one line per model at each workload's headline point."""

from __future__ import annotations

from pipeline.bench.workloads import Workload
from pipeline.core import formats, tracking
from pipeline.core.artifacts import ESTIMATED, AttainmentPoint, BenchSummary, Capacity, ModelBench

SPEED_METHOD = ("geometric mean of the per-repeat ratios [interval at the look that decided: "
                "t on log ratios, sequential], n repeats; faster / slower when the interval "
                "excludes 1 (a false 'faster' at most 5%: make calibrate), within +-5% when it "
                "lies inside [0.95, 1.05]")


def served_on(compressed: str) -> str:
    """Which hardware serves a compressed-tensors format this machine's engine rejected."""
    rows = formats.by_compressed(compressed)
    return "; ".join(dict.fromkeys(f.served_on for f in rows)) or "a GPU build of vLLM"


def _line(name: str, entry: ModelBench, workload: Workload) -> str | None:
    if entry.status == "failed":
        return f"  {name:10s} FAILED: {entry.reason}\n  {'':10s} log: {entry.log or '-'}"
    if entry.status != "ok":
        where = served_on(entry.format)
        return (f"  {name:10s} unsupported on this hardware ({entry.format}): {entry.reason}\n"
                f"  {'':10s} served on: {where}")
    data = entry.workloads.get(workload.name)
    at = data.points.get(workload.headline) if data else None
    if not data or not at:
        return None
    m = at.metrics
    tps = (f"{m[tracking.OUTPUT_TOKENS_PER_S]:7.1f} "
           f"[{m[tracking.OUTPUT_TOKENS_PER_S + '_min']:.1f}-"
           f"{m[tracking.OUTPUT_TOKENS_PER_S + '_max']:.1f}]")
    spread = f"{m.get(tracking.OUTPUT_TOKENS_PER_S + '_rel_spread', 0):.0%}"
    found = at.speedup
    speed = f"{found.text()} {found.verdict}" if found is not None else "(reference)"
    kv = int(entry.kv.get(tracking.KV_CACHE_TOKENS, 0))
    return (f"  {name:10s} {tps:>22s} {spread:>7s} {speed:>36s} "
            f"{m[tracking.TTFT_MS_P50]:7.0f}ms {m[tracking.TTFT_MS_P99]:7.0f}ms "
            f"{m[tracking.ITL_MS_P50]:6.1f}ms {kv:>10,} {data.prefix_cache_hit_rate:>10.1%}")


def lengths_text(lengths: dict[str, float]) -> str:
    """A prompt file's requests as sent, in one phrase."""
    return (f"{lengths['requests']:.0f} requests sent over all runs; prompt tokens p50 "
            f"{lengths['input_tokens_p50']:.0f} / p90 {lengths['input_tokens_p90']:.0f} / max "
            f"{lengths['input_tokens_max']:.0f}; output tokens p50 "
            f"{lengths.get('output_tokens_p50', 0):.0f} / p90 "
            f"{lengths.get('output_tokens_p90', 0):.0f} / max "
            f"{lengths.get('output_tokens_max', 0):.0f}")


def point_text(concurrency: str | int, point: AttainmentPoint) -> str:
    """``12: 58/60 = 97% (4 runs, fitted 95%)``: a load's attainment over its full runs."""
    where = f"{point.rate:.3g}/s" if point.rate is not None else str(concurrency)
    fitted = f", fitted {point.fitted:.0%}" if point.fitted is not None else ""
    pilots = f" + {point.pilots} pilot" if point.pilots else ""
    return (f"{where}: {point.good}/{point.counted} = {point.attainment:.0%} "
            f"({point.runs} runs{pilots}{fitted})")


def capacity_text(capacity: Capacity) -> str:
    """One model's capacity at the objective, as one line of text."""
    if not capacity.best and not capacity.undecided:
        first = "the lowest rate searched" if capacity.by_rate else "concurrency 1"
        return f"not met even at {first} ({capacity.limited_by})"
    tps = capacity.slo_output_tokens_per_s
    text = capacity.text(" concurrent requests")
    said = [f"{capacity.level:.0%} CI, this session"] if capacity.outcome == ESTIMATED else []
    if capacity.knee is not None and not capacity.by_rate:
        said.append(f"knee at {capacity.knee:.1f}")
    if capacity.bracket:  # where the search looked, not an interval
        def at(level: int) -> str:
            point = capacity.points.get(str(level))
            return f"{point.rate:.3g}" if capacity.by_rate and point is not None and \
                point.rate is not None else str(level)
        said.append(f"searched bracket {at(capacity.bracket[0])}-{at(capacity.bracket[1])}")
    if said:
        text += f" ({'; '.join(said)})"
    if tps is not None:
        text += (f": {capacity.slo_requests_per_s or 0:.2f} req/s, {tps:.1f} out tok/s "
                 f"[{capacity.slo_output_tokens_per_s_min or tps:.1f}-"
                 f"{capacity.slo_output_tokens_per_s_max or tps:.1f}]")
    return f"{text}; limited by {capacity.limited_by}"


def _capacity_lines(summary: BenchSummary, workload: Workload) -> list[str]:
    slo = workload.slo
    assert slo is not None
    searched = [found for e in summary.models.values()
                if workload.name in e.workloads
                and (found := e.workloads[workload.name].capacity) is not None]
    objective = searched[0].objective if searched else slo.describe()
    basis = f" ({searched[0].objective_basis})" if searched and searched[0].objective_basis \
        else ""
    ceiling = workload.search_ceiling or "what each model's KV cache holds"
    arrivals = "Poisson" if workload.burstiness == 1 else f"gamma ({workload.burstiness:g})"
    start = (searched[0].rate_start or workload.rate_start) if searched else 0
    ceiling_rate = (searched[0].rate_ceiling or workload.rate_ceiling) if searched else 0
    searched_how = (f"the {arrivals} arrival rate at which {objective}{basis} "
                    f"(bracketed from {start:.3g} req/s, doubling up to {ceiling_rate:.3g}"
                    if workload.by_rate else
                    f"the max concurrency at which {objective}{basis} (bracketed 1, 2, 4, ... "
                    f"up to {ceiling}")
    wave = "" if workload.by_rate else "; each run's start-up wave not counted"
    lines = [f"\n{workload.name}: {searched_how}; then a grid of 5 loads over the bracket, "
             f"up to {workload.repeats} runs each, extended past an end the knee lies beyond "
             "and finer where the share crosses; the knee of a quasi-binomial logistic fit "
             "over the two loads it crosses between, [90% interval] from the loads shown to "
             "meet and to miss with a random run effect (? : open), coverage measured by "
             "make calibrate; cold, distinct "
             f"prompts{wave})"]
    for name, entry in summary.models.items():
        data = entry.workloads.get(workload.name)
        if entry.status != "ok" or data is None or data.capacity is None:
            if entry.status != "ok":
                lines.append(f"  {name:10s} not measured ({entry.status}: {entry.reason})")
            continue
        visited = "; ".join(point_text(c, p) for c, p in data.capacity.points.items())
        lines.append(f"  {name:10s} {capacity_text(data.capacity)}\n  {'':10s} attainment: "
                     f"{visited}")
    return lines


def format_table(summary: BenchSummary, loads: list[Workload]) -> str:
    lines = []
    for workload in loads:
        if workload.slo is not None:
            lines += _capacity_lines(summary, workload)
            continue
        head = workload.headline
        caching = "prefix caching on vs off" if workload.compare_prefix_caching else \
            "prefix caching off: cold, distinct prompts"
        out = (f"{workload.output_len} tokens out" if workload.output_len
               else "each its own output length")
        looks = workload.looks(summary.target)
        repeats = (f"{looks.first}-{looks.last} repeats (more while a speedup is undecided)"
                   if looks.last > workload.repeats else f"{workload.repeats} repeats")
        lines.append(f"\n{workload.name} (concurrency {head}, {workload.num_prompts(head)} "
                     f"requests x {out}; {caching}; {repeats}: tok/s median [min-max], "
                     "spread = (max - min) / median)")
        lines.append(f"  {'model':10s} {'out tok/s':>22s} {'spread':>7s} {'speedup':>36s} "
                     f"{'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} {'KV tokens':>10s} "
                     f"{'cache hits':>10s}")
        lines += [line for name, entry in summary.models.items() if workload.runs_on(name)
                  if (line := _line(name, entry, workload)) is not None]
        lines += [f"  {name:10s} plan: {note}"
                  for name, entry in summary.models.items() if workload.runs_on(name)
                  for note in (entry.engine.plan_note, entry.engine.plan_check) if note]
        base = summary.models.get("baseline")
        lengths = base.workloads.get(workload.name) if base is not None else None
        if lengths is not None and lengths.lengths:
            lines.append(f"  {lengths_text(lengths.lengths)}")
        for name, entry in summary.models.items():
            data = entry.workloads.get(workload.name)
            if data is not None and data.prefix_cache_ttft_speedup is not None:
                lines.append(
                    f"  {name:10s} prefix cache: hit rate {data.prefix_cache_hit_rate:.1%} of "
                    f"prompt tokens (the shared prefix allows "
                    f"{data.prefix_cache_expected_hit_rate or 0:.1%}), TTFT p50 "
                    f"{data.prefix_cache_ttft_speedup:.2f}x faster than with caching off")
    if summary.speedup_pairing:
        lines.append(f"\nspeedup: {SPEED_METHOD}; {summary.speedup_pairing}")
    if summary.reference:
        lines.append(f"reference: the baseline served in {summary.reference['dtype']} "
                     f"({summary.reference['why']})")
    return "\n".join(lines)
