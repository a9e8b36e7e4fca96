"""Hybrid models' layer list: which layers attend, which keep a recurrent state, which have an
MLP or experts; each recurrent layer's fixed per-request state as vLLM allocates it.

vLLM serves hybrids (Mamba-1, Mamba-2 and gated-delta-net linear attention beside full
attention) with one cache spec per recurrent layer (``MambaSpec``): a conv state and an SSM (or
linear-attention) state per request, whatever the request's length, shaped as
``vllm/model_executor/layers/mamba/mamba_utils.py`` (``MambaStateShapeCalculator``) computes
them, in the model's dtype unless the model says otherwise (Nemotron-H: an fp32 SSM state).
Each model family marks its layers its own way; every convention vLLM 0.32 reads is read here
into one list, and a config that carries a recurrent-layer marker this module does not know is
refused, naming the field, never planned as if every layer attended.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.core.errors import PlanError

ATTENTION, MAMBA1, MAMBA2, GDN = "attention", "mamba", "mamba2", "gated_delta_net"

# fields that mark a model with recurrent layers; one present on a model type not read below
# is refused, naming it
MARKERS = ("layers_block_type", "hybrid_override_pattern", "attn_layer_period",
           "full_attention_interval", "block_types", "mamba_d_state", "ssm_state_size",
           "mamba_n_heads", "mamba_num_heads", "linear_num_value_heads", "state_size",
           "d_state", "mamba_d_ssm")

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class StateLayer:
    """One recurrent layer's per-request state (vLLM's ``MambaSpec``): elements of its conv
    and SSM / linear-attention state, and their bytes per element."""

    kind: str  # mamba (Mamba-1), mamba2, gated_delta_net
    conv_elements: int
    ssm_elements: int
    conv_bytes: int = 2
    ssm_bytes: int = 2

    @property
    def bytes(self) -> int:
        """The state's page: conv and SSM tensors back to back (before vLLM pads it)."""
        return self.conv_elements * self.conv_bytes + self.ssm_elements * self.ssm_bytes

    @property
    def prefix_cache_pages(self) -> int:
        """Pages per request with prefix caching on (vLLM's ``align`` mode): the running state
        and one cached at a block boundary, and for Mamba-2 a prefill checkpoint too."""
        return 3 if self.kind == MAMBA2 else 2


@dataclass(frozen=True)
class Layer:
    """One decoder layer: whether it attends, its recurrent state, its feed-forward."""

    attention: bool
    state: StateLayer | None = None
    ffn: str | None = "dense"  # dense, moe, or None (Nemotron-H: a mixer-only layer)


def _int(cfg: Mapping[str, Any], name: str, model: str, default: int | None = None) -> int:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"the {model} config's `{name}` is {value!r}; expected a positive "
                        "integer (it sizes the recurrent state).")
    return value


def _dtype_bytes(cfg: Mapping[str, Any], name: str, default: str) -> int:
    value = str(cfg.get(name) or default)
    if value == "auto":
        value = default
    if value not in DTYPE_BYTES:
        raise PlanError(f"the model config's `{name}` is {value!r}; the planner knows "
                        f"{', '.join(DTYPE_BYTES)}.")
    return DTYPE_BYTES[value]


def _ssm_bytes(cfg: Mapping[str, Any], conv_bytes: int) -> int:
    """The SSM (temporal) state's bytes per element: ``mamba_ssm_cache_dtype``, else the conv
    state's (vLLM's ``MambaStateDtypeCalculator._mamba_state_dtype``)."""
    value = str(cfg.get("mamba_ssm_cache_dtype") or "auto")
    return conv_bytes if value == "auto" else _dtype_bytes(cfg, "mamba_ssm_cache_dtype", "")


def _model_dtype(cfg: Mapping[str, Any]) -> str:
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")


def _mamba1(cfg: Mapping[str, Any], hidden: int) -> StateLayer:
    """Jamba's Mamba-1 mixer: conv (d_conv - 1) x d_inner, SSM d_inner x d_state."""
    inner = _int(cfg, "mamba_expand", "Jamba") * hidden
    width = _dtype_bytes(cfg, "mamba_cache_dtype", _model_dtype(cfg))
    return StateLayer(MAMBA1, (_int(cfg, "mamba_d_conv", "Jamba") - 1) * inner,
                      inner * _int(cfg, "mamba_d_state", "Jamba"), width,
                      _ssm_bytes(cfg, width))


