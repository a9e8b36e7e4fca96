"""The terminal view of a bench run: one line per model at each workload's headline point."""

from __future__ import annotations

from pipeline.bench.workloads import Workload
from pipeline.core import tracking
from pipeline.core.artifacts import BenchSummary, ModelBench

# Which hardware serves a format that this machine's engine rejected.
SERVED_ON = {
    "mxfp4-pack-quantized": "NVIDIA Blackwell GPUs (native MXFP4); Hopper through vLLM's "
                            "Marlin/emulation kernels",
    "nvfp4-pack-quantized": "NVIDIA Blackwell GPUs (native NVFP4); Hopper/Ada through Marlin",
    "float-quantized": "GPUs with FP8 support (Ada, Hopper, Blackwell)",
}


def _line(name: str, entry: ModelBench, workload: Workload) -> str | None:
    if entry.status == "failed":
        return f"  {name:10s} FAILED: {entry.reason}\n  {'':10s} log: {entry.log or '-'}"
    if entry.status != "ok":
        where = SERVED_ON.get(entry.format, "a GPU build of vLLM")
        return (f"  {name:10s} unsupported on this hardware ({entry.format}): {entry.reason}\n"
                f"  {'':10s} served on: {where}")
    data = entry.workloads.get(workload.name)
    stats = data.points.get(workload.headline) if data else None
    if not data or not stats:
        return None
    tps = (f"{stats[tracking.OUTPUT_TOKENS_PER_S]:7.1f} "
           f"[{stats[tracking.OUTPUT_TOKENS_PER_S + '_min']:.1f}-"
           f"{stats[tracking.OUTPUT_TOKENS_PER_S + '_max']:.1f}]")
    spread = f"{stats.get(tracking.OUTPUT_TOKENS_PER_S + '_rel_spread', 0):.0%}"
    speed = (f"{stats[tracking.SPEEDUP]:.2f}x [{stats[tracking.SPEEDUP + '_min']:.2f}-"
             f"{stats[tracking.SPEEDUP + '_max']:.2f}]") if tracking.SPEEDUP in stats \
        else "(reference)"
    kv = int(entry.kv.get(tracking.KV_CACHE_TOKENS, 0))
    return (f"  {name:10s} {tps:>22s} {spread:>7s} {speed:>18s} "
            f"{stats[tracking.TTFT_MS_P50]:7.0f}ms {stats[tracking.TTFT_MS_P99]:7.0f}ms "
            f"{stats[tracking.ITL_MS_P50]:6.1f}ms {kv:>10,} {data.prefix_cache_hit_rate:>10.1%}")


def format_table(summary: BenchSummary, loads: list[Workload]) -> str:
    lines = []
    for workload in loads:
        head = workload.headline
        caching = "prefix caching on vs off" if workload.compare_prefix_caching else \
            "prefix caching off: cold, distinct prompts"
        lines.append(f"\n{workload.name} (concurrency {head}, {workload.num_prompts(head)} "
                     f"requests x {workload.output_len} tokens out; {caching}; median of "
                     f"{workload.repeats} repeats [min-max], spread = (max - min) / median)")
        lines.append(f"  {'model':10s} {'out tok/s':>22s} {'spread':>7s} {'speedup':>18s} "
                     f"{'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} {'KV tokens':>10s} "
                     f"{'cache hits':>10s}")
        lines += [line for name, entry in summary.models.items() if workload.runs_on(name)
                  if (line := _line(name, entry, workload)) is not None]
        for name, entry in summary.models.items():
            data = entry.workloads.get(workload.name)
            if data is not None and data.prefix_cache_ttft_speedup is not None:
                lines.append(
                    f"  {name:10s} prefix cache: hit rate {data.prefix_cache_hit_rate:.1%} of "
                    f"prompt tokens (the shared prefix allows "
                    f"{data.prefix_cache_expected_hit_rate or 0:.1%}), TTFT p50 "
                    f"{data.prefix_cache_ttft_speedup:.2f}x faster than with caching off")
    if summary.speedup_pairing:
        lines.append(f"\nspeedup: median of the per-repeat ratios [min-max], "
                     f"{summary.speedup_pairing}")
    return "\n".join(lines)
