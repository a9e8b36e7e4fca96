"""Read a checkpoint on disk without loading the model: format, bytes, quantized-layer sizes.

Only safetensors headers are read (an 8-byte length, then JSON), so this is instant at any size.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import BaselineError
from pipeline.core.formats import quant_config

# Tensors that make up a quantized linear layer in compressed-tensors checkpoints.
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_global_scale",
                  "weight_shape", "input_scale", "input_zero_point", "input_global_scale")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class CheckpointSize:
    """Sizes of one checkpoint; ratios are against the baseline's weights in bf16."""

    format: str  # compressed-tensors format, or "dense" for an unquantized model
    checkpoint_bytes: int  # every file in the directory
    weight_bytes: int  # every tensor in the safetensors files
    quantized_layers: int
    quantized_layer_bytes: int  # those layers' weights, scales and zero points
    quantized_layer_bf16_bytes: int  # the same layers' weights in bf16

    @property
    def quantized_layer_ratio(self) -> float | None:
        if not self.quantized_layer_bf16_bytes:
            return None
        return self.quantized_layer_bytes / self.quantized_layer_bf16_bytes


def tensors(model_dir: Path) -> dict[str, TensorInfo]:
    """Every tensor in every ``*.safetensors`` file of ``model_dir``, from the headers."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BaselineError(f"{model_dir} holds no *.safetensors files: save the model with "
                            "safe_serialization (the default of save_pretrained).")
    out: dict[str, TensorInfo] = {}
    for path in files:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            out[name] = TensorInfo(meta["dtype"], tuple(meta["shape"]), end - start)
    return out


def quantization_format(model_dir: Path) -> str:
    """``quantization_config.format`` from config.json, or ``dense``."""
    config = json.loads((model_dir / "config.json").read_text())
    qc = quant_config(config)
    return str(qc.get("format") or qc.get("quant_method") or "dense")


def measure(model_dir: Path, baseline_dir: Path | None = None) -> CheckpointSize:
    """Sizes of ``model_dir``; quantized-layer bf16 bytes come from the baseline's shapes."""
    found = tensors(model_dir)
    reference = tensors(baseline_dir) if baseline_dir else {}
    layers = {name.rsplit(".", 1)[0] for name in found
              if name.rsplit(".", 1)[-1] in ("weight_packed", "weight_scale")}
    layer_bytes = sum(info.nbytes for name, info in found.items()
                      if name.rsplit(".", 1)[0] in layers
                      and name.rsplit(".", 1)[-1] in ("weight", *QUANT_SUFFIXES))
    shapes_known = all(f"{layer}.weight" in reference for layer in layers)
    bf16_bytes = sum(2 * reference[f"{layer}.weight"].numel for layer in layers) if (
        shapes_known) else 0
    return CheckpointSize(
        format=quantization_format(model_dir),
        checkpoint_bytes=sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file()),
        weight_bytes=sum(info.nbytes for info in found.values()),
        quantized_layers=len(layers),
        quantized_layer_bytes=layer_bytes,
        quantized_layer_bf16_bytes=bf16_bytes,
    )


def partial_blocks(model_dir: Path) -> list[str]:
    """The layers of a block-quantized checkpoint whose weights are not whole blocks, as
    ``name (out x in)``, read from the headers: llmcompressor scales a layer's last, partial
    block as a block of its own, which vLLM refuses to serve ("not divisible by weight
    quantization block_n") and compressed-tensors cannot de-compress along a layer's input.
    Empty for any other checkpoint."""
    config = json.loads((model_dir / "config.json").read_text())
    qc = quant_config(config)
    blocks = {tuple(w["block_structure"]) for g in (qc.get("config_groups") or {}).values()
              if (w := g.get("weights") or {}).get("strategy") == "block"
              and w.get("block_structure")}
    if len(blocks) != 1:  # none; or several, which a layer's scales cannot be told apart by
        return []
    rows, cols = blocks.pop()
    found = tensors(model_dir)
    out = []
    for name, scale in found.items():
        layer = name.removesuffix(".weight_scale")
        weight = found.get(f"{layer}.weight")
        if layer == name or weight is None or len(weight.shape) != 2:
            continue
        out_features, in_features = weight.shape
        blocked = scale.shape == (math.ceil(out_features / rows), math.ceil(in_features / cols))
        if blocked and (out_features % rows or in_features % cols):
            out.append(f"{layer} ({out_features} x {in_features})")
    return sorted(out)


def checkpoint_kv_dtype(config: dict[str, Any]) -> str | None:
    """The KV-cache dtype a compressed-tensors checkpoint makes vLLM use (its
    ``kv_cache_scheme``: vLLM stores the cache in FP8 unless ``--kv-cache-dtype`` says
    otherwise), or None when the checkpoint asks for none."""
    qc = quant_config(config)
    scheme = qc.get("kv_cache_scheme")
    if not isinstance(scheme, dict):
        return None
    return "fp8" if scheme.get("type") == "float" and scheme.get("num_bits") == 8 else None
