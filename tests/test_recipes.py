from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.core import paths
from pipeline.core.errors import RecipeError
from pipeline.quantize import recipes

SHIPPED = ["awq", "fp8", "fp8-block", "int4", "int8", "int8-fp8kv", "mxfp4", "nvfp4", "nvfp4a16",
           "w8a16"]


def write(tmp_path: Path, text: str, name: str = "custom.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_recipes_are_listed_and_valid() -> None:
    assert recipes.available() == SHIPPED
    for name in SHIPPED:
        recipe = recipes.load(name)
        assert recipe.recovery_threshold_pct is not None
        assert recipe.description
        if recipe.calibration:
            assert Path(recipe.calibration.dataset).is_file()


@pytest.mark.parametrize("name", SHIPPED)
def test_llmcompressor_accepts_each_shipped_recipe_file_as_is(name: str) -> None:
    llm_recipe = recipes.instantiate(recipes.load(name))
    assert llm_recipe.modifiers, "oneshot would do nothing"


def test_data_free_and_calibrated_recipes() -> None:
    assert recipes.load("fp8").calibration is None
    assert recipes.load("mxfp4").calibration is None
    int4 = recipes.load("int4")
    assert int4.calibration is not None and int4.calibration.num_samples > 0
    overridden = int4.with_calibration(num_samples=8, max_seq_length=None)
    assert overridden.calibration.num_samples == 8
    assert overridden.calibration.max_seq_length == int4.calibration.max_seq_length
    assert recipes.load("fp8").with_calibration(num_samples=8).calibration is None


def test_unknown_recipe_lists_the_ones_that_exist() -> None:
    with pytest.raises(RecipeError) as err:
        recipes.load("fp9")
    assert "'fp9'" in str(err.value)
    for name in SHIPPED:
        assert name in str(err.value)


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "qpipe:\n  description: x\nquantize_stage:\n  - [unclosed\n")
    with pytest.raises(RecipeError) as err:
        recipes.load(str(path))
    assert str(path) in str(err.value)
    assert "line 5" in str(err.value) or "line 4" in str(err.value)


def test_unknown_scheme_is_named_with_the_valid_ones(tmp_path: Path) -> None:
    text = (paths.RECIPES_DIR / "fp8.yaml").read_text().replace("FP8_DYNAMIC", "FP9_MAGIC")
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as err:
        recipes.load(str(path))
    message = str(err.value)
    assert "FP9_MAGIC" in message and "FP8_DYNAMIC" in message and "W4A16" in message
    assert f"{path}, line" in message


def test_unknown_field_and_bad_calibration_are_named(tmp_path: Path) -> None:
    base = (paths.RECIPES_DIR / "int4.yaml").read_text()
    path = write(tmp_path, base.replace("recovery_threshold_pct:", "recovery_treshold_pct:"))
    with pytest.raises(RecipeError, match="recovery_treshold_pct"):
        recipes.load(str(path))
    path = write(tmp_path, re.sub(r"num_samples: \d+", "num_samples: many", base))
    with pytest.raises(RecipeError, match=r"calibration.num_samples must be a positive integer"):
        recipes.load(str(path))


def test_recipe_without_stage_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "qpipe:\n  description: nothing to do\n")
    with pytest.raises(RecipeError, match="_stage"):
        recipes.load(str(path))


def test_unknown_modifier_is_rejected_with_the_file(tmp_path: Path) -> None:
    text = (paths.RECIPES_DIR / "fp8.yaml").read_text().replace(
        "QuantizationModifier", "QuantiseModifier")
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as err:
        recipes.instantiate(recipes.load(str(path)))
    assert str(path) in str(err.value) and "QuantiseModifier" in str(err.value)


def test_a_recipe_that_starts_from_another_may_only_add_a_kv_cache_scheme(
        tmp_path: Path) -> None:
    kv = recipes.load("int8-fp8kv")
    assert kv.start is not None and kv.start.name == "int8"
    assert recipes.kv_cache_scheme(kv.stages)["type"] == "float"
    text = (paths.RECIPES_DIR / "int8-fp8kv.yaml").read_text()
    int8 = (paths.RECIPES_DIR / "int8.yaml").read_text()
    cases = {  # what is wrong -> what the error says
        text.replace("start_from: int8", "start_from: int9"): "'int9'",
        text.replace("      kv_cache_scheme:", "      scheme: W8A8\n      kv_cache_scheme:"):
            "with scheme",
        text.replace("QuantizationModifier:", "GPTQModifier:"): "found GPTQModifier",
        text.replace("start_from: int8", "start_from: custom"): "one step of start_from",
    }
    for bad, said in cases.items():
        path = write(tmp_path, bad)
        with pytest.raises(RecipeError) as err:
            recipes.load(str(path))
        assert str(path) in str(err.value) and said in str(err.value)
    # a start that quantizes the KV cache itself, beside the recipe
    write(tmp_path, int8.replace("      dampening_frac: 0.01",
                                 "      dampening_frac: 0.01\n      kv_cache_scheme: {num_bits: "
                                 "8, type: float, strategy: tensor, dynamic: false}"),
          name="int8.yaml")
    with pytest.raises(RecipeError, match="already quantizes the KV cache"):
        recipes.load(str(write(tmp_path, text)))


def test_a_block_recipe_names_the_layers_its_blocks_do_not_tile(capsys) -> None:
    """SmolLM2's 576-wide layers are 4.5 blocks of 128: quantized, but said before, with the
    way out, since vLLM and compressed-tensors then refuse the checkpoint."""
    import torch

    from pipeline.quantize import stage as quantize

    model = torch.nn.ModuleDict({"q_proj": torch.nn.Linear(576, 576),
                                 "up_proj": torch.nn.Linear(128, 256),
                                 "lm_head": torch.nn.Linear(576, 1000)})
    path = paths.RECIPES_DIR / "fp8-block.yaml"
    untiled = quantize.warn_partial_blocks(model, recipes.instantiate(recipes.load("fp8-block")),
                                           path)
    assert untiled == ["q_proj (576 x 576)"]  # lm_head is ignored by the recipe
    said = capsys.readouterr().out
    assert "fp8 (a scale per channel)" in said and "q_proj (576 x 576)" in said
    assert quantize.warn_partial_blocks(model, recipes.instantiate(recipes.load("fp8")),
                                        path) == []
