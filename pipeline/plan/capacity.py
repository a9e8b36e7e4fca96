"""Capacity arithmetic from a model's architecture: weight memory, KV cache, concurrency.

Pure functions on small frozen dataclasses; nothing is read, loaded or printed. Sizes are
bytes. In messages "GB" is 10^9 bytes and "GiB" 2^30. The architecture itself is parsed by
:mod:`pipeline.plan.architecture`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.core import formats
from pipeline.core.errors import PlanError
from pipeline.plan.architecture import (
    KV_DTYPE_BYTES,
    Architecture,
    KVLayer,
    Matrix,
    ModuleKind,
    as_architecture,
    cdiv,
    kv_dtype_bytes,
    parse_architecture,
    unknown_choice,
)
from pipeline.plan.vllm_kv import VllmKVPrediction, hybrid_block, predict_vllm_kv_cache

__all__ = ["KV_DTYPE_BYTES", "Architecture", "KVLayer", "ModuleKind", "VllmKVPrediction",
           "parse_architecture", "predict_vllm_kv_cache"]

# --- metric names: the one place they are spelled (JSON keys, MLflow metrics) ----------------
# --- metric names: the one place they are spelled (JSON keys, MLflow metrics) ----------------
KV_BYTES_PER_TOKEN = "planned_kv_bytes_per_token"


KV_BYTES_PER_REQUEST = "planned_kv_bytes_per_request"


WEIGHT_BYTES = "planned_weight_bytes"


KV_BUDGET_BYTES = "planned_kv_budget_bytes"


KV_CACHE_TOKENS = "planned_kv_cache_tokens"  # predicted like vLLM's "KV cache size: N tokens"


MAX_CONCURRENCY_WORST_CASE = "planned_max_concurrency_worst_case"


MAX_CONCURRENCY_PAGED = "planned_max_concurrency_paged"


MAX_CONCURRENCY_PAGED_SHARED_PREFIX = "planned_max_concurrency_paged_shared_prefix"


# predicted like vLLM's "Maximum concurrency for L tokens per request: X"
VLLM_MAX_CONCURRENCY = "planned_vllm_max_concurrency"


PLANNED_METRICS: tuple[str, ...] = (
    KV_BYTES_PER_TOKEN,
    KV_BYTES_PER_REQUEST,
    WEIGHT_BYTES,
    KV_BUDGET_BYTES,
    KV_CACHE_TOKENS,
    MAX_CONCURRENCY_WORST_CASE,
    MAX_CONCURRENCY_PAGED,
    MAX_CONCURRENCY_PAGED_SHARED_PREFIX,
    VLLM_MAX_CONCURRENCY,
)


WEIGHT_PRECISIONS: tuple[str, ...] = formats.WEIGHT_PRECISIONS


QUANTIZE_SCOPES: tuple[str, ...] = ("auto", "experts", "linear")


# Module kinds never quantized: their weights stay bf16 in every precision.
ALWAYS_HIGH_PRECISION: tuple[str, ...] = ("embeddings", "lm_head", "router", "norms")


# --- weights -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightFormat:
    """How one precision stores a matrix: values, plus scales per group along the input dim."""

    name: str
    value_bits: int
    group_size: int | None = None  # inputs sharing a scale; None: one scale per output row
    scale_bytes: int = 0
    zero_point_bits: int = 0  # per group, packed (asymmetric int4)
    tensor_scale_bytes: int = 0  # per matrix (nvfp4's global fp32 scale)
    block: tuple[int, int] | None = None  # (rows, cols) sharing one scale (FP8 block-wise)

    def matrix_bytes(self, m: Matrix) -> int:
        values = cdiv(m.rows * m.cols * self.value_bits, 8)
        if self.block:
            groups = cdiv(m.rows, self.block[0]) * cdiv(m.cols, self.block[1])
        else:
            groups = m.rows * (cdiv(m.cols, self.group_size) if self.group_size else 1)
        scales = groups * self.scale_bytes + cdiv(groups * self.zero_point_bits, 8)
        return m.count * (values + scales + self.tensor_scale_bytes)


def weight_formats(int4_group_size: int | None = 128,
                   int4_asymmetric: bool = False) -> dict[str, WeightFormat]:
    """The storage of each weight precision, from the format table (scales in bf16 unless the
    format says): ``int4_group_size`` / ``int4_asymmetric`` are what an int4 recipe chose
    (None: one scale per output channel; asymmetric: a 4-bit zero point per group, AWQ)."""
    out = {}
    for fmt in formats.FORMATS.values():
        if fmt.precision in out:
            continue
        if fmt.weight_bits >= 16:
            out[fmt.precision] = WeightFormat(fmt.precision, fmt.weight_bits)
        elif fmt.weight_type == "int" and fmt.weight_only:  # the recipe's group and zero points
            out[fmt.precision] = WeightFormat(fmt.precision, fmt.weight_bits, int4_group_size,
                                              fmt.scale_bytes, 4 if int4_asymmetric else 0)
        else:
            out[fmt.precision] = WeightFormat(
                fmt.precision, fmt.weight_bits, fmt.group_size, fmt.scale_bytes,
                tensor_scale_bytes=fmt.tensor_scale_bytes, block=fmt.block)
    return out


@dataclass(frozen=True)
class WeightEstimate:
    """Weight memory in one precision, by module kind."""

    precision: str
    by_module: dict[str, int]
    quantized_modules: tuple[str, ...]
    high_precision_modules: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.by_module.values())


def quantized_module_kinds(arch: Architecture, scope: str) -> tuple[str, ...]:
    """Module kinds a quantization scope converts: ``experts`` (MoE experts only, as gpt-oss
    ships them), ``linear`` (every linear layer but the router and lm_head) or ``auto`` (experts
    for a mixture-of-experts model, else linear)."""
    if scope not in QUANTIZE_SCOPES:
        raise unknown_choice("quantize scope", scope, QUANTIZE_SCOPES)
    if scope == "auto":
        scope = "experts" if arch.num_experts else "linear"
    if scope == "experts" and not arch.num_experts:
        raise PlanError(
            "--quantize experts needs a mixture-of-experts model; this config has no "
            "num_local_experts / num_experts / n_routed_experts. Use --quantize linear."
        )
    wanted = ("experts", "shared_experts") if scope == "experts" else (
        "attention", "mixer", "mlp", "experts", "shared_experts")
    return tuple(name for name in arch.module_names if name in wanted)


def estimate_weights(arch: Architecture, precision: str, scope: str = "auto",
                     formats: Mapping[str, WeightFormat] | None = None) -> WeightEstimate:
    """Bytes of every module kind when ``scope``'s modules are stored in ``precision``."""
    formats = formats or weight_formats()
    if precision not in formats:
        raise unknown_choice("weight precision", precision, tuple(formats))
    fmt, bf16 = formats[precision], formats["bf16"]
    quantized = () if precision == "bf16" else quantized_module_kinds(arch, scope)
    by_module = {}
    for module in arch.modules:
        matrix_fmt = fmt if module.name in quantized else bf16
        by_module[module.name] = sum(matrix_fmt.matrix_bytes(m) for m in module.matrices) + (
            2 * module.vectors
        )
    high = tuple(name for name in arch.module_names if name not in quantized)
    return WeightEstimate(precision, by_module, quantized, high)


