"""``qpipe plan``: weight and KV-cache memory and concurrency for a model on an accelerator.

Reads the model's ``config.json`` only (no weights): a local directory or file, a config shipped
under ``configs/models/``, or a Hugging Face hub id (through ``huggingface_hub``, if installed and
reachable). Prints a table, one JSON object (``--json``) and/or a PNG plot (``--plot PATH``).
The arithmetic is in :mod:`pipeline.plan.capacity`; see docs/planner.md.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.core.errors import PlanError
from pipeline.core.paths import CONFIGS_DIR, shown
from pipeline.plan import capacity
from pipeline.plan.accelerators import GIB, get_accelerator
from pipeline.plan.capacity import CapacityPlan, PlanSettings
from pipeline.plan.output import format_table, report, write_plot
from pipeline.plan.settings import DEFAULT_PREFIX, PlanRequest

MODELS_DIR = CONFIGS_DIR / "models"






GB = 10**9


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
        return name, shown(path), _read_config(path)
    shipped = MODELS_DIR / spec / "config.json"
    if "/" not in spec and shipped.is_file():
        return spec, shown(shipped), _read_config(shipped)
    parts = spec.split("/")
    if len(parts) == 2 and all(parts) and not spec.startswith((".", "~")):
        downloaded, why = _from_hub(spec)
        if downloaded is not None:
            return parts[1], f"hub:{spec}", _read_config(downloaded)
        same_name = MODELS_DIR / parts[1].lower() / "config.json"
        if same_name.is_file():
            print(f"qpipe plan: hub not used ({why}); using the shipped {same_name}",
                  file=sys.stderr)
            return parts[1].lower(), shown(same_name), _read_config(same_name)
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
def build_plan(args: PlanRequest) -> tuple[dict[str, Any], CapacityPlan]:
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
        tensor_parallel=args.tp, pipeline_parallel=args.pp,
    )
    plan = capacity.plan_capacity(arch, settings)
    smallest = None
    if kv_budget is None:
        found = capacity.smallest_tensor_parallel(arch, replace(settings, pipeline_parallel=1))
        smallest = found[0] if found else 0
    if notes:
        plan = replace(plan, notes=(*notes, *plan.notes))
    inputs = {"model": name, "source": source, "accelerator": accelerator,
              "accelerator_description": description, "smallest_tp": smallest}
    return inputs, plan



def run(request: PlanRequest) -> CapacityPlan:
    """``qpipe plan`` / ``make plan``."""
    inputs, plan = build_plan(request)
    if request.plot is not None:
        write_plot(plan, inputs, request.plot)
    if request.as_json:
        print(json.dumps(report(plan, inputs), indent=2))
    else:
        print(format_table(plan, inputs))
        if request.plot is not None:
            print(f"\nplot: {request.plot}")
    return plan
