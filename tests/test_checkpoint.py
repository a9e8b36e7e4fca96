from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.quantize import checkpoint


def _model_dir(path: Path, tensors: dict[str, torch.Tensor], qconfig: dict | None = None) -> Path:
    path.mkdir()
    config = {"model_type": "llama"}
    if qconfig:
        config["quantization_config"] = qconfig
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_measure_counts_quantized_layers_against_their_bf16_bytes(tmp_path: Path) -> None:
    base = _model_dir(tmp_path / "base", {
        "layer.weight": torch.zeros(64, 128, dtype=torch.bfloat16),
        "embed.weight": torch.zeros(100, 128, dtype=torch.bfloat16),
    })
    variant = _model_dir(tmp_path / "variant", {
        "layer.weight_packed": torch.zeros(64, 16, dtype=torch.int32),  # 4 bits x 128 columns
        "layer.weight_scale": torch.zeros(64, 2, dtype=torch.bfloat16),  # group 64
        "layer.weight_shape": torch.tensor([64, 128], dtype=torch.int64),
        "embed.weight": torch.zeros(100, 128, dtype=torch.bfloat16),
    }, {"format": "pack-quantized"})
    size = checkpoint.measure(variant, base)
    assert size.format == "pack-quantized"
    assert size.quantized_layers == 1
    assert size.quantized_layer_bytes == 64 * 16 * 4 + 64 * 2 * 2 + 2 * 8
    assert size.quantized_layer_bf16_bytes == 64 * 128 * 2
    assert size.weight_bytes == size.quantized_layer_bytes + 100 * 128 * 2
    assert size.checkpoint_bytes > size.weight_bytes  # headers and config.json
    assert 0.26 < size.quantized_layer_ratio < 0.27


def test_dense_model_has_no_quantized_layers(tmp_path: Path) -> None:
    base = _model_dir(tmp_path / "base", {"w.weight": torch.zeros(8, 8, dtype=torch.bfloat16)})
    size = checkpoint.measure(base)
    assert size.format == "dense" and size.quantized_layers == 0
    assert size.quantized_layer_ratio is None and size.weight_bytes == 128


def test_block_scales_that_do_not_tile_a_layer_are_named(tmp_path: Path) -> None:
    block = {"format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                           "block_structure": [128, 128]}}}}
    fp8 = torch.float8_e4m3fn
    variant = _model_dir(tmp_path / "block", {
        "a.weight": torch.zeros(576, 576, dtype=fp8),  # SmolLM2's widths: 4.5 blocks
        "a.weight_scale": torch.zeros(5, 5),
        "b.weight": torch.zeros(256, 128, dtype=fp8),  # whole blocks
        "b.weight_scale": torch.zeros(2, 1),
        "c.weight": torch.zeros(64, 100, dtype=fp8),  # a scale per channel, not blocks
        "c.weight_scale": torch.zeros(64, 1),
    }, block)
    assert checkpoint.partial_blocks(variant) == ["a (576 x 576)"]
    channel = _model_dir(tmp_path / "channel", {"a.weight": torch.zeros(576, 576, dtype=fp8),
                                                 "a.weight_scale": torch.zeros(5, 5)},
                         {"format": "float-quantized", "config_groups": {"group_0": {
                             "weights": {"num_bits": 8, "type": "float",
                                         "strategy": "channel"}}}})
    assert checkpoint.partial_blocks(channel) == []