def _mamba2(cfg: Mapping[str, Any], inner: int, heads: int, head_dim: int, groups: int,
            state: int, conv: int, ssm_default: str) -> StateLayer:
    """A Mamba-2 mixer: conv (conv - 1) x (inner + 2 groups x state), SSM heads x head_dim x
    state."""
    width = _dtype_bytes(cfg, "mamba_cache_dtype", _model_dtype(cfg))
    ssm = _dtype_bytes(cfg, "mamba_ssm_cache_dtype", ssm_default)
    return StateLayer(MAMBA2, (conv - 1) * (inner + 2 * groups * state),
                      heads * head_dim * state, width, ssm)


def _gdn(cfg: Mapping[str, Any]) -> StateLayer:
    """Qwen3-Next's gated delta net: conv (kernel - 1) x (2 k_heads k_dim + v_heads v_dim),
    state v_heads x v_dim x k_dim."""
    k_heads, v_heads = (_int(cfg, "linear_num_key_heads", "Qwen3-Next"),
                        _int(cfg, "linear_num_value_heads", "Qwen3-Next"))
    k_dim, v_dim = (_int(cfg, "linear_key_head_dim", "Qwen3-Next"),
                    _int(cfg, "linear_value_head_dim", "Qwen3-Next"))
    conv = _int(cfg, "linear_conv_kernel_dim", "Qwen3-Next")
    width = _dtype_bytes(cfg, "mamba_cache_dtype", _model_dtype(cfg))
    return StateLayer(GDN, (conv - 1) * (2 * k_heads * k_dim + v_heads * v_dim),
                      v_heads * v_dim * k_dim, width, _ssm_bytes(cfg, width))


def _nemotron_h(cfg: Mapping[str, Any], layers: int) -> list[Layer]:
    pattern = str(cfg["hybrid_override_pattern"])
    if len(pattern) != layers:
        raise PlanError(f"the model config's `hybrid_override_pattern` has {len(pattern)} "
                        f"characters but `num_hidden_layers` is {layers}.")
    heads, head_dim = (_int(cfg, "mamba_num_heads", "Nemotron-H"),
                       _int(cfg, "mamba_head_dim", "Nemotron-H"))
    state = _mamba2(cfg, heads * head_dim, heads, head_dim, _int(cfg, "n_groups", "Nemotron-H"),
                    _int(cfg, "ssm_state_size", "Nemotron-H"),
                    _int(cfg, "conv_kernel", "Nemotron-H"), "float32")
    kinds = {"M": Layer(False, state, None), "*": Layer(True, None, None),
             "-": Layer(False, None, "dense"), "E": Layer(False, None, "moe")}
    out = []
    for i, mark in enumerate(pattern):
        if mark not in kinds:
            raise PlanError(f"layer {i} of the model config's `hybrid_override_pattern` is "
                            f"{mark!r}; the planner knows M (Mamba-2), * (attention), - (MLP) "
                            "and E (experts).")
        out.append(kinds[mark])
    return out


def _granite(cfg: Mapping[str, Any], layers: int, hidden: int, ffn: str) -> list[Layer]:
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type")
    field = "layer_types" if cfg.get("layer_types") else "layers_block_type"
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise PlanError(f"the Granite hybrid config's `{field}` must list one kind per layer "
                        f"({layers}).")
    heads = _int(cfg, "mamba_n_heads", "Granite hybrid")
    head_dim = _int(cfg, "mamba_d_head", "Granite hybrid", hidden * int(
        cfg.get("mamba_expand") or 2) // heads)
    state = _mamba2(cfg, heads * head_dim, heads, head_dim,
                    _int(cfg, "mamba_n_groups", "Granite hybrid", 1),
                    _int(cfg, "mamba_d_state", "Granite hybrid"),
                    _int(cfg, "mamba_d_conv", "Granite hybrid"), _model_dtype(cfg))
    out = []
    for i, kind in enumerate(kinds):
        if kind in ("attention", "full_attention"):
            out.append(Layer(True, None, ffn))
        elif kind in ("mamba", "linear_attention"):
            out.append(Layer(False, state, ffn))
        else:
            raise PlanError(f"layer {i} of the model config's `{field}` is {kind!r}; the "
                            "planner knows attention / full_attention and mamba / "
                            "linear_attention for Granite hybrids.")
    return out


def _qwen3_next(cfg: Mapping[str, Any], layers: int) -> list[Layer]:
    kinds = cfg.get("layer_types")
    if kinds is None:
        interval = _int(cfg, "full_attention_interval", "Qwen3-Next")
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(layers)]
    if len(kinds) != layers:
        raise PlanError(f"the model config's `layer_types` lists {len(kinds)} layers but "
                        f"`num_hidden_layers` is {layers}.")
    state, out = _gdn(cfg), []
    for i, kind in enumerate(kinds):
        if kind not in ("full_attention", "linear_attention"):
            raise PlanError(f"layer {i} of the model config's `layer_types` is {kind!r}; the "
                            "planner knows full_attention and linear_attention for Qwen3-Next.")
        out.append(Layer(kind == "full_attention", None if kind == "full_attention" else state,
                         "moe"))
    return out