def kv_bytes_per_token(arch: Architecture, kv_dtype: str) -> int:
    """KV growth per token at long context: only layers without a window keep growing."""
    return sum(layer.bytes_per_token(kv_dtype) for layer in arch.kv_layers if layer.window is None)


def kv_bytes_per_token_all_layers(arch: Architecture, kv_dtype: str) -> int:
    """KV per token while the context is shorter than every window: all layers count."""
    return sum(layer.bytes_per_token(kv_dtype) for layer in arch.kv_layers)


def kv_bytes_per_request(arch: Architecture, context: int, kv_dtype: str, block_size: int,
                         shared_prefix: int = 0) -> int:
    """KV one request holds at ``context`` tokens, each layer rounded up to whole blocks.

    With ``shared_prefix`` tokens, the prefix's full blocks in layers that keep the whole
    context are left out (they are counted once, see :func:`shared_prefix_bytes`). A hybrid's
    recurrent layers add their state, one page each whatever the context, and its attention
    blocks are the larger ones vLLM aligns to that page (:func:`hybrid_block`).
    """
    total = 0
    if arch.state_layers:
        block_size, page = hybrid_block(arch, kv_dtype, block_size)
        total = len(arch.state_layers) * page
    for layer in arch.kv_layers:
        held = layer.tokens_held(context)
        blocks = cdiv(held, block_size)
        if held == context:
            blocks -= min(shared_prefix, context) // block_size
        total += blocks * block_size * layer.bytes_per_token(kv_dtype)
    return total


