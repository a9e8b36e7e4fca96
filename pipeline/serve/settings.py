"""vLLM engine settings: one object for every server a stage or campaign starts (bench's and
eval's alike), from which the engine's CLI options are derived; every field is recorded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class EngineSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_model_len: int = Field(2048, ge=16,
                               description="vLLM context length (capped at the model's)",
                               json_schema_extra={"make": "MAX_MODEL_LEN"})
    dtype: str = Field("bfloat16", description="vLLM --dtype",
                       json_schema_extra={"cli": False})
    kv_cache_space_gib: int = Field(
        1, ge=1, description="CPU: VLLM_CPU_KVCACHE_SPACE in whole GiB, as vLLM reads it",
        json_schema_extra={"flag": "--kv-cache-gib", "make": "KV_CACHE_GIB"})
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1,
                                          description="CUDA: vLLM --gpu-memory-utilization",
                                          json_schema_extra={"make": "GPU_UTIL"})
    enable_prefix_caching: bool = Field(True, description="prefix caching (bench turns it off "
                                        "for its speed sweeps)", json_schema_extra={"cli": False})
    max_num_batched_tokens: int | None = Field(None, ge=1,
                                               description="vLLM --max-num-batched-tokens")
    max_num_seqs: int | None = Field(None, ge=1, description="vLLM --max-num-seqs",
                                     json_schema_extra={"cli": False})
    # None: eager on CPUs (torch.compile costs ~60 s per start there, and decode is compute-
    # bound), compiled with CUDA graphs on GPUs (eager decode is bound by kernel launches there:
    # it would understate every tok/s, ITL and speedup)
    enforce_eager: bool | None = Field(
        None, description="run eager (default on CPUs)", json_schema_extra={
            "flag": "--eager", "negative": "--compile",
            "negative_help": "let vLLM compile, with CUDA graphs on GPUs (default on GPUs)"})
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM --tensor-parallel-size: GPUs "
                                      "each server spans", json_schema_extra={
                                          "flag": "--tp", "make": "TP"})
    pipeline_parallel_size: int = Field(1, ge=1, description="vLLM --pipeline-parallel-size",
                                        json_schema_extra={"flag": "--pp", "make": "PP"})
    extra_args: tuple[str, ...] = Field(
        (), description="any other `vllm serve` flag, passed as is, e.g. "
        "--vllm-arg=--tensor-parallel-size=2", json_schema_extra={
            "flag": "--vllm-arg", "metavar": "FLAG", "make": "VLLM_ARGS"})

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> EngineSettings:
        """The settings a bench run recorded (its summary's ``engine``, a ``model_dump()``);
        a field it lacks (an older run) or no longer known takes its default."""
        return cls.model_validate({k: v for k, v in record.items()
                                   if k in cls.model_fields and v is not None})

    def resolved(self, target: str) -> EngineSettings:
        """These settings with every automatic choice made for ``target`` (cpu | cuda)."""
        if self.enforce_eager is not None:
            return self
        return self.model_copy(update={"enforce_eager": target == "cpu"})

    def identity(self) -> dict[str, Any]:
        """What a measurement's cache key holds of the engine: every field, except a parallel
        size of 1 (one device, as before those fields existed: earlier measurements stay
        valid)."""
        return {k: v for k, v in self.model_dump().items()
                if not (k in ("tensor_parallel_size", "pipeline_parallel_size") and v == 1)}

    def as_params(self) -> dict[str, Any]:
        return {f"engine.{k}": v for k, v in self.identity().items() if v not in (None, ())}
