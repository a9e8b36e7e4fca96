"""What the vLLM server says about itself: its /metrics text and its start-up log."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_LOG_KV = re.compile(r"KV cache size:\s*([\d,]+)\s*tokens")
_LOG_CONCURRENCY = re.compile(
    r"Maximum concurrency for\s*([\d,]+)\s*tokens per request:\s*([\d.,]+)x")


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    """Prometheus text exposition -> samples (comments and malformed lines skipped)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line.strip())
        if not match:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        out.append(Sample(match["name"], dict(_LABEL.findall(match["labels"] or "")), value))
    return out


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