def shared_prefix_bytes(arch: Architecture, context: int, prefix: int, kv_dtype: str,
                        block_size: int) -> int:
    """KV of a prefix shared by all requests, stored once: its full blocks in every layer that
    keeps the whole context (a window layer past its window holds only its own recent tokens)."""
    if arch.state_layers:
        block_size = hybrid_block(arch, kv_dtype, block_size)[0]
    shared_tokens = min(prefix, context) // block_size * block_size
    return sum(
        shared_tokens * layer.bytes_per_token(kv_dtype)
        for layer in arch.kv_layers
        if layer.tokens_held(context) == context
    )


def kv_budget(memory_bytes: int, utilization: float, weight_bytes: int, reserve_bytes: int) -> int:
    """Memory left for the KV cache: memory x utilisation - weights - reserve (> 0, or raises)."""
    usable = int(memory_bytes * utilization)
    budget = usable - weight_bytes - reserve_bytes
    if budget <= 0:
        raise PlanError(
            f"the weights do not fit: {weight_bytes / 1e9:.2f} GB of weights + "
            f"{reserve_bytes / 1e9:.2f} GB reserve exceed the {usable / 1e9:.2f} GB usable "
            f"({memory_bytes / 1e9:.2f} GB x {utilization:g}) by {-budget / 1e9:.2f} GB. Use a "
            "smaller weight precision, a larger accelerator, or a higher --utilization."
        )
    return budget


def max_requests(budget_bytes: int, per_request_bytes: int, shared_bytes: int = 0) -> int:
    """How many requests of ``per_request_bytes`` fit beside ``shared_bytes`` stored once."""
    if per_request_bytes <= 0:
        raise PlanError("a request needs no KV cache; this model cannot be planned.")
    return max(budget_bytes - shared_bytes, 0) // per_request_bytes


def concurrency_curve(arch: Architecture, budget_bytes: int, contexts: Sequence[int],
                      kv_dtype: str, block_size: int) -> list[int]:
    """Paged concurrency at each context length (every request holding that many tokens)."""
    return [
        max_requests(budget_bytes, kv_bytes_per_request(arch, c, kv_dtype, block_size))
        for c in contexts
    ]


