"""``qpipe plan`` settings (``make plan``): the one source of their defaults, which are the
planner's own (:class:`pipeline.plan.capacity.PlanSettings`) where both have one."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline.core import formats
from pipeline.core.errors import PlanError
from pipeline.core.settings import StageSettings
from pipeline.plan.capacity import KV_DTYPE_BYTES, PlanSettings

_D = PlanSettings()
DEFAULT_RESERVE_GB = _D.reserve_bytes / 1e9  # activations, CUDA graphs, NCCL/cuBLAS workspaces
EMBEDDED_MODEL = "smollm2-135m"  # configs/models/: the embedded baseline's config
DEFAULT_PREFIX = 1024  # a system prompt plus tool definitions; at most half the context
Precision = Literal[formats.WEIGHT_PRECISIONS]  # the format table's weight precisions


class PlanRequest(StageSettings):
    model: str = Field(EMBEDDED_MODEL, description="a directory or config.json, a name under "
                       "configs/models/ (gpt-oss-120b, llama-3.1-70b, smollm2-135m: the embedded "
                       "baseline's, the default) or a hub id",
                       json_schema_extra={"make": "MODEL"})
    context: int = Field(_D.context, ge=1, description="tokens a typical request holds",
                         json_schema_extra={"make": "CONTEXT"})
    max_context: int | None = Field(None, ge=1, description="tokens each request may reach (vLLM's "
                                    "max_model_len; default: the model's "
                                    "max_position_embeddings)",
                                    json_schema_extra={"make": "MAX_CONTEXT"})
    clamp_context: bool = Field(False, description="plan at the model's maximum when a context "
                                "is longer, not an error")
    prefix: int | None = Field(None, ge=0, description=f"tokens of a prefix all requests "
                               f"share, stored once (default {DEFAULT_PREFIX:,}, at most half "
                               "of --context)",
                               json_schema_extra={"make": "PREFIX"})
    weights: Precision = Field(_D.weights, description="the precision planned for (all are shown)",
                               json_schema_extra={"make": "WEIGHTS"})
    quantize: Literal["auto", "experts", "linear"] = Field(
        _D.quantize, description="what a precision converts: experts (MoE experts only, as "
        "gpt-oss ships), linear (all linear layers but router and lm_head), auto (experts for MoE "
        "models, else linear)")
    int4_group_size: int = Field(_D.int4_group_size, ge=1,
                                 description="int4: inputs per bf16 scale")
    int4_asymmetric: bool = Field(False, description="int4: add a 4-bit zero point per group")
    kv_dtype: Literal[tuple(KV_DTYPE_BYTES)] = Field(  # type: ignore[valid-type]
        _D.kv_dtype, description="KV cache element type (fp8 = 1 byte)",
        json_schema_extra={"make": "KV_DTYPE"})
    gpu: str = Field("h100-80gb", description="a preset in configs/accelerators/",
                     json_schema_extra={"make": "GPU"})
    memory_gb: float | None = Field(None, gt=0, description="device memory in GB (10^9 B), no "
                                    "preset", json_schema_extra={"make": "MEMORY_GB"})
    memory_gib: float | None = Field(None, gt=0,
                                     description="device memory in GiB (2^30 B), no preset")
    utilization: float = Field(_D.utilization, gt=0, le=1, description="fraction of the memory "
                               "the engine may use (vLLM's --gpu-memory-utilization)")
    reserve_gb: float = Field(DEFAULT_RESERVE_GB, ge=0, description="memory kept for "
                              "activations and runtime, GB")
    kv_budget_gb: float | None = Field(None, gt=0, description="KV cache memory in GB, given "
                                       "directly "
                                       "(memory, utilisation, weights and reserve are then not "
                                       "subtracted)", json_schema_extra={"make": "KV_BUDGET_GB"})
    kv_budget_gib: float | None = Field(None, gt=0, description="the same in GiB (e.g. vLLM CPU's "
                                        "VLLM_CPU_KVCACHE_SPACE)")
    block_size: int | None = Field(None, ge=1, description="KV block size in tokens (default: the "
                                   "preset's, 16 as on vLLM GPUs; vLLM CPU uses 128)")
    max_num_batched_tokens: int = Field(_D.max_num_batched_tokens, ge=1, description="vLLM's "
                                        "scheduler budget, for its sliding-window concurrency")
    tp: int = Field(1, ge=1, description="vLLM --tensor-parallel-size: devices the weights and "
                    "KV heads are split over (memory is per device)",
                    json_schema_extra={"make": "TP"})
    pp: int = Field(1, ge=1, description="vLLM --pipeline-parallel-size: stages the layers are "
                    "split over", json_schema_extra={"make": "PP"})
    as_json: bool = Field(False, description="print one JSON object, no table",
                          json_schema_extra={"flag": "--json", "make": "JSON=1"})
    plot: Path | None = Field(None, description="write a PNG of concurrency against context "
                              "length per precision", json_schema_extra={
                                  "metavar": "PATH", "make": "PLOT"})

    @model_validator(mode="after")
    def _one_of_each(self) -> PlanRequest:
        if self.memory_gb is not None and self.memory_gib is not None:
            raise PlanError("give --memory-gb or --memory-gib, not both.")
        if self.kv_budget_gb is not None and self.kv_budget_gib is not None:
            raise PlanError("give --kv-budget-gb or --kv-budget-gib, not both.")
        return self
