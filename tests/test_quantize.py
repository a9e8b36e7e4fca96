"""End to end on a tiny Llama made in the test: every shipped recipe, reload, generate, MLflow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core import paths, tracking
from pipeline.core.artifacts import BaselineRecord, Manifest
from pipeline.core.errors import OutputError, RecipeError
from pipeline.plan import capacity
from pipeline.quantize import baseline as baselines
from pipeline.quantize import recipes
from pipeline.quantize import stage as quantize
from pipeline.quantize.checkpoint import checkpoint_kv_dtype

from .conftest import run_cli

pytestmark = pytest.mark.slow

EXPECTED = {  # recipe -> (compressed-tensors format, upper bound of quantized/bf16 layer bytes,
    # the format table's row, the KV cache the checkpoint asks vLLM for)
    "fp8": ("float-quantized", 0.51, "fp8", None),
    "int4": ("pack-quantized", 0.28, "int4", None),
    "int8": ("int-quantized", 0.51, "int8", None),
    "int8-fp8kv": ("int-quantized", 0.51, "int8", "fp8"),
    "mxfp4": ("mxfp4-pack-quantized", 0.28, "mxfp4", None),
    "awq": ("pack-quantized", 0.29, "int4", None),
    "fp8-block": ("float-quantized", 0.51, "fp8-block", None),
    "nvfp4": ("nvfp4-pack-quantized", 0.29, "nvfp4", None),
    "nvfp4a16": ("nvfp4-pack-quantized", 0.29, "nvfp4a16", None),
    "w8a16": ("pack-quantized", 0.51, "w8a16", None),
}


def _quick(name: str) -> recipes.RecipeFile:
    return recipes.load(name).with_calibration(num_samples=8, max_seq_length=64)


def _mlflow_runs(workspace: Path, baseline_name: str) -> list:
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")
    exp = mlflow.get_experiment_by_name(tracking.experiment_name(baseline_name))
    return mlflow.search_runs([exp.experiment_id], output_format="list") if exp else []


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_recipe_quantizes_reloads_and_generates(
    name: str, tiny_model: Path, workspace: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = baselines.resolve(str(tiny_model))
    manifest = quantize.quantize(base, _quick(name))
    out = paths.variant_dir(base.name, name)
    fmt, bound, key, kv_dtype = EXPECTED[name]

    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["format"] == fmt
    assert checkpoint_kv_dtype(config) == kv_dtype
    # what the report reads of the variant is in its manifest, not its files
    assert manifest.kv_dtype == (kv_dtype or "bf16")
    assert manifest.recipe.recovery_threshold_pct == _quick(name).recovery_threshold_pct
    assert BaselineRecord.of(base.name).weight_bytes == manifest.baseline_weight_bytes
    assert manifest.format == fmt
    # the format table's row, identified once from config.json, is what every stage reads
    assert manifest.weights.key == key and manifest.weights.symmetric == (name != "awq")
    assert manifest.quantized_layers == 14  # 2 layers x 7 linears; lm_head stays bf16
    assert manifest.quantized_layer_bytes_ratio <= bound
    assert manifest.compression_ratio > 1
    assert manifest.baseline["identity"] == base.identity
    assert manifest.peak_rss_bytes > 0 and manifest.quantize_seconds > 0
    assert Manifest.read(out / Manifest.FILE) == manifest == Manifest.load(base.name, name)

    # The capacity planner predicts these bytes from config.json alone (the goal: within 3%).
    arch = capacity.parse_architecture(config)
    planned = capacity.estimate_weights(
        arch, manifest.precision, "linear", capacity.weight_formats(
            manifest.weights.group_size, not manifest.weights.symmetric)).total_bytes
    assert abs(planned - manifest.weight_bytes) <= 0.03 * manifest.weight_bytes

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("The assignment statement", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 5

    (run,) = [r for r in _mlflow_runs(workspace, base.name)
              if r.data.params[tracking.PARAM_RECIPE] == name]
    assert run.data.params[tracking.PARAM_BASELINE] == base.name
    assert run.data.params[tracking.PARAM_SCHEME]
    for metric in (tracking.CHECKPOINT_BYTES, tracking.WEIGHT_BYTES, tracking.COMPRESSION_RATIO,
                   tracking.QUANTIZE_SECONDS, tracking.PEAK_RSS_BYTES):
        assert run.data.metrics[metric] > 0
    assert run.data.metrics[tracking.WEIGHT_BYTES] == manifest.weight_bytes


def test_a_kv_cache_recipe_keeps_the_weights_of_the_recipe_it_starts_from(
        tiny_model: Path, workspace: Path) -> None:
    """int8-fp8kv is int8's checkpoint, tensor for tensor, plus one calibrated FP8 scale for
    each layer's keys and values; int8 is made first (or reused), and a change to int8's
    recipe makes int8-fp8kv's inputs change too."""
    from safetensors.torch import load_file

    base = baselines.resolve(str(tiny_model))
    manifest = quantize.quantize(base, _quick("int8-fp8kv"))
    assert Manifest.load(base.name, "int8") is not None  # made on the way
    int8 = load_file(paths.variant_dir(base.name, "int8") / "model.safetensors")
    kv = load_file(paths.variant_dir(base.name, "int8-fp8kv") / "model.safetensors")
    assert kv.keys() - int8.keys() == {f"model.layers.{i}.self_attn.{s}_scale"
                                       for i in range(2) for s in "kv"}
    assert all(kv[k].dtype == t.dtype and kv[k].equal(t) for k, t in int8.items())
    assert all(kv[k].item() > 0 for k in kv.keys() - int8.keys())
    config = json.loads((paths.variant_dir(base.name, "int8-fp8kv") / "config.json").read_text())
    int8_config = json.loads((paths.variant_dir(base.name, "int8") / "config.json").read_text())
    assert config["quantization_config"]["config_groups"] == \
        int8_config["quantization_config"]["config_groups"]
    assert manifest.recipe.scheme == Manifest.load(base.name, "int8").recipe.scheme
    assert manifest.kv_dtype == "fp8"

    fewer = _quick("int8-fp8kv").with_calibration(num_samples=4)  # reaches int8 too
    assert fewer.start.calibration.num_samples == 4
    assert quantize.cache_key(base, fewer) != manifest.cache_key


