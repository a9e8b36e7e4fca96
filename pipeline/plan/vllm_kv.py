"""What vLLM v1 will log for a KV budget: its cache size in tokens and its maximum concurrency,
mirroring ``vllm/v1/core/kv_cache_utils.py``; checked against the engine at every bench."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.core.errors import PlanError
from pipeline.plan.architecture import (
    Architecture,
    KVLayer,
    as_architecture,
    cdiv,
    text_config,
)


@dataclass(frozen=True)
class VllmKVPrediction:
    """What vLLM should log: "KV cache size: N tokens" and "Maximum concurrency ...: X"."""

    num_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    page_size_bytes: int  # one block of one layer
    num_groups: int  # KV cache groups (1 unless layers of several kinds are mixed)
    group_size: int  # layers per group
    block_size: int = 0  # tokens per attention block (a hybrid's is raised: see _hybrid)
    state_page_padding: float = 0.0  # a hybrid's recurrent-state page padded by this share


def served_on_cpu(config: Mapping[str, Any], bf16_cpu: bool) -> Mapping[str, Any]:
    """``config`` with the SSM state dtype vLLM 0.32 CPU gives it. On a CPU with AVX512-BF16
    or AMX, vLLM's accelerated CPU state backends keep the SSM / linear-attention state in
    float32 (``CpuPlatform.check_and_update_config``: "Reset SSM cache type to float32 for
    accelerated GDN mamba backend"), unless float16 / bfloat16 was asked for a gated-delta-net
    model; elsewhere the state is as the config says. A nested language-model config is read
    (and returned) as the planner reads it, flattened by ``text_config``."""
    if not bf16_cpu:
        return config
    cfg = text_config(config)
    asked = str(cfg.get("mamba_ssm_cache_dtype") or "auto")
    if asked in ("float16", "bfloat16") and "linear_attention" in (cfg.get("layer_types") or []):
        return config
    return {**cfg, "mamba_ssm_cache_dtype": "float32"}


def predict_vllm_kv_cache(
    config: Mapping[str, Any] | Architecture,
    kv_budget_bytes: int,
    *,
    block_size: int,
    kv_dtype: str,
    max_model_len: int,
    max_num_batched_tokens: int = 2048,
    hybrid_kv_cache_manager: bool = True,
    prefix_caching: bool = True,
) -> VllmKVPrediction:
    """Predict vLLM v1's KV cache size and maximum concurrency for a given KV memory.

    Mirrors ``vllm/v1/core/kv_cache_utils.py``: layers are grouped by cache spec (one group when
    all layers are alike; for hybrid full + sliding models, groups of ``group_size`` layers);
    ``num_blocks = budget // page_size // group_size``; the logged size is
    ``num_blocks // num_groups * block_size`` tokens; the concurrency is ``num_blocks`` over the
    blocks one ``max_model_len`` request needs in every group (a sliding group needs
    ``cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1``).
    ``hybrid_kv_cache_manager=False`` (vLLM's ``--disable-hybrid-kv-cache-manager``) treats
    sliding layers as full attention. A model with recurrent layers: :func:`_hybrid`.
    """
    arch = as_architecture(config)
    if arch.state_layers:
        return _hybrid(arch, kv_budget_bytes, block_size, kv_dtype, max_model_len,
                       prefix_caching)
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
        block_size=block_size,
    )


def hybrid_block(arch: Architecture, kv_dtype: str, block_size: int) -> tuple[int, int]:
    """(attention block size in tokens, page bytes) of a hybrid as vLLM aligns them
    (``Platform._align_hybrid_block_size``): the attention block is raised, in multiples of
    ``block_size`` (the kernel's alignment: 16 on CUDA, 128 on CPU), until one attention page
    holds the largest recurrent state; every state page is then padded to that page."""
    per_token = {layer.bytes_per_token(kv_dtype) for layer in arch.kv_layers}
    if len(per_token) != 1:
        raise PlanError("a hybrid whose attention layers differ in KV size per token is not "
                        "modelled.")
    token = per_token.pop()
    state = max(layer.bytes for layer in arch.state_layers)
    block = block_size * cdiv(state, block_size * token)
    return block, block * token


def _hybrid(arch: Architecture, budget: int, block_size: int, kv_dtype: str,
            max_model_len: int, prefix_caching: bool) -> VllmKVPrediction:
    """vLLM's arithmetic for attention beside recurrent layers (``kv_cache_utils``): one pool
    of blocks of one page size; layers grouped by kind, ``group_size`` layers a group (the
    smaller kind's count, or the larger's where it is under 1.5x); a block is ``group_size``
    pages; a request takes ``cdiv(L, block)`` blocks in each attention group and, in each
    recurrent group, one (prefix caching off) or the pages vLLM's ``align`` mode keeps (two; a
    Mamba-2 three); the logged size is ``concurrency x L`` tokens."""
    block, page = hybrid_block(arch, kv_dtype, block_size)
    counts = {"attention": len(arch.kv_layers), "state": len(arch.state_layers)}
    low, high = min(counts.values()), max(counts.values())
    group_size = high if high < low * 1.5 else low
    attention_groups = cdiv(counts["attention"], group_size)
    state_groups = cdiv(counts["state"], group_size)
    num_blocks = max(budget // (group_size * page), 0)
    pages = max(s.prefix_cache_pages for s in arch.state_layers) if prefix_caching else 1
    per_request = attention_groups * cdiv(max_model_len, block) + state_groups * pages
    concurrency = num_blocks / per_request
    state = max(layer.bytes for layer in arch.state_layers)
    return VllmKVPrediction(
        num_blocks=num_blocks, kv_cache_tokens=int(concurrency * max_model_len),
        max_concurrency=concurrency, page_size_bytes=page,
        num_groups=attention_groups + state_groups, group_size=group_size, block_size=block,
        state_page_padding=page / state - 1)