def _jamba(cfg: Mapping[str, Any], layers: int, hidden: int) -> list[Layer]:
    period, offset = _int(cfg, "attn_layer_period", "Jamba"), int(cfg.get("attn_layer_offset")
                                                                  or 0)
    e_period = int(cfg.get("expert_layer_period") or 1)
    e_offset = int(cfg.get("expert_layer_offset") or 0)
    experts = int(cfg.get("num_experts") or 1)
    state = _mamba1(cfg, hidden)
    return [Layer(i % period == offset, None if i % period == offset else state,
                  "moe" if experts > 1 and i % e_period == e_offset else "dense")
            for i in range(layers)]


def _falcon_h1(cfg: Mapping[str, Any], hidden: int) -> StateLayer:
    heads = _int(cfg, "mamba_n_heads", "Falcon-H1")
    inner = int(cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand") or 2) * hidden)
    head_dim = _int(cfg, "mamba_d_head", "Falcon-H1", inner // heads)
    return _mamba2(cfg, inner, heads, head_dim, _int(cfg, "mamba_n_groups", "Falcon-H1", 1),
                   _int(cfg, "mamba_d_state", "Falcon-H1"), _int(cfg, "mamba_d_conv", "Falcon-H1"),
                   _model_dtype(cfg))


def layer_list(cfg: Mapping[str, Any], layers: int, hidden: int, model_type: str
               ) -> list[Layer] | None:
    """Every layer of a hybrid model (None: a model whose layers all attend, as the attention
    planner reads them). Raises for a recurrent-layer marker on a model type not read here."""
    if model_type == "nemotron_h" and cfg.get("hybrid_override_pattern"):
        return _nemotron_h(cfg, layers)
    if model_type == "granitemoehybrid":
        kinds = cfg.get("layer_types") or cfg.get("layers_block_type") or []
        if all(k in ("attention", "full_attention") for k in kinds):
            return None  # granite-4.0-micro: attention only, planned as such (vLLM too)
        return _granite(cfg, layers, hidden, "moe" if cfg.get("num_local_experts") else "dense")
    if model_type in ("qwen3_next",):
        return _qwen3_next(cfg, layers)
    if model_type == "jamba":
        return _jamba(cfg, layers, hidden)
    if model_type == "falcon_h1":  # every layer: attention and Mamba-2 side by side, an MLP
        state = _falcon_h1(cfg, hidden)
        return [Layer(True, state, "dense") for _ in range(layers)]
    kinds = cfg.get("layer_types") or []
    odd = sorted({k for k in kinds if k not in ("full_attention", "sliding_attention")})
    if odd:
        raise PlanError(
            f"the model config's `layer_types` lists {', '.join(map(repr, odd))} layers "
            f"(model_type {model_type!r}); the planner reads recurrent layers of Jamba, "
            "Nemotron-H, Granite 4.0 hybrids, Qwen3-Next and Falcon-H1 only, and will not plan "
            "them as attention. Plan a config of one of those, or serve the model and read "
            "vLLM's own KV-cache log.")
    found = [name for name in MARKERS if cfg.get(name) is not None]
    if found:
        raise PlanError(
            f"the model config carries `{found[0]}` (model_type {model_type!r}): a recurrent "
            "(Mamba / linear-attention) layer marker the planner does not read for this model "
            "type; it will not plan its layers as attention. The planner reads Jamba, "
            "Nemotron-H, Granite 4.0 hybrids, Qwen3-Next and Falcon-H1.")
    return None
