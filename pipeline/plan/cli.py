"""``qpipe plan``: weight and KV-cache memory and concurrency for a model on an accelerator.

Reads the model's ``config.json`` only (no weights): a local directory or file, a config shipped
under ``configs/models/``, or a Hugging Face hub id (through ``huggingface_hub``, if installed and
reachable). Prints a table, one JSON object (``--json``) and/or a PNG plot (``--plot PATH``).
The arithmetic is in :mod:`pipeline.capacity`; see docs/planner.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.core.errors import PlanError
from pipeline.core.paths import CONFIGS_DIR, PROJECT_ROOT
from pipeline.plan import capacity
from pipeline.plan.accelerators import GIB, get_accelerator
from pipeline.plan.capacity import CapacityPlan, PlanSettings

MODELS_DIR = CONFIGS_DIR / "models"
DEFAULT_RESERVE_GB = 2.0  # activations at the profiled batch, CUDA graphs, NCCL/cuBLAS workspaces
DEFAULT_PREFIX = 1024  # a system prompt plus tool definitions; at most half the context
GB = 10**9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model and workload")
    model.add_argument("--model", required=True,
                       help="a directory or config.json, a name under configs/models/ "
                            "(gpt-oss-120b, llama-3.1-70b, smollm2-135m) or a hub id")
    model.add_argument("--context", type=int, default=8192,
                       help="tokens a typical request holds (default 8192)")
    model.add_argument("--max-context", type=int, default=None,
                       help="tokens each request may reach (vLLM's max_model_len; "
                            "default: the model's max_position_embeddings)")
    model.add_argument("--clamp-context", action="store_true",
                       help="plan at the model's maximum when a context is longer, not an error")
    model.add_argument("--prefix", type=int, default=None,
                       help=f"tokens of a prefix all requests share, stored once (default "
                            f"{DEFAULT_PREFIX:,}, at most half of --context)")
    model.add_argument("--weights", default="bf16", choices=capacity.WEIGHT_PRECISIONS,
                       help="the precision planned for (default bf16; all are shown)")
    model.add_argument("--quantize", default="auto", choices=capacity.QUANTIZE_SCOPES,
                       help="what a precision converts: experts (MoE experts only, as gpt-oss "
                            "ships), linear (all linear layers but router and lm_head), auto "
                            "(experts for MoE models, else linear; default)")
    model.add_argument("--int4-group-size", type=int, default=128,
                       help="int4: inputs per bf16 scale (default 128)")
    model.add_argument("--int4-asymmetric", action="store_true",
                       help="int4: add a 4-bit zero point per group")
    model.add_argument("--kv-dtype", default="bf16", choices=tuple(capacity.KV_DTYPE_BYTES),
                       help="KV cache element type (default bf16; fp8 = 1 byte)")

    device = parser.add_argument_group("accelerator and engine")
    device.add_argument("--gpu", default="h100-80gb",
                        help="a preset in configs/accelerators/ (default h100-80gb)")
    memory = device.add_mutually_exclusive_group()
    memory.add_argument("--memory-gb", type=float, help="device memory in GB (10^9 B), no preset")
    memory.add_argument("--memory-gib", type=float, help="device memory in GiB (2^30 B), no preset")
    device.add_argument("--utilization", type=float, default=0.9,
                        help="fraction of the memory the engine may use "
                             "(vLLM's --gpu-memory-utilization, default 0.9)")
    device.add_argument("--reserve-gb", type=float, default=DEFAULT_RESERVE_GB,
                        help=f"memory kept for activations and runtime, GB "
                             f"(default {DEFAULT_RESERVE_GB})")
    budget = device.add_mutually_exclusive_group()
    budget.add_argument("--kv-budget-gb", type=float,
                        help="KV cache memory in GB, given directly (memory, utilisation, "
                             "weights and reserve are then not subtracted)")
    budget.add_argument("--kv-budget-gib", type=float,
                        help="the same in GiB (e.g. vLLM CPU's VLLM_CPU_KVCACHE_SPACE)")
    device.add_argument("--block-size", type=int, default=None,
                        help="KV block size in tokens (default: the preset's, 16 as on vLLM "
                             "GPUs; vLLM CPU uses 128)")
    device.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="vLLM's scheduler budget, for its sliding-window concurrency "
                             "(default 2048)")

    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object, no table")
    out.add_argument("--plot", type=Path, metavar="PATH",
                     help="write a PNG of concurrency against context length per precision")


# --- model config ------------------------------------------------------------------------------
def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise PlanError(f"{path}: cannot read the model config: {err.strerror or err}") from err
    except json.JSONDecodeError as err:
        raise PlanError(f"{path}: not valid JSON (line {err.lineno}): {err.msg}") from err
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected a JSON object (a Hugging Face config.json).")
    return data


def _shown(path: Path) -> str:
    """``path`` relative to the project when inside it (shorter to read)."""
    try:
        return str(path.resolve().relative_to(PROJECT_ROOT))
    except ValueError:
        return str(path)


def shipped_models() -> list[str]:
    return sorted(p.parent.name for p in MODELS_DIR.glob("*/config.json"))


def _from_hub(repo_id: str) -> tuple[Path | None, str]:
    """Download ``config.json`` only; ``(None, why)`` when the hub cannot be used."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return None, "huggingface_hub is not installed"
    try:
        return Path(hf_hub_download(repo_id, "config.json")), ""
    except Exception as err:  # offline, unknown repo, gated repo: all mean "not from the hub"
        return None, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def resolve_model(spec: str) -> tuple[str, str, dict[str, Any]]:
    """``(name, where it came from, config dict)`` for ``--model``."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PlanError(f"{path} has no config.json; point --model at a model directory.")
        path = path / "config.json"
    if path.is_file():
        name = path.parent.name if path.name == "config.json" else path.stem
        return name, _shown(path), _read_config(path)
    shipped = MODELS_DIR / spec / "config.json"
    if "/" not in spec and shipped.is_file():
        return spec, _shown(shipped), _read_config(shipped)
    parts = spec.split("/")
    if len(parts) == 2 and all(parts) and not spec.startswith((".", "~")):
        downloaded, why = _from_hub(spec)
        if downloaded is not None:
            return parts[1], f"hub:{spec}", _read_config(downloaded)
        same_name = MODELS_DIR / parts[1].lower() / "config.json"
        if same_name.is_file():
            print(f"qpipe plan: hub not used ({why}); using the shipped {same_name}",
                  file=sys.stderr)
            return parts[1].lower(), _shown(same_name), _read_config(same_name)
        raise PlanError(
            f"cannot get {spec}'s config.json from the Hugging Face hub ({why}). Download its "
            "config.json and pass its path, or use a shipped config: "
            f"{', '.join(shipped_models())}."
        )
    raise PlanError(
        f"no model {spec!r}: not a file or directory, not a shipped config "
        f"({', '.join(shipped_models())}) and not a hub id (owner/name)."
    )


def _fit_context(tokens: int, option: str, max_pos: int | None, clamp: bool) -> tuple[int, str]:
    if max_pos is None or tokens <= max_pos:
        return tokens, ""
    if not clamp:
        raise PlanError(
            f"{option} {tokens:,} is longer than the model's maximum context "
            f"(max_position_embeddings = {max_pos:,}); pass a shorter one, or --clamp-context "
            "to plan at the maximum."
        )
    return max_pos, f"{option} {tokens:,} clamped to the model's maximum {max_pos:,}."


# --- the stage ---------------------------------------------------------------------------------
def build_plan(args: argparse.Namespace) -> tuple[dict[str, Any], CapacityPlan]:
    """Resolve the inputs of ``args`` and plan; returns ``(inputs for the report, plan)``."""
    name, source, config = resolve_model(args.model)
    try:
        arch = capacity.parse_architecture(config)
    except PlanError as err:
        raise PlanError(f"{source}: {err}") from err

    if args.memory_gb is not None or args.memory_gib is not None:
        memory = int(args.memory_gb * GB) if args.memory_gb is not None else int(
            args.memory_gib * GIB)
        if memory <= 0:
            raise PlanError("--memory-gb/--memory-gib must be positive.")
        accelerator, description, preset_block = "custom", "memory given on the command line", 16
    else:
        preset = get_accelerator(args.gpu)
        accelerator, description = preset.name, preset.description
        memory, preset_block = preset.memory_bytes, preset.block_size
    kv_budget = None
    if args.kv_budget_gb is not None:
        kv_budget = int(args.kv_budget_gb * GB)
    elif args.kv_budget_gib is not None:
        kv_budget = int(args.kv_budget_gib * GIB)
    if kv_budget is not None and kv_budget <= 0:
        raise PlanError(f"the KV budget must be positive, not {kv_budget / GB:g} GB.")

    notes = []
    max_pos = arch.max_position_embeddings
    max_context = args.max_context if args.max_context is not None else max_pos
    if max_context is None:
        raise PlanError(f"{source} has no max_position_embeddings; pass --max-context.")
    max_context, note_max = _fit_context(max_context, "--max-context", max_pos, args.clamp_context)
    context, note_ctx = _fit_context(args.context, "--context", max_pos, args.clamp_context)
    notes += [n for n in (note_ctx, note_max) if n]
    prefix = args.prefix if args.prefix is not None else min(DEFAULT_PREFIX, context // 2)

    settings = PlanSettings(
        weights=args.weights, quantize=args.quantize, kv_dtype=args.kv_dtype,
        context=context, max_context=max_context, prefix=prefix,
        block_size=args.block_size if args.block_size is not None else preset_block,
        memory_bytes=memory, utilization=args.utilization,
        reserve_bytes=int(args.reserve_gb * GB), kv_budget_bytes=kv_budget,
        int4_group_size=args.int4_group_size, int4_asymmetric=args.int4_asymmetric,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    plan = capacity.plan_capacity(arch, settings)
    if notes:
        plan = replace(plan, notes=(*notes, *plan.notes))
    inputs = {"model": name, "source": source, "accelerator": accelerator,
              "accelerator_description": description}
    return inputs, plan


def run(args: argparse.Namespace) -> int:
    inputs, plan = build_plan(args)
    if args.plot is not None:
        write_plot(plan, inputs, args.plot)
    if args.json:
        print(json.dumps(report(plan, inputs), indent=2))
    else:
        print(format_table(plan, inputs))
        if args.plot is not None:
            print(f"\nplot: {args.plot}")
    return 0


# --- output ------------------------------------------------------------------------------------
def _usable(plan: CapacityPlan) -> int:
    s = plan.settings
    return int((s.memory_bytes or 0) * s.utilization)


def budget_left(plan: CapacityPlan, precision: str) -> int:
    """KV memory left with ``precision``'s weights (negative: short by that much)."""
    weights = plan.weights[precision].total_bytes
    return _usable(plan) - weights - plan.settings.reserve_bytes


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
    lines = [
        f"qpipe plan: {inputs['model']}  ({inputs['source']})",
        f"  model        {arch.describe()}; {arch.params / 1e9:,.2f} B parameters{ships}",
        f"  accelerator  {inputs['accelerator']} ({inputs['accelerator_description']}): "
        f"{memory / GIB:,.2f} GiB = {_gb(memory)}",
        "",
        f"  {'weights':<7}{'size':>11}  {'KV left':>10}  converted (the rest stays bf16)",
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
        lines.append(f"{mark} {precision:<7}{size:>11}  {left_text:>10}  {converted}")
    chosen = plan.weights[s.weights]
    tied = "" if "lm_head" in arch.module_names else " (lm_head tied to the embeddings)"
    lines.append(f"  stays bf16 with {s.weights}: {', '.join(chosen.high_precision_modules)}{tied}")

    full = sum(1 for layer in arch.kv_layers if layer.window is None)
    windows = sorted({layer.window for layer in arch.kv_layers if layer.window})
    lines += ["", f"KV cache ({s.kv_dtype}, blocks of {s.block_size} tokens)",
              f"  per token, long context    {plan.kv_bytes_per_token:>12,} B "
              f"({plan.kv_bytes_per_token / 1024:,.1f} KiB)  {full} layers keep every token"]
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
    else:
        lines.append(
            f"  {_gb(memory)} x {s.utilization:g} = {_gb(_usable(plan))} - "
            f"{_gb(plan.weight_bytes)} weights ({s.weights}) - {_gb(s.reserve_bytes)} reserve "
            f"= {_gb(plan.kv_budget_bytes)} for the KV cache"
        )
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
