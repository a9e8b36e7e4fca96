"""What vLLM v1 will log for a KV budget: its cache size in tokens and its maximum concurrency,
mirroring ``vllm/v1/core/kv_cache_utils.py``; checked against the engine at every bench."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.core.errors import PlanError
from pipeline.plan.architecture import Architecture, KVLayer, as_architecture, cdiv


@dataclass(frozen=True)
class VllmKVPrediction:
    """What vLLM should log: "KV cache size: N tokens" and "Maximum concurrency ...: X"."""

    num_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    page_size_bytes: int  # one block of one layer
    num_groups: int  # KV cache groups (1 unless layers of several kinds are mixed)
    group_size: int  # layers per group


def predict_vllm_kv_cache(
    config: Mapping[str, Any] | Architecture,
    kv_budget_bytes: int,
    *,
    block_size: int,
    kv_dtype: str,
    max_model_len: int,
    max_num_batched_tokens: int = 2048,
    hybrid_kv_cache_manager: bool = True,
) -> VllmKVPrediction:
    """Predict vLLM v1's KV cache size and maximum concurrency for a given KV memory.

    Mirrors ``vllm/v1/core/kv_cache_utils.py``: layers are grouped by cache spec (one group when
    all layers are alike; for hybrid full + sliding models, groups of ``group_size`` layers);
    ``num_blocks = budget // page_size // group_size``; the logged size is
    ``num_blocks // num_groups * block_size`` tokens; the concurrency is ``num_blocks`` over the
    blocks one ``max_model_len`` request needs in every group (a sliding group needs
    ``cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1``).
    ``hybrid_kv_cache_manager=False`` (vLLM's ``--disable-hybrid-kv-cache-manager``) treats
    sliding layers as full attention.
    """
    arch = as_architecture(config)
    specs = [
        layer if hybrid_kv_cache_manager or layer.window is None
        else KVLayer("full", layer.elements_per_token)
        for layer in arch.kv_layers
    ]
    pages = {layer.bytes_per_token(kv_dtype) * block_size for layer in specs}
    if len(pages) != 1:
        raise PlanError("layers with different KV page sizes are not modelled (vLLM unifies them).")
    page = pages.pop()
    counts = Counter(specs)
    if len(counts) == 1:
        group_size, groups = len(specs), list(counts)
    else:
        low, high = min(counts.values()), max(counts.values())
        group_size = high if high < low * 1.5 else low
        groups = [spec for spec, n in counts.items() for _ in range(cdiv(n, group_size))]
    num_blocks = max(kv_budget_bytes // page // group_size, 0)

    def request_blocks(spec: KVLayer) -> int:
        if spec.window is None:
            return cdiv(max_model_len, block_size)
        tokens = min(spec.window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, block_size) + 1

    per_request = sum(request_blocks(spec) for spec in groups)
    return VllmKVPrediction(
        num_blocks=num_blocks,
        kv_cache_tokens=num_blocks // len(groups) * block_size,
        max_concurrency=num_blocks / per_request,
        page_size_bytes=page,
        num_groups=len(groups),
        group_size=group_size,
    )
