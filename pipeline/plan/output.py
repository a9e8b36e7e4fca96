"""What ``qpipe plan`` prints: the table, the JSON object and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.core.errors import PlanError
from pipeline.plan import capacity
from pipeline.plan.accelerators import GIB
from pipeline.plan.capacity import CapacityPlan

GB = 10**9


# --- output ------------------------------------------------------------------------------------
def _usable(plan: CapacityPlan) -> int:
    s = plan.settings
    return int((s.memory_bytes or 0) * s.utilization)


def budget_left(plan: CapacityPlan, precision: str) -> int:
    """KV memory left with ``precision``'s weights (negative: short by that much); with
    tensor/pipeline parallelism, per device times the devices each token's cache is split over."""
    s = plan.settings
    left = _usable(plan) - s.per_device(plan.weights[precision].total_bytes) - s.reserve_bytes
    return left * plan.arch.kv_shards(s.tensor_parallel, s.pipeline_parallel) if left > 0 \
        else left


def report(plan: CapacityPlan, inputs: dict[str, Any]) -> dict[str, Any]:
    """The JSON object: the metrics by name, then the breakdown and the inputs."""
    s = plan.settings
    chosen = plan.weights[s.weights]
    return {
        **plan.metrics(),
        "weights_by_precision": {p: w.total_bytes for p, w in plan.weights.items()},
        "quantized_modules": list(chosen.quantized_modules),
        "high_precision_modules": list(chosen.high_precision_modules),
        "weight_bytes_by_module": chosen.by_module,
        "parameters": plan.arch.params,
        "parameters_by_module": {m.name: m.params for m in plan.arch.modules},
        "kv_bytes_per_token_all_layers": plan.kv_bytes_per_token_all_layers,
        "kv_bytes_per_request_max_context": plan.kv_bytes_per_request_max,
        "shared_prefix_bytes": plan.shared_prefix_bytes,
        "vllm_num_blocks": plan.vllm.num_blocks,
        "inputs": {
            **inputs,
            "architecture": plan.arch.describe(),
            "checkpoint_quantization": plan.arch.checkpoint_quantization,
            "memory_bytes": s.memory_bytes,
            "utilization": s.utilization,
            "reserve_bytes": s.reserve_bytes,
            "kv_budget_given": s.kv_budget_bytes is not None,
            "weights": s.weights,
            "quantize": s.quantize,
            "int4_group_size": s.int4_group_size,
            "int4_asymmetric": s.int4_asymmetric,
            "kv_dtype": s.kv_dtype,
            "context": s.context,
            "max_context": s.max_context,
            "prefix": s.prefix,
            "block_size": s.block_size,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "tensor_parallel": s.tensor_parallel,
            "pipeline_parallel": s.pipeline_parallel,
        },
        "notes": list(plan.notes),
    }


def _gb(n: float) -> str:
    return f"{n / GB:,.2f} GB"


