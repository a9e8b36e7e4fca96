"""A model's architecture from its ``config.json``: layers, attention kinds, matrices.

Pure functions on plain dicts and small frozen dataclasses; nothing is read, loaded or printed.
The KV model follows vLLM's paged allocator: every attention layer stores its cache in blocks of
``block_size`` tokens; a full-attention layer keeps every token of a request, a sliding-window
layer at most ``window`` tokens, and a multi-head-latent-attention (MLA) layer one compressed
latent per token instead of per-head K and V.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.core.errors import PlanError
from pipeline.core.formats import QUANT_SECTIONS, quant_config
from pipeline.plan import recurrent
from pipeline.plan.recurrent import GDN, MAMBA1, Layer, StateLayer

_NESTED_CONFIGS = ("text_config", "language_config", "llm_config")


_MISSING = object()


KV_DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def unknown_choice(what: str, value: str, choices: Sequence[str]) -> PlanError:
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
    attention_heads: int = 0
    kv_heads: int = 0  # 0: latent attention (MLA), whose cache every tensor-parallel rank holds
    state_layers: tuple[StateLayer, ...] = ()  # recurrent layers' per-request state (hybrids)

    def kv_shards(self, tensor_parallel: int, pipeline_parallel: int = 1) -> int:
        """Over how many devices one token's KV cache is split: KV heads over the tensor-parallel
        ranks (vLLM replicates heads when there are more ranks than heads; an MLA latent is on
        every rank), layers over the pipeline stages."""
        heads = min(tensor_parallel, self.kv_heads) if self.kv_heads else 1
        return heads * pipeline_parallel

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
        kinds = Counter(layer.kind for layer in self.state_layers)
        names = {MAMBA1: "Mamba-1", "mamba2": "Mamba-2", GDN: "gated delta net"}
        parts += [f"{n} {names[k]}" for k, n in kinds.items()]
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
                if not k.endswith("_config") or k in QUANT_SECTIONS
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
        # Qwen3-Next's q projection also yields a sigmoid gate on the output (vLLM's
        # attn_output_gate, default on): twice the rows
        q_rows = 2 * q_out if model_type == "qwen3_next" and cfg.get(
            "attn_output_gate", True) else q_out
        shapes = [(q_rows, hidden), (kv_out, hidden), (kv_out, hidden), (hidden, q_out)]
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
                  model_type: str, kinds: Sequence[str | None] | None = None
                  ) -> list[ModuleKind]:
    """Dense MLPs, routed experts, shared experts and routers of all layers (``kinds``: each
    layer's, dense / moe / None, where a hybrid's layer list says)."""
    if kinds is None:
        kinds = ["moe" if experts and _is_moe_layer(cfg, i) else "dense" for i in range(layers)]
    n_moe = sum(1 for k in kinds if k == "moe")
    n_dense = sum(1 for k in kinds if k == "dense")
    mlp_bias = bool(cfg.get("mlp_bias"))
    modules = []
    if n_dense:
        inter = _positive_int(cfg, "intermediate_size", "ffn_dim", "n_inner",
                              needed_for="the MLP shapes")
        if model_type == "nemotron_h":  # up and down only (squared ReLU), no gate
            modules.append(ModuleKind("mlp", (Matrix(inter, hidden, n_dense),
                                              Matrix(hidden, inter, n_dense))))
        else:
            modules.append(_gated_mlp("mlp", inter, hidden, n_dense, mlp_bias))
    if n_moe:
        inter = _positive_int(cfg, "moe_intermediate_size", "intermediate_size",
                              needed_for="the expert shapes")
        expert_bias = mlp_bias or model_type == "gpt_oss"
        modules.append(_gated_mlp("experts", inter, hidden, experts * n_moe, expert_bias))
        shared_size = int(cfg.get("n_shared_experts") or 0) * inter or int(
            cfg.get("shared_expert_intermediate_size") or cfg.get("shared_intermediate_size")
            or 0)
        if shared_size:
            modules.append(_gated_mlp("shared_experts", shared_size, hidden, n_moe, False))
        router = [Matrix(experts, hidden, n_moe)]
        if cfg.get("shared_expert_intermediate_size"):
            router.append(Matrix(1, hidden, n_moe))  # Qwen2-MoE shared_expert_gate
        router_bias = experts * n_moe if model_type in ("gpt_oss", "deepseek_v3") else 0
        modules.append(ModuleKind("router", tuple(router), router_bias))
    return modules


def _mixers(cfg: Mapping[str, Any], hidden: int, hybrid: Sequence[Layer]) -> ModuleKind:
    """The recurrent mixers' weights (Hugging Face's modules): projections as matrices; conv
    kernels, A, D, dt biases and gated norms as vectors."""
    matrices: list[Matrix] = []
    vectors = 0
    states = [x.state for x in hybrid if x.state is not None]
    if not states:
        return ModuleKind("mixer")
    n, kind = len(states), states[0].kind
    if kind == MAMBA1:  # Jamba: in, x, dt and out projections; conv; A_log, D; three norms
        inner = int(cfg["mamba_expand"]) * hidden
        rank = int(cfg.get("mamba_dt_rank") or cdiv(hidden, 16))
        state, conv = int(cfg["mamba_d_state"]), int(cfg["mamba_d_conv"])
        matrices = [Matrix(2 * inner, hidden, n), Matrix(rank + 2 * state, inner, n),
                    Matrix(inner, rank, n), Matrix(hidden, inner, n)]
        vectors = n * (inner * conv + inner + inner + inner * state + inner + rank + 2 * state)
    elif kind == GDN:  # Qwen3-Next: qkvz and ba projections, conv, dt_bias, A_log, norm, out
        keys = int(cfg["linear_num_key_heads"]) * int(cfg["linear_key_head_dim"])
        v_heads = int(cfg["linear_num_value_heads"])
        values = v_heads * int(cfg["linear_value_head_dim"])
        conv = int(cfg["linear_conv_kernel_dim"])
        matrices = [Matrix(2 * keys + 2 * values, hidden, n), Matrix(2 * v_heads, hidden, n),
                    Matrix(hidden, values, n)]
        vectors = n * ((2 * keys + values) * conv + 2 * v_heads
                       + int(cfg["linear_value_head_dim"]))
    else:  # Mamba-2: in projection (z, x, B, C, dt), conv, dt_bias, A_log, D, gated norm, out
        conv_dim = states[0].conv_elements // _conv_width(cfg)
        state_dim = states[0].ssm_elements
        heads = int(cfg.get("mamba_num_heads") or cfg.get("mamba_n_heads"))
        inner = state_dim // int(cfg.get("ssm_state_size") or cfg.get("mamba_d_state"))
        matrices = [Matrix(inner + conv_dim + heads, hidden, n), Matrix(hidden, inner, n)]
        taps = _conv_width(cfg) + 1
        # Falcon-H1 gates the scan without a norm unless mamba_rms_norm (its default: off)
        norm = inner if cfg.get("model_type") != "falcon_h1" or cfg.get("mamba_rms_norm") else 0
        vectors = n * (conv_dim * (taps + 1) + 3 * heads + norm)
    return ModuleKind("mixer", tuple(matrices), vectors)


def _conv_width(cfg: Mapping[str, Any]) -> int:
    """A Mamba-2 conv's taps less one (the state keeps the last ``taps - 1`` inputs)."""
    return int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv")) - 1


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
    hybrid = recurrent.layer_list(cfg, layers, hidden, model_type)
    if hybrid is None:
        kv_layers, attention = _attention(cfg, layers, hidden, heads, model_type)
        feed_forward = _feed_forward(cfg, layers, hidden, experts, model_type)
        mixers: list[ModuleKind] = []
    else:  # only the layers that attend have a KV cache; the others, a state
        plain = {k: v for k, v in cfg.items() if k not in ("layer_types", "sliding_window")}
        kv_layers, attention = _attention(plain, sum(1 for x in hybrid if x.attention), hidden,
                                          heads, model_type)
        feed_forward = _feed_forward(cfg, layers, hidden, experts, model_type,
                                     [x.ffn for x in hybrid])
        mixers = [_mixers(cfg, hidden, hybrid)]
    # input and post-attention norms per layer (Gemma 2/3: also around the MLP; Nemotron-H:
    # one, each layer a single block), a final norm
    norms_per_layer = 4 if model_type.startswith(("gemma2", "gemma3")) else (
        1 if model_type == "nemotron_h" else 2)
    modules = [
        ModuleKind("embeddings", (Matrix(vocab, hidden),)),
        attention,
        *mixers,
        *feed_forward,
        ModuleKind("norms", (), norms_per_layer * hidden * layers + hidden),
    ]
    if not cfg.get("tie_word_embeddings", False):
        modules.append(ModuleKind("lm_head", (Matrix(vocab, hidden),)))
    quant = quant_config(cfg)
    return Architecture(
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        kv_layers=kv_layers,
        modules=tuple(modules),
        num_experts=experts if any(m.name == "experts" for m in feed_forward) else 0,
        max_position_embeddings=max_pos,
        checkpoint_quantization=quant.get("quant_method") if isinstance(quant, Mapping) else None,
        attention_heads=heads,
        kv_heads=0 if cfg.get("kv_lora_rank") else int(
            cfg.get("num_key_value_heads") or cfg.get("num_kv_heads") or cfg.get("n_head_kv")
            or heads),
        state_layers=tuple(x.state for x in hybrid or () if x.state is not None),
    )


def as_architecture(config: Mapping[str, Any] | Architecture) -> Architecture:
    """A parsed architecture as it is, a config.json mapping parsed."""
    return config if isinstance(config, Architecture) else parse_architecture(config)


# --- KV cache ----------------------------------------------------------------------------------
def kv_dtype_bytes(kv_dtype: str) -> int:
    if kv_dtype not in KV_DTYPE_BYTES:
        raise unknown_choice("KV dtype", kv_dtype, tuple(KV_DTYPE_BYTES))
    return KV_DTYPE_BYTES[kv_dtype]