# --- vLLM's own arithmetic (v1 kv_cache_utils), for the serving cross-check --------------------
# --- the whole plan ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanSettings:
    """The inputs of a plan besides the model. Memory sizes are bytes."""

    weights: str = "bf16"
    quantize: str = "auto"
    kv_dtype: str = "bf16"
    context: int = 8192
    max_context: int = 131072
    prefix: int = 0
    block_size: int = 16
    memory_bytes: int | None = None
    utilization: float = 0.9
    reserve_bytes: int = 2_000_000_000
    kv_budget_bytes: int | None = None  # given directly: memory, utilisation, reserve unused
    int4_group_size: int | None = 128  # None: one scale per output channel
    int4_asymmetric: bool = False
    max_num_batched_tokens: int = 2048
    # vLLM's --tensor-parallel-size / --pipeline-parallel-size: memory_bytes is per device
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # vLLM's default; a hybrid's recurrent layers then keep 2-3 state pages a request
    prefix_caching: bool = True

    @property
    def devices(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    def per_device(self, weight_bytes: int) -> int:
        """Each device's share of ``weight_bytes`` (rounded up)."""
        return cdiv(weight_bytes, self.devices)


@dataclass(frozen=True)
class CapacityPlan:
    """Everything ``qpipe plan`` reports."""

    arch: Architecture
    settings: PlanSettings
    weights: dict[str, WeightEstimate]  # every precision
    kv_bytes_per_token: int
    kv_bytes_per_token_all_layers: int
    kv_bytes_per_request: int  # at context
    kv_bytes_per_request_max: int  # at max_context
    shared_prefix_bytes: int
    kv_bytes_per_request_unshared: int  # at context, shared prefix left out
    kv_budget_bytes: int
    worst_case: int
    paged: int
    paged_shared_prefix: int
    vllm: VllmKVPrediction
    notes: tuple[str, ...] = field(default=())

    @property
    def weight_bytes(self) -> int:
        return self.weights[self.settings.weights].total_bytes

    def metrics(self) -> dict[str, int | float]:
        return {
            KV_BYTES_PER_TOKEN: self.kv_bytes_per_token,
            KV_BYTES_PER_REQUEST: self.kv_bytes_per_request,
            WEIGHT_BYTES: self.weight_bytes,
            KV_BUDGET_BYTES: self.kv_budget_bytes,
            KV_CACHE_TOKENS: self.vllm.kv_cache_tokens,
            MAX_CONCURRENCY_WORST_CASE: self.worst_case,
            MAX_CONCURRENCY_PAGED: self.paged,
            MAX_CONCURRENCY_PAGED_SHARED_PREFIX: self.paged_shared_prefix,
            VLLM_MAX_CONCURRENCY: round(self.vllm.max_concurrency, 2),
        }


def _check_settings(s: PlanSettings) -> None:
    for name in ("context", "max_context", "block_size", "int4_group_size",
                 "max_num_batched_tokens"):
        if getattr(s, name) is not None and getattr(s, name) <= 0:
            raise PlanError(f"{name.replace('_', '-')} must be positive, not {getattr(s, name)}.")
    if s.context > s.max_context:
        raise PlanError(f"context {s.context:,} is longer than max-context {s.max_context:,}.")
    if s.tensor_parallel < 1 or s.pipeline_parallel < 1:
        raise PlanError("tensor and pipeline parallel sizes must be at least 1.")
    if s.prefix < 0 or s.prefix >= s.context:
        raise PlanError(f"prefix {s.prefix:,} must be at least 0 and shorter than the context "
                        f"({s.context:,}).")
    if not 0 < s.utilization <= 1:
        raise PlanError(f"utilization must be in (0, 1], not {s.utilization}.")
    if s.reserve_bytes < 0:
        raise PlanError("the reserve must not be negative.")
    if s.kv_budget_bytes is not None and s.kv_budget_bytes <= 0:
        raise PlanError(f"the KV budget must be positive, not {s.kv_budget_bytes / 1e9:g} GB.")
    if s.kv_budget_bytes is None and not s.memory_bytes:
        raise PlanError("give the accelerator's memory or the KV budget.")


def plan_capacity(config: Mapping[str, Any] | Architecture, settings: PlanSettings) -> CapacityPlan:
    """Weights in every precision, KV per token and request, the budget and the concurrency."""
    arch = as_architecture(config)
    s = settings
    _check_settings(s)
    kv_dtype_bytes(s.kv_dtype)
    formats = weight_formats(s.int4_group_size, s.int4_asymmetric)
    if s.weights not in formats:
        raise unknown_choice("weight precision", s.weights, tuple(formats))
    weights = {p: estimate_weights(arch, p, s.quantize, formats) for p in formats}
    if s.kv_budget_bytes is not None:
        budget = s.kv_budget_bytes
    else:
        assert s.memory_bytes is not None
        try:
            # each device: its share of the weights, its share of every token's KV cache
            budget = kv_budget(s.memory_bytes, s.utilization,
                               s.per_device(weights[s.weights].total_bytes), s.reserve_bytes) * \
                arch.kv_shards(s.tensor_parallel, s.pipeline_parallel)
        except PlanError as err:
            usable = int(s.memory_bytes * s.utilization) - s.reserve_bytes
            fitting = [f"{p} ({w.total_bytes / 1e9:.2f} GB)" for p, w in weights.items()
                       if s.per_device(w.total_bytes) < usable]
            others = f" Precisions that fit: {', '.join(fitting)}." if fitting else ""
            split = f" over {s.devices} devices (TP {s.tensor_parallel} x PP " \
                    f"{s.pipeline_parallel})" if s.devices > 1 else ""
            raise PlanError(f"with {s.weights} weights{split}, {err}{others}") from err
    per_request = kv_bytes_per_request(arch, s.context, s.kv_dtype, s.block_size)
    per_request_max = kv_bytes_per_request(arch, s.max_context, s.kv_dtype, s.block_size)
    shared = shared_prefix_bytes(arch, s.context, s.prefix, s.kv_dtype, s.block_size)
    unshared = kv_bytes_per_request(arch, s.context, s.kv_dtype, s.block_size, s.prefix)
    worst = max_requests(budget, per_request_max)
    notes = []
    if worst == 0:
        notes.append(
            f"one request of max-context {s.max_context:,} tokens needs "
            f"{per_request_max / 1e9:.2f} GB of KV cache, more than the {budget / 1e9:.2f} GB "
            "budget: vLLM would refuse to start; lower --max-context."
        )
    return CapacityPlan(
        arch=arch,
        settings=s,
        weights=weights,
        kv_bytes_per_token=kv_bytes_per_token(arch, s.kv_dtype),
        kv_bytes_per_token_all_layers=kv_bytes_per_token_all_layers(arch, s.kv_dtype),
        kv_bytes_per_request=per_request,
        kv_bytes_per_request_max=per_request_max,
        shared_prefix_bytes=shared,
        kv_bytes_per_request_unshared=unshared,
        kv_budget_bytes=budget,
        worst_case=worst,
        paged=max_requests(budget, per_request),
        paged_shared_prefix=max_requests(budget, unshared, shared),
        vllm=predict_vllm_kv_cache(arch, budget, block_size=s.block_size, kv_dtype=s.kv_dtype,
                                   max_model_len=s.max_context,
                                   max_num_batched_tokens=s.max_num_batched_tokens,
                                   prefix_caching=s.prefix_caching),
        notes=tuple(notes),
    )


TP_SIZES = (1, 2, 4, 8, 16, 32, 64)


def smallest_tensor_parallel(arch: Architecture, settings: PlanSettings, min_requests: int = 1
                             ) -> tuple[int, CapacityPlan] | None:
    """The smallest tensor-parallel size (one that divides the attention heads, as vLLM
    requires) at which the weights fit and the KV cache holds ``min_requests`` requests of
    ``max_context`` tokens each, reserved (worst case); None if no size up to 64 does."""
    from dataclasses import replace

    for tp in TP_SIZES:
        if arch.attention_heads and arch.attention_heads % tp:
            continue
        try:
            plan = plan_capacity(arch, replace(settings, tensor_parallel=tp, kv_budget_bytes=None))
        except PlanError:
            continue
        if plan.worst_case >= min_requests:
            return tp, plan
    return None