def _size(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if abs(n) < GB else _gb(n)


def format_table(plan: CapacityPlan, inputs: dict[str, Any]) -> str:
    """The human-readable report."""
    s, arch = plan.settings, plan.arch
    given = s.kv_budget_bytes is not None
    memory = s.memory_bytes or 0
    ships = f"; checkpoint ships {arch.checkpoint_quantization}" if (
        arch.checkpoint_quantization) else ""
    width = max(7, *(len(p) for p in plan.weights))  # the precision column (fp8-block: 9)
    lines = [
        f"qpipe plan: {inputs['model']}  ({inputs['source']})",
        f"  model        {arch.describe()}; {arch.params / 1e9:,.2f} B parameters{ships}",
        f"  accelerator  {inputs['accelerator']} ({inputs['accelerator_description']}): "
        f"{memory / GIB:,.2f} GiB = {_gb(memory)}",
        "",
        f"  {'weights':<{width}}{'size':>11}  {'KV left':>10}  converted (the rest stays bf16)"
        + (f"; KV left over the {s.devices} devices" if s.devices > 1 else ""),
    ]
    for precision, estimate in plan.weights.items():
        left = budget_left(plan, precision)
        left_text = f"{left / GB:.2f} GB" if left > 0 else "no fit"
        converted = ", ".join(estimate.quantized_modules) or "none"
        if precision == "int4":
            kind = "asymmetric" if s.int4_asymmetric else "symmetric"
            converted += f" (group {s.int4_group_size}, {kind})"
        mark = ">" if precision == s.weights else " "
        size = f"{estimate.total_bytes / GB:,.2f} GB"
        lines.append(f"{mark} {precision:<{width}}{size:>11}  {left_text:>10}  {converted}")
    chosen = plan.weights[s.weights]
    tied = "" if "lm_head" in arch.module_names else " (lm_head tied to the embeddings)"
    lines.append(f"  stays bf16 with {s.weights}: {', '.join(chosen.high_precision_modules)}{tied}")

    full = sum(1 for layer in arch.kv_layers if layer.window is None)
    windows = sorted({layer.window for layer in arch.kv_layers if layer.window})
    block = plan.vllm.block_size or s.block_size
    raised = f", raised from {s.block_size} to hold a state page" if block != s.block_size else ""
    lines += ["", f"KV cache ({s.kv_dtype}, blocks of {block} tokens{raised})",
              f"  per token, long context    {plan.kv_bytes_per_token:>12,} B "
              f"({plan.kv_bytes_per_token / 1024:,.1f} KiB)  {full} layers keep every token"]
    if arch.state_layers:
        state = max(x.bytes for x in arch.state_layers)
        lines.append(
            f"  recurrent state            {len(arch.state_layers)} layers x {_size(state)}, "
            f"each page padded to {_size(plan.vllm.page_size_bytes)}: "
            f"{_size(len(arch.state_layers) * plan.vllm.page_size_bytes)} a request, whatever "
            "its length" + (" (with prefix caching vLLM keeps 2-3 pages a layer)"
                            if s.prefix_caching else ""))
    if windows:
        lines.append(f"  per token, all layers      {plan.kv_bytes_per_token_all_layers:>12,} B "
                     f"({plan.kv_bytes_per_token_all_layers / 1024:,.1f} KiB)  until the "
                     f"window ({'/'.join(map(str, windows))} tokens) fills")
    lines += [
        f"  per request at {s.context:>9,} {_size(plan.kv_bytes_per_request):>14}",
        f"  per request at {s.max_context:>9,} {_size(plan.kv_bytes_per_request_max):>14}",
        f"  shared prefix  {s.prefix:>9,} {_size(plan.shared_prefix_bytes):>14}  stored once",
        "",
        "budget",
    ]
    if given:
        lines.append(f"  {_gb(plan.kv_budget_bytes)} for the KV cache, given directly")
    elif s.devices > 1:
        shards = arch.kv_shards(s.tensor_parallel, s.pipeline_parallel)
        lines.append(
            f"  per device (TP {s.tensor_parallel} x PP {s.pipeline_parallel}): {_gb(memory)} x "
            f"{s.utilization:g} = {_gb(_usable(plan))} - {_gb(s.per_device(plan.weight_bytes))} "
            "of the weights "
            f"({s.weights}) - {_gb(s.reserve_bytes)} reserve = "
            f"{_gb(plan.kv_budget_bytes / shards)} of KV cache, each token's split over {shards} "
            f"device{'s' if shards > 1 else ''}: as {_gb(plan.kv_budget_bytes)} on one")
    else:
        lines.append(
            f"  {_gb(memory)} x {s.utilization:g} = {_gb(_usable(plan))} - "
            f"{_gb(plan.weight_bytes)} weights ({s.weights}) - {_gb(s.reserve_bytes)} reserve "
            f"= {_gb(plan.kv_budget_bytes)} for the KV cache"
        )
    smallest = inputs.get("smallest_tp")
    if smallest is not None:
        lines.append(
            f"  smallest tensor-parallel size on {inputs['accelerator']} for the {s.weights} "
            f"weights plus one {s.max_context:,}-token request: "
            + (f"TP={smallest}" if smallest else "none up to 64 (a smaller precision, a larger "
               "device, or pipeline stages: PP=)"))
    lines += [
        f"  vLLM would report: KV cache size {plan.vllm.kv_cache_tokens:,} tokens; maximum "
        f"concurrency for {s.max_context:,} tokens per request {plan.vllm.max_concurrency:.2f}x",
        "",
        "concurrent requests",
        f"  {f'worst case: each reserves {s.max_context:,} tokens':<52}{plan.worst_case:>8,}",
        f"  {f'paged: each holds {s.context:,} tokens':<52}{plan.paged:>8,}",
        f"  {f'paged, {s.prefix:,}-token prefix shared':<52}{plan.paged_shared_prefix:>8,}",
        "",
        "assumptions: "
        + ("KV budget given directly; " if given else
           f"utilisation {s.utilization:g} of the memory CUDA reports; reserve "
           f"{_gb(s.reserve_bytes)} for activations, CUDA graphs and runtime; ")
        + f"block size {s.block_size}; sliding-window layers hold at most their window; "
        "weights as the checkpoint format stores them (kernels may pad); GB = 10^9 bytes.",
    ]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def plot_contexts(max_context: int, context: int) -> list[int]:
    """Context lengths for the plot: powers of two from 512 up to max_context, plus the two."""
    points = {2**k for k in range(9, 40) if 2**k <= max_context}
    return sorted(points | {context, max_context})


def write_plot(plan: CapacityPlan, inputs: dict[str, Any], path: Path) -> None:
    """PNG of paged concurrency against context length, one line per weight precision."""
    try:
        import matplotlib
    except ImportError as err:
        raise PlanError("--plot needs matplotlib (pip install matplotlib; the pipeline "
                        "environment has it through mlflow).") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = plan.settings
    contexts = plot_contexts(s.max_context, s.context)
    fig, ax = plt.subplots(figsize=(8, 5))
    budgets = ({"any precision": s.kv_budget_bytes} if s.kv_budget_bytes is not None else
               {p: budget_left(plan, p) for p in plan.weights})
    for label, budget in budgets.items():
        if budget <= 0:
            continue
        counts = capacity.concurrency_curve(plan.arch, budget, contexts, s.kv_dtype, s.block_size)
        style = {"linewidth": 2.5} if label == s.weights else {"linewidth": 1.2}
        ax.plot(contexts, [max(c, 0.5) for c in counts], marker="o", markersize=3,
                label=f"{label} ({budget / GB:.1f} GB KV)", **style)
    ax.axvline(s.context, color="grey", linestyle=":", label=f"context {s.context:,}")
    left_out = [label for label, budget in budgets.items() if budget <= 0]
    if left_out:
        ax.plot([], [], " ", label=f"weights do not fit: {', '.join(left_out)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(contexts, [f"{c // 1024}k" if c % 1024 == 0 else f"{c:,}" for c in contexts],
                  fontsize=8)
    ax.set_xlabel("tokens each request holds (at max-context: the worst-case reservation)")
    ax.set_ylabel("concurrent requests (paged)")
    ax.set_title(f"{inputs['model']} on {inputs['accelerator']}: KV {s.kv_dtype}, "
                 f"block {s.block_size}, utilisation {s.utilization:g}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png", dpi=120)
    except OSError as err:
        raise PlanError(f"cannot write the plot to {path}: {err.strerror or err}") from err
    finally:
        plt.close(fig)
