"""Capacity arithmetic from a model's ``config.json``: weight memory, KV cache, concurrency.

Pure functions on plain dicts and small frozen dataclasses; nothing is read, loaded or printed.
Sizes are bytes. In messages "GB" is 10^9 bytes and "GiB" 2^30.

The KV model follows vLLM's paged allocator: every attention layer stores its cache in blocks of
``block_size`` tokens; a full-attention layer keeps every token of a request, a sliding-window
layer at most ``window`` tokens, and a multi-head-latent-attention (MLA) layer one compressed
latent per token instead of per-head K and V.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.errors import PlanError

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

KV_DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1}
WEIGHT_PRECISIONS: tuple[str, ...] = ("bf16", "fp8", "int8", "int4", "mxfp4", "nvfp4")
QUANTIZE_SCOPES: tuple[str, ...] = ("auto", "experts", "linear")
# Module kinds never quantized: their weights stay bf16 in every precision.
ALWAYS_HIGH_PRECISION: tuple[str, ...] = ("embeddings", "lm_head", "router", "norms")
_NESTED_CONFIGS = ("text_config", "language_config", "llm_config")
_MISSING = object()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _unknown(what: str, value: str, choices: Sequence[str]) -> PlanError:
    return PlanError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}.")


# --- architecture ------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVLayer:
    """One attention layer's cache: elements stored per token, and its window if it has one."""

    kind: str  # "full", "sliding" or "mla"
    elements_per_token: int  # K and V (2 x kv_heads x head_dim), or the MLA latent (rank + rope)
    window: int | None = None  # a sliding-window layer keeps at most this many tokens

    def bytes_per_token(self, kv_dtype: str) -> int:
        return self.elements_per_token * kv_dtype_bytes(kv_dtype)

    def tokens_held(self, context: int) -> int:
        return context if self.window is None else min(context, self.window)


@dataclass(frozen=True)
class Matrix:
    """A weight matrix of ``rows`` outputs x ``cols`` inputs, present ``count`` times."""

    rows: int
    cols: int
    count: int = 1

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.count


@dataclass(frozen=True)
class ModuleKind:
    """All weights of one kind (e.g. every layer's attention projections) in the model."""

    name: str
    matrices: tuple[Matrix, ...] = ()
    vectors: int = 0  # biases, norm weights, attention sinks: always kept in bf16

    @property
    def params(self) -> int:
        return sum(m.params for m in self.matrices) + self.vectors


