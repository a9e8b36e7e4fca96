"""The embedded real model: GGUF -> bf16 baseline -> FP8 checkpoint that reloads and answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core import paths
from pipeline.quantize import baseline as baselines
from pipeline.quantize import recipes
from pipeline.quantize import stage as quantize

# the conversion into the project's own artifacts dir: one worker at a time (conftest)
pytestmark = [pytest.mark.slow, pytest.mark.embedded, pytest.mark.xdist_group("embedded")]


@pytest.fixture(scope="module")
def embedded() -> baselines.Baseline:
    # The project's own artifacts dir: the conversion is done once and shared with `make`.
    return baselines.resolve("smollm2-135m-instruct")


def _answer(model_dir: Path, question: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_embedded_baseline_is_the_documented_architecture(embedded: baselines.Baseline) -> None:
    config = json.loads((embedded.path / "config.json").read_text())
    assert embedded.name == "SmolLM2-135M-Instruct"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (
        30, 576, 3)
    assert "quantization_config" not in config  # saved as a plain bf16 model
    assert "Paris" in _answer(embedded.path, "What is the capital of France?")


def test_embedded_fp8_variant_reloads_and_answers(
    embedded: baselines.Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QPIPE_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    manifest = quantize.quantize(embedded, recipes.load("fp8"))
    out = paths.variant_dir(embedded.name, "fp8")
    assert manifest.format == "float-quantized"
    assert manifest.quantized_layers == 30 * 7
    assert manifest.quantized_layer_bytes_ratio <= 0.51
    assert "Paris" in _answer(out, "What is the capital of France?")


def test_gptq_on_the_embedded_model_is_reproducible(
    embedded: baselines.Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same baseline, recipe and data: the same checkpoint, tensor for tensor. (On a tiny model
    the order of the calibration samples changes nothing; here it changed 205 of 692 tensors
    while llmcompressor shuffled them.)"""
    from safetensors.torch import load_file

    monkeypatch.setenv("QPIPE_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    recipe = recipes.load("int4").with_calibration(num_samples=8, max_seq_length=64)
    out = paths.variant_dir(embedded.name, "int4")
    quantize.quantize(embedded, recipe)
    first = load_file(out / "model.safetensors")
    quantize.quantize(embedded, recipe, force=True)
    second = load_file(out / "model.safetensors")
    assert first.keys() == second.keys()
    assert [name for name in first if not first[name].equal(second[name])] == []
