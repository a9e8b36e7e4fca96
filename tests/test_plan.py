"""``qpipe plan`` end to end: the CLI, its JSON, its table, its plot and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.core.paths import CONFIGS_DIR, PROJECT_ROOT
from pipeline.plan import capacity
from pipeline.plan import cli as plan
from pipeline.plan.accelerators import get_accelerator, known_accelerators
from pipeline.plan.architecture import parse_architecture
from pipeline.plan.settings import DEFAULT_RESERVE_GB

GB = 10**9
# what `make plan MODEL=gpt-oss-120b GPU=h100-80gb ... WEIGHTS=mxfp4 KV_DTYPE=bf16` passes
MAKE_PLAN = ["plan", "--model", "gpt-oss-120b", "--gpu", "h100-80gb", "--context", "8192",
             "--max-context", "131072", "--weights", "mxfp4", "--kv-dtype", "bf16"]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_json_carries_every_metric_name(capsys):
    out = run_json(capsys, *MAKE_PLAN)
    for name in capacity.PLANNED_METRICS:
        assert name in out, name
    assert set(out["weights_by_precision"]) == set(capacity.WEIGHT_PRECISIONS)
    assert out["quantized_modules"] == ["experts"]
    assert out["high_precision_modules"] == ["embeddings", "attention", "router", "norms",
                                             "lm_head"]
    assert out["inputs"]["checkpoint_quantization"] == "mxfp4"


def test_worked_example_at_the_illustrative_15_gb(capsys):
    out = run_json(capsys, *MAKE_PLAN, "--context", "8000", "--kv-budget-gb", "15")
    sliding = 18 * 128 * 2048
    assert out[capacity.KV_BYTES_PER_TOKEN] == 36_864
    assert out["kv_bytes_per_token_all_layers"] == 73_728
    assert out[capacity.KV_BYTES_PER_REQUEST] == 8000 * 36_864 + sliding  # ~300 MB
    assert out["kv_bytes_per_request_max_context"] == 131_072 * 36_864 + sliding  # ~4.8 GB
    assert out[capacity.KV_BUDGET_BYTES] == 15 * GB
    assert out[capacity.MAX_CONCURRENCY_WORST_CASE] == 3
    assert out[capacity.MAX_CONCURRENCY_PAGED] == 50
    assert out["weights_by_precision"]["bf16"] == pytest.approx(234 * GB, rel=0.01)


def test_real_h100_budget_after_mxfp4_weights(capsys):
    out = run_json(capsys, *MAKE_PLAN)
    memory = get_accelerator("h100-80gb").memory_bytes
    weights = out["weights_by_precision"]["mxfp4"]
    assert out[capacity.WEIGHT_BYTES] == weights < 80 * GB
    budget = int(memory * 0.9) - weights - int(DEFAULT_RESERVE_GB * GB)
    assert out[capacity.KV_BUDGET_BYTES] == budget
    per_request = 8192 * 36_864 + 18 * 128 * 2048
    assert out[capacity.MAX_CONCURRENCY_PAGED] == budget // per_request
    per_request_max = 131_072 * 36_864 + 18 * 128 * 2048
    assert out[capacity.MAX_CONCURRENCY_WORST_CASE] == budget // per_request_max
    prefix = 1024 * 36_864  # default prefix: 1,024 tokens in the 18 full-attention layers
    assert out["inputs"]["prefix"] == 1024
    assert out[capacity.MAX_CONCURRENCY_PAGED_SHARED_PREFIX] == (budget - prefix) // (
        per_request - prefix)


def test_vllm_prediction_through_the_cli(capsys):
    out = run_json(capsys, "plan", "--model", "smollm2-135m", "--max-context", "8192",
                   "--kv-budget-gib", "1", "--block-size", "128")
    assert out[capacity.KV_CACHE_TOKENS] == 46_592
    assert out[capacity.VLLM_MAX_CONCURRENCY] == round(364 / 64, 2)


def test_table_states_figures_and_assumptions(capsys):
    assert main(MAKE_PLAN) == 0
    text = capsys.readouterr().out
    assert "36,864 B" in text and "73,728 B" in text
    assert "worst case: each reserves 131,072 tokens" in text
    assert "paged: each holds 8,192 tokens" in text
    assert "stays bf16 with mxfp4: embeddings, attention, router, norms, lm_head" in text
    assert "utilisation 0.9" in text and "block size 16" in text and "reserve 2.00 GB" in text


def test_model_from_a_directory_with_a_nested_config(tmp_path, capsys):
    text = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 1, "intermediate_size": 256, "vocab_size": 100,
            "max_position_embeddings": 2048}
    model = write_config(tmp_path / "tiny-vlm", {"model_type": "llava", "text_config": text})
    out = run_json(capsys, "plan", "--model", str(model), "--kv-budget-gb", "1",
                   "--context", "1024")
    assert out[capacity.KV_BYTES_PER_TOKEN] == 2 * 1 * 32 * 2 * 2
    assert out["inputs"]["max_context"] == 2048  # the model's maximum by default
    assert out["inputs"]["model"] == "tiny-vlm"


def test_block_size_comes_from_the_option(capsys):
    small = run_json(capsys, *MAKE_PLAN, "--kv-budget-gb", "15", "--context", "8001")
    large = run_json(capsys, *MAKE_PLAN, "--kv-budget-gb", "15", "--context", "8001",
                     "--block-size", "128")
    assert small[capacity.KV_BYTES_PER_REQUEST] == (8016 * 36_864 + 18 * 128 * 2048)
    assert large[capacity.KV_BYTES_PER_REQUEST] == (8064 * 36_864 + 18 * 128 * 2048)


def test_memory_given_instead_of_a_preset(capsys):
    out = run_json(capsys, "plan", "--model", "smollm2-135m", "--max-context", "8192",
                   "--memory-gb", "4", "--reserve-gb", "0.5", "--utilization", "0.5")
    weights = out["weights_by_precision"]["bf16"]
    assert out[capacity.KV_BUDGET_BYTES] == 2 * GB - weights - GB // 2
    assert out["inputs"]["accelerator"] == "custom"


# --- bad input ---------------------------------------------------------------------------------
def test_config_without_a_needed_field_names_it(tmp_path, capsys):
    model = write_config(tmp_path / "broken", {"num_hidden_layers": 2, "hidden_size": 64,
                                               "vocab_size": 10})
    err = run_error(capsys, "plan", "--model", str(model))
    assert "num_attention_heads" in err and "broken" in err


def test_unknown_accelerator_lists_the_known_ones(capsys):
    err = run_error(capsys, "plan", "--model", "smollm2-135m", "--gpu", "tpu-v9")
    assert "tpu-v9" in err
    for name in known_accelerators():
        assert name in err
    assert {"h100-80gb", "h200-141gb", "a100-40gb", "a100-80gb", "l40s-48gb"} <= set(
        known_accelerators())


def test_context_longer_than_the_model_allows(capsys):
    err = run_error(capsys, "plan", "--model", "smollm2-135m", "--max-context", "131072")
    assert "131,072" in err and "8,192" in err and "--clamp-context" in err
    out = run_json(capsys, "plan", "--model", "smollm2-135m", "--max-context", "131072",
                   "--context", "8192", "--clamp-context")
    assert out["inputs"]["max_context"] == 8192
    assert any("clamped" in note for note in out["notes"])


def test_weights_that_do_not_fit_say_by_how_much(capsys):
    err = run_error(capsys, "plan", "--model", "llama-3.1-70b", "--gpu", "a100-40gb",
                    "--max-context", "8192")
    weights = capacity.estimate_weights(
        capacity.parse_architecture(json.loads(
            (PROJECT_ROOT / "configs/models/llama-3.1-70b/config.json").read_text())),
        "bf16").total_bytes
    short = weights + 2 * GB - int(get_accelerator("a100-40gb").memory_bytes * 0.9)
    assert "do not fit" in err and f"by {short / GB:.2f} GB" in err


@pytest.mark.parametrize("budget", ["0", "-3"])
def test_zero_or_negative_budget(capsys, budget):
    err = run_error(capsys, "plan", "--model", "smollm2-135m", "--max-context", "8192",
                    "--kv-budget-gb", budget)
    assert "--kv-budget-gb (make KV_BUDGET_GB=): input should be greater than 0" in err


def test_unreachable_hub_falls_back_or_explains(monkeypatch, capsys):
    monkeypatch.setattr(plan, "_from_hub", lambda repo: (None, "offline"))
    out = run_json(capsys, "plan", "--model", "openai/gpt-oss-120b", "--kv-budget-gb", "15")
    assert out[capacity.KV_BYTES_PER_TOKEN] == 36_864
    err = run_error(capsys, "plan", "--model", "someone/unknown-model")
    assert "offline" in err and "gpt-oss-120b" in err


# --- plot --------------------------------------------------------------------------------------
def test_plot_is_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    target = tmp_path / "plan.png"
    assert main([*MAKE_PLAN, "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(target) in capsys.readouterr().out


def test_matplotlib_is_not_imported_without_a_plot():
    code = ("import sys; from pipeline.cli import main; "
            f"assert main({MAKE_PLAN!r} + ['--json']) == 0; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


LLAMA_70B = ["plan", "--model", "llama-3.1-70b", "--gpu", "h100-80gb", "--context", "8192",
             "--max-context", "131072", "--weights", "bf16", "--kv-dtype", "bf16"]


def test_a_70b_in_bf16_needs_four_h100s_and_tensor_parallel_splits_weights_and_kv(capsys):
    one = run_json(capsys, *LLAMA_70B, "--memory-gb", "400")  # one huge device: the reference
    assert one["inputs"]["smallest_tp"] == 1
    four = run_json(capsys, *LLAMA_70B, "--tp", "4")
    assert four["inputs"]["smallest_tp"] == 4  # 141 GB of weights: 2 x 80 GB cannot hold them
    assert four["inputs"]["tensor_parallel"] == 4
    memory, reserve = get_accelerator("h100-80gb").memory_bytes, int(DEFAULT_RESERVE_GB * GB)
    per_device = -(-four[capacity.WEIGHT_BYTES] // 4)
    # 8 KV heads over 4 ranks: each device holds a quarter of every token's cache
    assert four[capacity.KV_BUDGET_BYTES] == 4 * (int(memory * 0.9) - per_device - reserve)
    assert four[capacity.KV_BYTES_PER_TOKEN] == one[capacity.KV_BYTES_PER_TOKEN]  # whole model
    eight = run_json(capsys, *LLAMA_70B, "--tp", "8")
    assert eight[capacity.MAX_CONCURRENCY_PAGED] > 2 * four[capacity.MAX_CONCURRENCY_PAGED]
    # more ranks than KV heads: vLLM replicates heads, so 16 ranks hold no more than 8 shards
    arch = capacity.parse_architecture(json.loads(
        (PROJECT_ROOT / "configs/models/llama-3.1-70b/config.json").read_text()))
    assert arch.kv_shards(16) == 8 and arch.kv_shards(4, 2) == 8
    two = run_json(capsys, *LLAMA_70B, "--tp", "2")  # the weights fit, one long request not
    assert two[capacity.MAX_CONCURRENCY_WORST_CASE] == 0 < two[capacity.MAX_CONCURRENCY_PAGED]
    err = run_error(capsys, *LLAMA_70B, "--tp", "2", "--memory-gb", "40")
    assert "over 2 devices (TP 2 x PP 1)" in err and "the weights do not fit" in err
    main([*LLAMA_70B, "--tp", "4"])
    table = capsys.readouterr().out
    assert "per device (TP 4 x PP 1)" in table
    assert "smallest tensor-parallel size on h100-80gb for the bf16 weights plus one " \
           "131,072-token request: TP=4" in table


def test_the_engine_passes_tensor_and_pipeline_parallel_to_every_server(tmp_path):
    from pipeline.serve.server import VllmServer
    from pipeline.serve.settings import EngineSettings

    log = tmp_path / "log"
    server = VllmServer(tmp_path, "m", EngineSettings(tensor_parallel_size=4,
                                                  pipeline_parallel_size=2), log, target="cuda")
    cmd = server.command()
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4"
    assert cmd[cmd.index("--pipeline-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in VllmServer(tmp_path, "m", EngineSettings(), log,
                                                  target="cuda").command()


def test_one_device_leaves_the_measurements_keys_as_they_were():
    from pipeline.serve.settings import EngineSettings

    one, four = EngineSettings(), EngineSettings(tensor_parallel_size=4)
    assert "tensor_parallel_size" not in one.identity()
    assert "engine.pipeline_parallel_size" not in one.as_params()
    assert four.identity()["tensor_parallel_size"] == 4
    assert four.as_params()["engine.tensor_parallel_size"] == 4


@pytest.mark.parametrize("name", sorted(p.name for p in (CONFIGS_DIR / "models").iterdir()))
def test_the_planned_weights_are_the_parameters_transformers_builds_from_the_config(name):
    """Every shipped config, hybrids included: the planner's parameter count is the model's own,
    counted on the modules transformers builds from that config (on the meta device: no
    memory), which are the tensors its checkpoint holds."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    directory = CONFIGS_DIR / "models" / name
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(directory))
    built = sum(p.numel() for p in model.parameters())
    config = json.loads((directory / "config.json").read_text())
    assert parse_architecture(config).params == built