@dataclass(frozen=True)
class Architecture:
    """What the planner needs from a config: the cache of each layer and the weight shapes."""

    model_type: str
    num_layers: int
    hidden_size: int
    kv_layers: tuple[KVLayer, ...]
    modules: tuple[ModuleKind, ...]
    num_experts: int = 0
    max_position_embeddings: int | None = None
    checkpoint_quantization: str | None = None  # quantization_config.quant_method, if any

    @property
    def params(self) -> int:
        return sum(m.params for m in self.modules)

    @property
    def module_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.modules)

    def describe(self) -> str:
        counts = Counter(layer.kind for layer in self.kv_layers)
        parts = [f"{counts['full']} full attention"] if counts["full"] else []
        if counts["sliding"]:
            windows = sorted({layer.window for layer in self.kv_layers if layer.window})
            parts.append(f"{counts['sliding']} sliding window {'/'.join(map(str, windows))}")
        if counts["mla"]:
            parts.append(f"{counts['mla']} latent attention (MLA)")
        moe = f", {self.num_experts} experts" if self.num_experts else ""
        return f"{self.num_layers} layers ({', '.join(parts)}){moe}"


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config: a nested ``text_config`` (or similar) over the outer keys."""
    for key in _NESTED_CONFIGS:
        inner = config.get(key)
        if isinstance(inner, Mapping):
            outer = {
                k: v
                for k, v in config.items()
                if not k.endswith("_config") or k == "quantization_config"
            }
            inner_fields = {k: v for k, v in text_config(inner).items() if v is not None}
            return {**outer, **inner_fields}
    return dict(config)


def _field(cfg: Mapping[str, Any], *names: str, needed_for: str,
           default: Any = _MISSING) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is not _MISSING:
        return default
    also = f" (also looked for {', '.join(names[1:])})" if len(names) > 1 else ""
    raise PlanError(f"the model config has no `{names[0]}`{also}; it is needed for {needed_for}.")


def _positive_int(cfg: Mapping[str, Any], *names: str, needed_for: str,
                  default: Any = _MISSING) -> Any:
    value = _field(cfg, *names, needed_for=needed_for, default=default)
    if value is default and default is not _MISSING:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"the model config's `{names[0]}` is {value!r}; expected a positive "
                        "integer.")
    return value


def _layer_windows(cfg: Mapping[str, Any], num_layers: int, model_type: str) -> list[int | None]:
    """Each layer's sliding window (``None`` for full attention)."""
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise PlanError(
                f"the model config's `layer_types` lists {len(layer_types)} layers but "
                f"`num_hidden_layers` is {num_layers}."
            )
        windows: list[int | None] = []
        for i, kind in enumerate(layer_types):
            if kind == "full_attention":
                windows.append(None)
            elif kind == "sliding_attention":
                windows.append(_positive_int(cfg, "sliding_window", needed_for="sliding layers"))
            else:
                raise PlanError(
                    f"layer {i} of the model config is of type {kind!r}; the planner knows "
                    "`full_attention` and `sliding_attention` layers only."
                )
        return windows
    window = cfg.get("sliding_window")
    # Qwen2 and others carry a window they do not use: `use_sliding_window: false`.
    if not window or cfg.get("use_sliding_window") is False:
        return [None] * num_layers
    window = _positive_int(cfg, "sliding_window", needed_for="sliding layers")
    if cfg.get("use_sliding_window") and "max_window_layers" in cfg:
        # Qwen2 semantics: the first `max_window_layers` layers use full attention.
        first = int(cfg["max_window_layers"])
        return [window if i >= first else None for i in range(num_layers)]
    if "sliding_window_pattern" in cfg:  # Gemma 3: every Nth layer is global
        pattern = int(cfg["sliding_window_pattern"])
        return [None if (i + 1) % pattern == 0 else window for i in range(num_layers)]
    if model_type == "gemma2":  # alternating, starting with a local layer
        return [window if i % 2 == 0 else None for i in range(num_layers)]
    return [window] * num_layers  # e.g. Mistral 7B v0.1: every layer


def _is_moe_layer(cfg: Mapping[str, Any], i: int) -> bool:
    if i < int(cfg.get("first_k_dense_replace") or 0):  # DeepSeek: first k layers dense
        return False
    if i in (cfg.get("mlp_only_layers") or []):  # Qwen-MoE
        return False
    if cfg.get("decoder_sparse_step"):
        return (i + 1) % int(cfg["decoder_sparse_step"]) == 0
    return i % int(cfg.get("moe_layer_freq") or 1) == 0