def test_unchanged_inputs_do_no_work_and_force_redoes(tiny_model: Path, workspace: Path) -> None:
    base = baselines.resolve(str(tiny_model))
    first = quantize.quantize(base, _quick("fp8"))
    weights = paths.variant_dir(base.name, "fp8") / "model.safetensors"
    written = weights.stat().st_mtime_ns
    again = quantize.quantize(base, _quick("fp8"))
    assert again == first and weights.stat().st_mtime_ns == written  # nothing was redone
    assert len(_mlflow_runs(workspace, base.name)) == 1  # not logged twice
    # a current manifest from before kv_dtype was recorded gets it, the checkpoint reused
    old = first.model_copy(update={"kv_dtype": None})
    old.write(Manifest.path(base.name, "fp8"))
    assert quantize.quantize(base, _quick("fp8")) == first
    assert Manifest.load(base.name, "fp8") == first and weights.stat().st_mtime_ns == written

    changed = quantize.quantize(base, _quick("int4").with_calibration(num_samples=4))
    assert changed.cache_key != first.cache_key
    redone = quantize.quantize(base, _quick("fp8"), force=True)
    assert redone.cache_key == first.cache_key and weights.stat().st_mtime_ns != written


def test_group_size_that_does_not_divide_a_layer_stops_early(
    tiny_model: Path, workspace: Path, tmp_path: Path
) -> None:
    text = (paths.RECIPES_DIR / "int4.yaml").read_text().replace("group_size: 64",
                                                                "group_size: 96")
    path = tmp_path / "int4-g96.yaml"
    path.write_text(text)
    base = baselines.resolve(str(tiny_model))
    with pytest.raises(RecipeError) as err:
        quantize.quantize(base, recipes.load(str(path)).with_calibration(num_samples=2))
    message = str(err.value)
    assert "group_size 96" in message and "width 128" in message
    assert "model.layers.0.self_attn.q_proj" in message and "128, 64, 32" in message
    assert not paths.variant_dir(base.name, "int4-g96").exists()


def test_too_little_free_space_stops_before_writing(
    tiny_model: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 10**9, 1000))
    base = baselines.resolve(str(tiny_model))
    with pytest.raises(OutputError, match="GB free"):
        quantize.quantize(base, _quick("fp8"))
    assert not paths.variant_dir(base.name, "fp8").exists()


def test_cli_errors_are_one_paragraph_without_traceback(tiny_model: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    cases = {
        ("quantize", "--recipe", "fp9"): "unknown recipe 'fp9'",
        ("quantize", "--recipe", "fp8", "--baseline", str(tmp_path / "missing")): "not found",
        ("quantize", "--recipe", "fp8", "--baseline", str(tiny_model)): "cannot write to",
    }
    env = {"QPIPE_ARTIFACTS": str(blocker / "artifacts"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    for args, expected in cases.items():
        result = run_cli(*args, env=env)
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_mid_quantize_leaves_no_partial_variant(
    signum: int, tiny_model: Path, tmp_path: Path
) -> None:
    artifacts = tmp_path / "artifacts"
    env = {**os.environ, "QPIPE_ARTIFACTS": str(artifacts),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    # Enough calibration work that the run is still inside oneshot when the signal lands.
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "quantize", "--recipe", "int8", "--baseline",
         str(tiny_model), "--calib-samples", "256", "--calib-seq-len", "512"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=paths.PROJECT_ROOT)
    parent = artifacts / "variants" / tiny_model.name
    deadline = time.monotonic() + 120
    while not list(parent.glob(".tmp-int8-*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "quantize never started writing"
        time.sleep(0.1)
    time.sleep(1.0)
    assert proc.poll() is None, "quantize finished before it could be interrupted"
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr and "partial output was removed" in stderr
    assert [p.name for p in parent.iterdir()] == [BaselineRecord.FILE]  # no variant, whole or part


def test_an_interrupt_a_library_turns_into_its_own_error_is_still_an_interrupt(
    tiny_model: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM landed inside llmcompressor, which answered with an error of its own (seen in CI:
    UnboundLocalError in its callback code): the run ends as interrupted (exit 130), not as a
    failed recipe (exit 2)."""
    import llmcompressor

    from pipeline.core import interrupts

    def interrupted_inside(**_: object) -> None:
        monkeypatch.setattr(interrupts, "_received", signal.SIGTERM)  # what the handler records
        raise UnboundLocalError("cannot access local variable 'caller'")

    monkeypatch.setattr(llmcompressor, "oneshot", interrupted_inside)
    base = baselines.resolve(str(tiny_model))
    with pytest.raises(KeyboardInterrupt):
        quantize.quantize(base, _quick("fp8"))
    assert not paths.variant_dir(base.name, "fp8").exists()
