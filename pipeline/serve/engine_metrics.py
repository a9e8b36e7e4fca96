"""What the vLLM server says about itself: its /metrics text (read with the Prometheus client's
parser) and its start-up log."""

from __future__ import annotations

import re
from dataclasses import dataclass

_LOG_KV = re.compile(r"KV cache size:\s*([\d,]+)\s*tokens")
_LOG_CONCURRENCY = re.compile(
    r"Maximum concurrency for\s*([\d,]+)\s*tokens per request:\s*([\d.,]+)x")
# vLLM 0.32's own log lines (vllm/v1/worker/gpu_worker.py, gpu_model_runner.py, the linear
# kernel selection in model_executor/kernels/linear and the compressed-tensors schemes, and
# marlin_utils_fp8.py for FP8 on GPUs without native FP8)
_LOG_KV_MEMORY = re.compile(r"Available KV cache memory:\s*([\d.]+)\s*GiB")
_LOG_MODEL_MEMORY = re.compile(r"Model loading took\s*([\d.]+)\s*GiB")
_LOG_KERNEL = re.compile(r"\b(?:Selected|Using) (\w+) for (CompressedTensors\w+|[\w-]+ linear"
                         r"|\w+ GEMM)")
FP8_WEIGHT_ONLY = "Your GPU does not have native support for FP8 computation"


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    """Prometheus text exposition -> samples, through the Prometheus client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return [Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list[Sample], name: str) -> float:
    """Sum of a counter or gauge over all label sets (engines, models)."""
    return sum(s.value for s in samples if s.name == name)


@dataclass(frozen=True)
class KVCacheInfo:
    """The KV-cache figures the engine reports for its configuration."""

    kv_cache_tokens: int
    max_concurrency: float  # for max_model_len tokens per request
    block_size: int
    num_blocks: int
    kv_cache_memory_bytes: int | None


def kv_cache_info(samples: list[Sample], log_text: str = "") -> KVCacheInfo | None:
    """From ``vllm:cache_config_info``'s labels, else from the start-up log lines."""
    for s in samples:
        if s.name == "vllm:cache_config_info" and "kv_cache_size_tokens" in s.labels:
            lab = s.labels
            memory = lab.get("kv_cache_memory_bytes", "None")
            return KVCacheInfo(
                kv_cache_tokens=int(lab["kv_cache_size_tokens"]),
                max_concurrency=float(lab.get("kv_cache_max_concurrency", "nan")),
                block_size=int(lab.get("block_size", "0")),
                num_blocks=int(lab.get("num_gpu_blocks", "0") or 0),
                kv_cache_memory_bytes=int(memory) if memory.isdigit() else None,
            )
    tokens = _LOG_KV.findall(log_text)
    concurrency = _LOG_CONCURRENCY.findall(log_text)
    if tokens and concurrency:
        return KVCacheInfo(int(tokens[-1].replace(",", "")),
                           float(concurrency[-1][1].replace(",", "")), 0, 0, None)
    return None


def prefix_cache_counters(samples: list[Sample]) -> tuple[float, float]:
    """(queried tokens, hit tokens) of the prefix cache since the server started."""
    return (total(samples, "vllm:prefix_cache_queries_total"),
            total(samples, "vllm:prefix_cache_hits_total"))


def preemptions(samples: list[Sample]) -> float:
    """Requests the scheduler preempted since the server started (its KV cache was full)."""
    return total(samples, "vllm:num_preemptions_total")


@dataclass(frozen=True)
class EngineLog:
    """What the engine's start-up log says it chose and used."""

    kernels: tuple[str, ...]  # "CPUWNA16LinearKernel for CompressedTensorsWNA16", ...
    schemes: tuple[str, ...]  # the compressed-tensors schemes it chose: "W8A8Fp8", "WNA16"
    fp8_weight_only: bool  # FP8 served weight-only through Marlin (no native FP8 here)
    weight_memory_bytes: int | None  # "Model loading took X GiB" (GPU model runner)
    kv_cache_memory_bytes: int | None  # "Available KV cache memory: X GiB" (GPU worker)

    @property
    def scheme(self) -> str:
        """The scheme the engine actually served, in one phrase."""
        if self.fp8_weight_only:
            return "W8A16Fp8 (FP8 weights only, through Marlin: no native FP8 on this GPU)"
        return "+".join(self.schemes) or "dense"


def read_log(log_text: str) -> EngineLog:
    kernels = tuple(dict.fromkeys(f"{k} for {target}"
                                  for k, target in _LOG_KERNEL.findall(log_text)))
    schemes = tuple(dict.fromkeys(target.removeprefix("CompressedTensors")
                                  for _, target in _LOG_KERNEL.findall(log_text)
                                  if target.startswith("CompressedTensors")))
    fp8_weight_only = FP8_WEIGHT_ONLY in log_text
    if fp8_weight_only:
        schemes = (*(s for s in schemes if "Fp8" not in s), "W8A16Fp8")
    kv = _LOG_KV_MEMORY.findall(log_text)
    weights = _LOG_MODEL_MEMORY.findall(log_text)
    gib = 2**30
    return EngineLog(kernels, schemes, fp8_weight_only,
                     int(float(weights[-1]) * gib) if weights else None,
                     int(float(kv[-1]) * gib) if kv else None)