def _attention(cfg: Mapping[str, Any], layers: int, hidden: int, heads: int,
               model_type: str) -> tuple[tuple[KVLayer, ...], ModuleKind]:
    """Each layer's KV cache, and the attention weights of all layers."""
    vectors = 0
    if cfg.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3, Kimi K2)
        rank = _positive_int(cfg, "kv_lora_rank", needed_for="MLA")
        rope = _positive_int(cfg, "qk_rope_head_dim", needed_for="the MLA cache")
        nope = _positive_int(cfg, "qk_nope_head_dim", needed_for="MLA shapes")
        v_dim = _positive_int(cfg, "v_head_dim", needed_for="MLA shapes")
        kv_layers = tuple(KVLayer("mla", rank + rope) for _ in range(layers))
        q_rank = cfg.get("q_lora_rank")
        if q_rank:  # q_a_proj, q_b_proj
            shapes = [(q_rank, hidden), (heads * (nope + rope), q_rank)]
        else:
            shapes = [(heads * (nope + rope), hidden)]
        # kv_a_proj_with_mqa, kv_b_proj, o_proj
        shapes += [(rank + rope, hidden), (heads * (nope + v_dim), rank), (hidden, heads * v_dim)]
        vectors = rank + (q_rank or 0)  # kv_a / q_a layernorms
    else:
        kv_heads = _positive_int(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv",
                                 needed_for="the KV cache", default=heads)
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise PlanError(
                    f"the model config has no `head_dim` and hidden_size {hidden} is not a "
                    f"multiple of num_attention_heads {heads}; add `head_dim`."
                )
            head_dim = hidden // heads
        head_dim = _positive_int({"head_dim": head_dim}, "head_dim", needed_for="the KV cache")
        kv_layers = tuple(
            KVLayer("full" if w is None else "sliding", 2 * kv_heads * head_dim, w)
            for w in _layer_windows(cfg, layers, model_type)
        )
        q_out, kv_out = heads * head_dim, kv_heads * head_dim
        shapes = [(q_out, hidden), (kv_out, hidden), (kv_out, hidden), (hidden, q_out)]
        if cfg.get("attention_bias"):
            vectors = q_out + 2 * kv_out + hidden
        elif model_type.startswith("qwen2"):  # q/k/v biases, no o bias
            vectors = q_out + 2 * kv_out
        if model_type.startswith(("qwen3", "gemma3")):  # q_norm, k_norm
            vectors += 2 * head_dim
        if model_type == "gpt_oss":  # attention sinks: one per head
            vectors += heads
    matrices = tuple(Matrix(rows, cols, layers) for rows, cols in shapes)
    return kv_layers, ModuleKind("attention", matrices, vectors * layers)


def _gated_mlp(name: str, inter: int, hidden: int, count: int, bias: bool) -> ModuleKind:
    """``count`` gated MLPs (gate, up: hidden -> inter; down: inter -> hidden)."""
    matrices = (Matrix(inter, hidden, 2 * count), Matrix(hidden, inter, count))
    return ModuleKind(name, matrices, (2 * inter + hidden) * count if bias else 0)


def _feed_forward(cfg: Mapping[str, Any], layers: int, hidden: int, experts: int,
                  model_type: str) -> list[ModuleKind]:
    """Dense MLPs, routed experts, shared experts and routers of all layers."""
    n_moe = sum(1 for i in range(layers) if experts and _is_moe_layer(cfg, i))
    n_dense = layers - n_moe
    mlp_bias = bool(cfg.get("mlp_bias"))
    modules = []
    if n_dense:
        inter = _positive_int(cfg, "intermediate_size", "ffn_dim", "n_inner",
                              needed_for="the MLP shapes")
        modules.append(_gated_mlp("mlp", inter, hidden, n_dense, mlp_bias))
    if n_moe:
        inter = _positive_int(cfg, "moe_intermediate_size", "intermediate_size",
                              needed_for="the expert shapes")
        expert_bias = mlp_bias or model_type == "gpt_oss"
        modules.append(_gated_mlp("experts", inter, hidden, experts * n_moe, expert_bias))
        shared_size = int(cfg.get("n_shared_experts") or 0) * inter or int(
            cfg.get("shared_expert_intermediate_size") or 0)
        if shared_size:
            modules.append(_gated_mlp("shared_experts", shared_size, hidden, n_moe, False))
        router = [Matrix(experts, hidden, n_moe)]
        if cfg.get("shared_expert_intermediate_size"):
            router.append(Matrix(1, hidden, n_moe))  # Qwen2-MoE shared_expert_gate
        router_bias = experts * n_moe if model_type in ("gpt_oss", "deepseek_v3") else 0
        modules.append(ModuleKind("router", tuple(router), router_bias))
    return modules


