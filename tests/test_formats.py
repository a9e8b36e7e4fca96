"""The format table: a checkpoint's config.json identifies one row, and the stages read it."""

from __future__ import annotations

import pytest

from pipeline.core import formats, hardware
from pipeline.core.artifacts import PlanTarget, Row
from pipeline.core.errors import ConfigError
from pipeline.plan import capacity
from pipeline.plan.architecture import Matrix
from pipeline.report import placement
from pipeline.serve import doctor


def _config(fmt: str, weights: dict, acts: dict | None = None, **groups: dict) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {"quantization_config": {"format": fmt,
                                    "config_groups": groups or {"group_0": group}}}


W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
FP8 = {"num_bits": 8, "type": "float", "strategy": "channel"}
ACT8F = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
FP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}


@pytest.mark.parametrize(("config", "key", "group", "symmetric"), [
    ({}, "bf16", None, True),
    (_config("pack-quantized", W4), "int4", 64, True),
    (_config("pack-quantized", {**W4, "symmetric": False}), "int4", 64, False),  # AWQ
    (_config("float-quantized", FP8, ACT8F), "fp8", None, True),
    (_config("float-quantized", {**FP8, "strategy": "block", "block_structure": [128, 128]},
             {**ACT8F, "strategy": "group", "group_size": 128}), "fp8-block", None, True),
    (_config("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"},
             {"num_bits": 8, "type": "int", "dynamic": True}), "int8", None, True),
    (_config("nvfp4-pack-quantized", FP4, {**FP4, "dynamic": "local"}), "nvfp4", 16, True),
    (_config("nvfp4-pack-quantized", FP4), "nvfp4a16", 16, True),
    (_config("mxfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "group",
                                      "group_size": 32}), "mxfp4", 32, True),
])
def test_a_checkpoint_is_identified_from_its_quantization_config(
        config: dict, key: str, group: int | None, symmetric: bool) -> None:
    found = formats.identify(config)
    assert (found.key, found.group_size, found.symmetric) == (key, group, symmetric)
    assert found.precision == formats.get(key).precision


def test_nvfp4_with_and_without_a4_are_two_rows_planned_with_the_same_bytes() -> None:
    w4a4, w4a16 = formats.get("nvfp4"), formats.get("nvfp4a16")
    assert w4a4.activation_bits == 4 and w4a16.weight_only
    assert w4a4.precision == w4a16.precision == "nvfp4"
    assert "nvfp4a16" not in formats.WEIGHT_PRECISIONS  # one planner precision for both


def test_a_format_the_table_lacks_is_refused_naming_the_group_and_the_table() -> None:
    w3a16 = _config("pack-quantized", {**W4, "num_bits": 3})  # int3 weight-only: no row
    with pytest.raises(ConfigError, match=r"x/config.json: quantization_config.config_groups."
                                          r"group_0.*3-bit.*pipeline/core/formats.py"):
        formats.identify(w3a16, "x/config.json")
    with pytest.raises(ConfigError, match="no `weights`"):
        formats.identify(_config("naive-quantized", {}))


def test_a_searched_mix_is_mixed_with_its_layers_counted_per_format() -> None:
    config = _config("mixed-precision", {}, None,
                     group_int4={"targets": ["a", "b"], "weights": W4, "format": "pack-quantized"},
                     group_fp8={"targets": ["c"], "weights": FP8, "input_activations": ACT8F,
                                "format": "float-quantized"})
    found = formats.identify(config)
    assert found.key == formats.MIXED and found.precision == formats.MIXED
    assert found.layers == {"int4": 2, "fp8": 1} and found.format is None


def test_block_scales_and_zero_points_are_in_the_planned_bytes() -> None:
    m = Matrix(256, 576, 1)
    block = capacity.weight_formats()["fp8-block"]
    assert block.matrix_bytes(m) == 256 * 576 + (2 * 5) * 4  # fp32 per 128x128 block (5 cols)
    sym = capacity.weight_formats(64)["int4"].matrix_bytes(m)
    asym = capacity.weight_formats(64, int4_asymmetric=True)["int4"].matrix_bytes(m)
    assert asym - sym == 256 * 9 * 4 // 8  # a 4-bit zero point per group of 64
    nvfp4 = capacity.weight_formats()["nvfp4"].matrix_bytes(m)
    assert nvfp4 == 256 * 576 // 2 + 256 * 36 + 4


def test_the_report_plans_a_row_by_its_recorded_group_and_zero_points_not_its_label() -> None:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "torch_dtype": "bfloat16"}
    target = PlanTarget(gpu="h100-80gb")

    def planned(**fields) -> int:
        row = Row(name="v", recipe="v", scheme="a label", format="pack-quantized",
                  precision="int4", weight_bytes=1, weight_ratio=0.3, **fields)
        placement.apply_plan(row, config, target)
        return row.plan.planned_weight_bytes

    g64, g128 = planned(group_size=64), planned(group_size=128)
    assert g64 > g128  # twice the scales
    assert planned(group_size=64, symmetric=False) > g64  # AWQ's zero points


def test_doctor_rows_come_from_the_table() -> None:
    avx2 = hardware.Profile(target="cpu", machine="x86_64", cpu_model="x", cores=2,
                            cpu_flags=("avx2",), vllm_cpu_isa="native", vllm="", gpus=())
    rows = {row.recipes: row for row in doctor.cpu_support(avx2, {"library": "_C_AVX2",
                                                                 "ops": ["onednn_scaled_mm"]})}
    assert set(formats.FORMATS) <= set(rows)
    assert rows["int4"].status == doctor.UNSUPPORTED and "cpu_gemm_wna16" in rows["int4"].why
    assert rows["fp8-block"].status == doctor.UNSUPPORTED and "AMX" in rows["fp8-block"].why
    assert rows["int8"].status == doctor.SERVES
    h100 = hardware.Profile(target="cuda", machine="x86_64", cpu_model="x", cores=16,
                            cpu_flags=(), vllm_cpu_isa="native", vllm="",
                            gpus=(hardware.Gpu(name="H100", memory_mib=80000,
                                               compute_capability="9.0"),))
    gpu = {row.recipes: row.status for row in doctor.cuda_support(h100)}
    assert gpu["nvfp4"] == doctor.PARTIAL and gpu["nvfp4a16"] == doctor.SERVES
    assert gpu["fp8-block"] == doctor.SERVES and gpu["fp8"] == doctor.SERVES
