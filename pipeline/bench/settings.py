"""``qpipe bench`` settings (``make bench``): the one source of their defaults."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.core.settings import (
    StageSettings,
    baseline_field,
    force_field,
    overrides,
    recipes_field,
)
from pipeline.serve.settings import EngineSettings

DEFAULT_WORKLOADS = ("chat", "prefix", "capacity")


class BenchSettings(StageSettings):
    baseline: str = baseline_field()
    recipes: tuple[str, ...] = recipes_field("bench")
    workloads: tuple[str, ...] = Field(
        DEFAULT_WORKLOADS, description="workload name in configs/workloads or a YAML file "
        f"(default: {', '.join(DEFAULT_WORKLOADS)})",
        json_schema_extra={"flag": "--workload", "make": "WORKLOAD"})
    repeats: int | None = Field(None, ge=1, description="override every workload's repeats",
                                json_schema_extra={"make": "REPEATS"})
    slo_ttft_ms: float | None = Field(
        None, gt=0, description="TTFT p99 bound (ms) of the capacity search's objective "
        "(default: the workload's slo)", json_schema_extra={"make": "SLO_TTFT_MS"})
    slo_itl_ms: float | None = Field(
        None, gt=0, description="ITL p99 bound (ms) of the capacity search's objective",
        json_schema_extra={"make": "SLO_ITL_MS"})
    reference: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="the unquantized serving every speedup is against: auto (on a CPU "
        "without native bf16 the faster of bfloat16 and float32, probed side by side at the "
        "sweep's headline; else the engine's dtype) or a dtype (bfloat16, float32: that one, "
        "not probed)", json_schema_extra={"make": "REFERENCE"})
    force: bool = force_field("measure again")
    engine: EngineSettings = Field(default_factory=EngineSettings,
                                   json_schema_extra={"nested": True})


# what a campaign may set for its bench stage, each unset by default
BenchOverrides = overrides(BenchSettings, ("workloads", "repeats", "slo_ttft_ms", "slo_itl_ms",
                                           "reference"),
                           "the campaign file's, else each workload's")