def parse_architecture(config: Mapping[str, Any]) -> Architecture:
    """Read the layer kinds and weight shapes from a Hugging Face ``config.json`` dict."""
    cfg = text_config(config)
    model_type = str(cfg.get("model_type") or "")
    layers = _positive_int(cfg, "num_hidden_layers", "n_layer", "num_layers", needed_for="layers")
    hidden = _positive_int(cfg, "hidden_size", "n_embd", "d_model", needed_for="weight shapes")
    vocab = _positive_int(cfg, "vocab_size", needed_for="the embedding size")
    heads = _positive_int(cfg, "num_attention_heads", "n_head", needed_for="attention shapes")
    max_pos = _positive_int(cfg, "max_position_embeddings", "n_positions",
                            "max_sequence_length", needed_for="the context check", default=None)
    experts = int(next((cfg[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                        if cfg.get(k)), 0))
    kv_layers, attention = _attention(cfg, layers, hidden, heads, model_type)
    feed_forward = _feed_forward(cfg, layers, hidden, experts, model_type)
    # input and post-attention norms per layer (Gemma 2/3: also around the MLP), a final norm
    norms_per_layer = 4 if model_type.startswith(("gemma2", "gemma3")) else 2
    modules = [
        ModuleKind("embeddings", (Matrix(vocab, hidden),)),
        attention,
        *feed_forward,
        ModuleKind("norms", (), norms_per_layer * hidden * layers + hidden),
    ]
    if not cfg.get("tie_word_embeddings", False):
        modules.append(ModuleKind("lm_head", (Matrix(vocab, hidden),)))
    quant = cfg.get("quantization_config")
    return Architecture(
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        kv_layers=kv_layers,
        modules=tuple(modules),
        num_experts=experts if any(m.name == "experts" for m in feed_forward) else 0,
        max_position_embeddings=max_pos,
        checkpoint_quantization=quant.get("quant_method") if isinstance(quant, Mapping) else None,
    )


def _architecture(config: Mapping[str, Any] | Architecture) -> Architecture:
    return config if isinstance(config, Architecture) else parse_architecture(config)


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

    def matrix_bytes(self, m: Matrix) -> int:
        values = _cdiv(m.rows * m.cols * self.value_bits, 8)
        groups = m.rows * (_cdiv(m.cols, self.group_size) if self.group_size else 1)
        scales = groups * self.scale_bytes + _cdiv(groups * self.zero_point_bits, 8)
        return m.count * (values + scales + self.tensor_scale_bytes)


def weight_formats(int4_group_size: int = 128,
                   int4_asymmetric: bool = False) -> dict[str, WeightFormat]:
    """The storage format of each weight precision (scales in bf16 unless the format says)."""
    return {
        "bf16": WeightFormat("bf16", 16),
        "fp8": WeightFormat("fp8", 8, None, 2),  # E4M3 + a bf16 scale per output channel
        "int8": WeightFormat("int8", 8, None, 2),  # + a bf16 scale per output channel
        "int4": WeightFormat("int4", 4, int4_group_size, 2, 4 if int4_asymmetric else 0),
        "mxfp4": WeightFormat("mxfp4", 4, 32, 1),  # E2M1 + an E8M0 scale per 32
        "nvfp4": WeightFormat("nvfp4", 4, 16, 1, 0, 4),  # E2M1 + E4M3 per 16 + fp32 per tensor
    }


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
        raise _unknown("quantize scope", scope, QUANTIZE_SCOPES)
    if scope == "auto":
        scope = "experts" if arch.num_experts else "linear"
    if scope == "experts" and not arch.num_experts:
        raise PlanError(
            "--quantize experts needs a mixture-of-experts model; this config has no "
            "num_local_experts / num_experts / n_routed_experts. Use --quantize linear."
        )
    wanted = ("experts", "shared_experts") if scope == "experts" else (
        "attention", "mlp", "experts", "shared_experts")
    return tuple(name for name in arch.module_names if name in wanted)


def estimate_weights(arch: Architecture, precision: str, scope: str = "auto",
                     formats: Mapping[str, WeightFormat] | None = None) -> WeightEstimate:
    """Bytes of every module kind when ``scope``'s modules are stored in ``precision``."""
    formats = formats or weight_formats()
    if precision not in formats:
        raise _unknown("weight precision", precision, tuple(formats))
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


# --- KV cache ----------------------------------------------------------------------------------
def kv_dtype_bytes(kv_dtype: str) -> int:
    if kv_dtype not in KV_DTYPE_BYTES:
        raise _unknown("KV dtype", kv_dtype, tuple(KV_DTYPE_BYTES))
    return KV_DTYPE_BYTES[kv_dtype]


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
    context are left out (they are counted once, see :func:`shared_prefix_bytes`).
    """
    total = 0
    for layer in arch.kv_layers:
        held = layer.tokens_held(context)
        blocks = _cdiv(held, block_size)
        if held == context:
            blocks -= min(shared_prefix, context) // block_size
        total += blocks * block_size * layer.bytes_per_token(kv_dtype)
    return total


def shared_prefix_bytes(arch: Architecture, context: int, prefix: int, kv_dtype: str,
                        block_size: int) -> int:
    """KV of a prefix shared by all requests, stored once: its full blocks in every layer that
    keeps the whole context (a window layer past its window holds only its own recent tokens)."""
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
    arch = _architecture(config)
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
        groups = [spec for spec, n in counts.items() for _ in range(_cdiv(n, group_size))]
    num_blocks = max(kv_budget_bytes // page // group_size, 0)

    def request_blocks(spec: KVLayer) -> int:
        if spec.window is None:
            return _cdiv(max_model_len, block_size)
        tokens = min(spec.window - 1 + max_num_batched_tokens, max_model_len)
        return _cdiv(tokens, block_size) + 1

    per_request = sum(request_blocks(spec) for spec in groups)
    return VllmKVPrediction(
        num_blocks=num_blocks,
        kv_cache_tokens=num_blocks // len(groups) * block_size,
        max_concurrency=num_blocks / per_request,
        page_size_bytes=page,
        num_groups=len(groups),
        group_size=group_size,
    )


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
    int4_group_size: int = 128
    int4_asymmetric: bool = False
    max_num_batched_tokens: int = 2048


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
        if getattr(s, name) <= 0:
            raise PlanError(f"{name.replace('_', '-')} must be positive, not {getattr(s, name)}.")
    if s.context > s.max_context:
        raise PlanError(f"context {s.context:,} is longer than max-context {s.max_context:,}.")
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
    arch = _architecture(config)
    s = settings
    _check_settings(s)
    kv_dtype_bytes(s.kv_dtype)
    formats = weight_formats(s.int4_group_size, s.int4_asymmetric)
    if s.weights not in formats:
        raise _unknown("weight precision", s.weights, tuple(formats))
    weights = {p: estimate_weights(arch, p, s.quantize, formats) for p in formats}
    if s.kv_budget_bytes is not None:
        budget = s.kv_budget_bytes
    else:
        assert s.memory_bytes is not None
        try:
            budget = kv_budget(s.memory_bytes, s.utilization, weights[s.weights].total_bytes,
                               s.reserve_bytes)
        except PlanError as err:
            usable = int(s.memory_bytes * s.utilization) - s.reserve_bytes
            fitting = [f"{p} ({w.total_bytes / 1e9:.2f} GB)" for p, w in weights.items()
                       if w.total_bytes < usable]
            others = f" Precisions that fit: {', '.join(fitting)}." if fitting else ""
            raise PlanError(f"with {s.weights} weights, {err}{others}") from err
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
                                   max_num_batched_tokens=s.max_num_batched_tokens),
        notes=tuple(notes),
    )
