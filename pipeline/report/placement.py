"""Where the capacity planner places each row: the plan target decided for the machine, the
planner's settings as the servers were started, and the row's planned memory and concurrency
(from the baseline's recorded ``config.json`` in the variant's precision)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pipeline.core import formats
from pipeline.core.artifacts import PlanFigures, PlanTarget, Row
from pipeline.core.errors import PlanError
from pipeline.core.hardware import Profile
from pipeline.plan import capacity
from pipeline.plan.accelerators import detect as detect_accelerator
from pipeline.plan.accelerators import get_accelerator
from pipeline.serve.settings import EngineSettings

MIXED = formats.MIXED  # a searched recipe: formats per layer (planned from its measured bytes)
DEFAULT_PLAN_GPU = "h100-80gb"  # where the planner places variants on a host without a GPU


def resolve_plan_target(target: PlanTarget, prof: Profile) -> tuple[PlanTarget, str]:
    """(the target with ``auto`` decided for the machine ``prof``, a note for the report when
    the plan is not for the card the figures were measured on)."""
    gpu = prof.gpus[0] if prof.target == "cuda" and prof.gpus else None
    if target.memory_gb is not None:
        return target, (f"planned for {target.memory_gb:g} GB" + (
            f"; the figures were measured on {gpu.name}" if gpu else ""))
    if target.gpu != "auto":
        preset = get_accelerator(target.gpu)
        if gpu is None:
            return target, f"planned for {preset.description}; this machine has no GPU"
        here = detect_accelerator(gpu.name, gpu.visible_memory_mib)
        same = here is not None and here.name == preset.name
        return target, "" if same else (f"planned for {preset.description}, not for this "
                                        f"machine's {gpu.name}")
    if gpu is None:
        return target.model_copy(update={"gpu": DEFAULT_PLAN_GPU}), (
            f"planned for {get_accelerator(DEFAULT_PLAN_GPU).description}: this machine has no "
            "GPU (PLAN_GPU= picks another)")
    visible = gpu.visible_memory_mib
    here = detect_accelerator(gpu.name, visible)
    if here is not None:
        return target.model_copy(update={"gpu": here.name}), ""
    if visible:
        what = (f"the MIG slice {gpu.mig_profile} of an {gpu.name}" if gpu.mig_profile else
                f"{gpu.name}, not a preset (configs/accelerators)")
        return target.model_copy(update={"memory_gb": visible * 2**20 / 1e9}), (
            f"planned for {visible * 2**20 / 1e9:.0f} GB: {what}")
    return target.model_copy(update={"gpu": DEFAULT_PLAN_GPU}), (
        f"planned for {DEFAULT_PLAN_GPU}: {gpu.name} has no preset and reports no memory")


def plan_settings(target: PlanTarget, precision: str, group_size: int | None,
                  kv_dtype: str = "bf16", engine: Mapping[str, Any] | None = None,
                  block_size: int | None = None, symmetric: bool = True
                  ) -> capacity.PlanSettings:
    """The planner's settings for one variant on ``target``, with the memory utilisation and
    the tensor / pipeline parallelism its servers were started with (``engine``: a bench run's
    engine settings; none: vLLM's defaults, one device) and ``block_size``, the KV block the
    engine used on that card where it was measured there (else the preset's)."""
    if target.memory_gb is not None:
        memory, block = int(target.memory_gb * 1e9), 16
    else:
        preset = get_accelerator(target.gpu)
        memory, block = preset.memory_bytes, preset.block_size
    served = EngineSettings.from_record(engine or {})
    return capacity.PlanSettings(
        weights=precision, kv_dtype=kv_dtype, context=target.context,
        max_context=target.max_context, memory_bytes=memory, block_size=block_size or block,
        int4_group_size=group_size, int4_asymmetric=not symmetric,
        utilization=served.gpu_memory_utilization,
        tensor_parallel=served.tensor_parallel_size,
        pipeline_parallel=served.pipeline_parallel_size)


def served_as(engine: Mapping[str, Any]) -> str:
    """How the servers were started, where the plan follows them away from the defaults."""
    served, default = EngineSettings.from_record(engine), EngineSettings()
    tp, pp = served.tensor_parallel_size, served.pipeline_parallel_size
    parts = [f"TP {tp} x PP {pp}: weights and KV heads split over {tp * pp} devices"] \
        if tp * pp > 1 else []
    if served.gpu_memory_utilization != default.gpu_memory_utilization:
        parts.append(f"{served.gpu_memory_utilization:.0%} of each device's memory")
    return f"planned as the servers were started: {', '.join(parts)}" if parts else ""


def apply_plan(row: Row, config: dict[str, Any], target: PlanTarget,
                engine: Mapping[str, Any] | None = None, block_size: int | None = None) -> None:
    try:
        if row.precision == MIXED:
            plan, weights = _plan_mixed(row, config, target, engine, block_size)
        else:
            plan = capacity.plan_capacity(config, plan_settings(
                target, row.precision, row.group_size, row.kv_dtype, engine, block_size,
                row.symmetric))
            weights = plan.weight_bytes
    except PlanError as err:  # e.g. the weights do not fit the accelerator
        row.notes.append(f"plan: {err}")
        return
    row.plan = PlanFigures.model_validate({**plan.metrics(), capacity.WEIGHT_BYTES: weights})


def _plan_mixed(row: Row, config: dict[str, Any], target: PlanTarget,
                engine: Mapping[str, Any] | None = None, block_size: int | None = None
                ) -> tuple[capacity.CapacityPlan, int]:
    """A layer-by-layer mix has no one precision: its planned weights are the bf16 plan's
    scaled by the checkpoint's measured ratio to the baseline, and the KV cache gets the rest
    (on each device its share, as plan_capacity counts it)."""
    settings = plan_settings(target, "bf16", 128, row.kv_dtype, engine, block_size)
    bf16 = capacity.plan_capacity(config, settings)
    weights = int(bf16.weight_bytes * row.weight_ratio)
    budget = capacity.kv_budget(settings.memory_bytes or 0, settings.utilization,
                                settings.per_device(weights), settings.reserve_bytes) * \
        bf16.arch.kv_shards(settings.tensor_parallel, settings.pipeline_parallel)
    plan = capacity.plan_capacity(config, dataclasses.replace(settings, kv_budget_bytes=budget))
    row.notes.append("plan: mixed precision, planned with the bf16 weights scaled by the "
                     f"checkpoint's measured {row.weight_ratio:.3f}")
    return plan, weights
