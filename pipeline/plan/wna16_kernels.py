"""Which kernel vLLM's CUDA build gives each weight-only INT4/INT8 (WNA16) layer group.

vLLM logs each mixed-precision kernel it uses once ("Using MacheteLinearKernel for
CompressedTensorsWNA16"), not which layers got it; a Hopper card runs Machete only on layers
whose shapes meet its rules and Marlin on the rest. This applies vLLM 0.32's own rules
(``model_executor/kernels/linear``: the CUDA kernels in priority order, each one's
``can_implement``) to the model's layer shapes per tensor-parallel rank, so the report can say
which layers ran on which kernel; the engine's log lines confirm the set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.core.formats import quant_config
from pipeline.plan.architecture import text_config

MACHETE = "MacheteLinearKernel"
MARLIN = "MarlinLinearKernel"
FALLBACK = "a fallback kernel (Conch, Exllama or Triton)"
MACHETE_GROUPS = (-1, 64, 128)  # bf16 / fp16 activations (machete_utils.py)
MACHETE_BLOCK = (64, 128)  # input and output features must divide by these (prepacked block)
MARLIN_GROUPS = (-1, 32, 64, 128)  # marlin_utils.py
MARLIN_MIN_CAPABILITY = 75


def kernel_for(in_features: int, out_features: int, group_size: int, capability: int,
               full_in_features: int | None = None) -> str:
    """vLLM's choice for one layer of this per-rank shape (``capability``: 90 for 9.0)."""
    if (capability == 90 and group_size in MACHETE_GROUPS
            and in_features % MACHETE_BLOCK[0] == 0 and out_features % MACHETE_BLOCK[1] == 0):
        return MACHETE
    full = full_in_features or in_features
    straddles = group_size != -1 and group_size < full and in_features % group_size != 0
    if capability >= MARLIN_MIN_CAPABILITY and group_size in MARLIN_GROUPS and not straddles:
        return MARLIN
    return FALLBACK


def layer_groups(config: Mapping[str, Any], tensor_parallel: int = 1
                 ) -> dict[str, tuple[int, int, int]]:
    """Each linear layer group of a dense decoder as vLLM builds it (q, k, v merged; gate and
    up merged): (input features on one rank, output features on one rank, full input)."""
    cfg = text_config(config)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg["intermediate_size"])
    tp = tensor_parallel
    kv_per_rank = max(kv_heads // tp, 1)  # replicated past the head count
    groups = {"qkv_proj": (hidden, (heads // tp + 2 * kv_per_rank) * head_dim, hidden),
              "o_proj": (heads * head_dim // tp, hidden, heads * head_dim)}
    if not (cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")):
        groups.update(gate_up_proj=(hidden, 2 * inter // tp, hidden),
                      down_proj=(inter // tp, hidden, inter))
    return groups


def weight_group_size(config: Mapping[str, Any]) -> int | None:
    """The group size of the checkpoint's weight quantization (-1: per channel); None when
    its config names none."""
    quant = quant_config(config)
    for group in (quant.get("config_groups") or {}).values():
        weights = (group or {}).get("weights") or {}
        if weights.get("num_bits") in (4, 8) and weights.get("type", "int") == "int":
            size = weights.get("group_size")
            return int(size) if size is not None else -1
    return None


def by_layer(config: Mapping[str, Any], capability: str, tensor_parallel: int = 1
             ) -> dict[str, str]:
    """Layer group -> kernel for a WNA16 checkpoint on a card of ``capability`` ("9.0");
    empty where the config names no weight group or the card's capability is unknown."""
    group = weight_group_size(config)
    if group is None or not capability:
        return {}
    cc = int(capability.replace(".", ""))
    return {name: kernel_for(i, o, group, cc, full)
            for name, (i, o, full) in layer_groups(config, tensor_parallel).items()}


def describe(kernels: Mapping[str, str]) -> str:
    """``MarlinLinearKernel for qkv_proj, o_proj, down_proj; MacheteLinearKernel for
    gate_up_proj``."""
    chosen: dict[str, list[str]] = {}
    for layer, kernel in kernels.items():
        chosen.setdefault(kernel, []).append(layer)
    return "; ".join(f"{k} for {', '.join(layers)}" for k, layers in chosen.items())
