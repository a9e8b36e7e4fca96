"""Hybrid (Mamba / linear-attention beside attention) models: the layer list, the recurrent state
as vLLM 0.32 allocates it, weights from the real layers, and refusal of unknown markers.

The expected figures are computed here by hand from vLLM's cache-spec code, not by the planner:
``MambaStateShapeCalculator`` (conv ``(k - 1) x dim``, SSM shapes), ``MambaSpec.page_size_bytes``
(their sum), ``Platform._align_hybrid_block_size`` (attention block ``16 x cdiv(state, 16 x
per-token bytes)``, the state page padded to ``block x per-token bytes``) and
``kv_cache_utils`` (groups of the smaller kind's count; ``num_blocks = budget // (group x
page)``; a request takes ``cdiv(L, block)`` attention blocks a group, one state page a group).
"""

from __future__ import annotations

import json
from math import ceil

import pytest

from pipeline.core.errors import PlanError
from pipeline.core.paths import CONFIGS_DIR
from pipeline.plan.architecture import parse_architecture
from pipeline.plan.capacity import PlanSettings, kv_bytes_per_request, plan_capacity
from pipeline.plan.vllm_kv import predict_vllm_kv_cache

GIB = 2**30


def shipped(name: str) -> dict:
    return json.loads((CONFIGS_DIR / "models" / name / "config.json").read_text())


# name: (attention layers, recurrent layers, state bytes (conv + ssm, bf16 unless said),
#        attention bytes per token per layer, published parameters)
HYBRIDS = {
    # 36 gated delta nets: conv 3 x (2*16*128 + 32*128), state 32 x 128 x 128
    "qwen3-next-80b-a3b": (12, 36, 3 * 8192 * 2 + 32 * 128 * 128 * 2, 2 * 2 * 256 * 2, 80e9),
    # 28 Mamba-1: conv 3 x 8192, SSM 8192 x 16 (d_inner = 2 x 4096)
    "jamba-v0.1": (4, 28, 3 * 8192 * 2 + 8192 * 16 * 2, 2 * 8 * 128 * 2, 51.6e9),
    # 24 Mamba-2: conv 3 x (8192 + 2*8*128), SSM 128 x 64 x 128 in fp32 (Nemotron-H's default)
    "nemotron-h-8b": (4, 24, 3 * 10240 * 2 + 128 * 64 * 128 * 4, 2 * 8 * 128 * 2, 8.1e9),
    # 36 Mamba-2: conv 3 x (8192 + 2*128), SSM 128 x 64 x 128
    "granite-4.0-h-small": (4, 36, 3 * 8448 * 2 + 128 * 64 * 128 * 2, 2 * 8 * 128 * 2, 32.2e9),
    # every layer attention and Mamba-2 side by side: conv 3 x (3072 + 2*256), SSM 24 x 128 x 256
    "falcon-h1-7b": (44, 44, 3 * 3584 * 2 + 24 * 128 * 256 * 2, 2 * 2 * 128 * 2, 7.59e9),
}


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_a_hybrid_is_planned_as_vllm_allocates_it(name):
    attention, recurrent, state, per_token, params = HYBRIDS[name]
    arch = parse_architecture(shipped(name))
    assert (len(arch.kv_layers), len(arch.state_layers)) == (attention, recurrent)
    assert {s.bytes for s in arch.state_layers} == {state}
    # the attention block vLLM raises so that one page holds a state, the page padded to it
    block = 16 * ceil(state / (16 * per_token))
    page = block * per_token
    group = max(attention, recurrent) if max(attention, recurrent) < 1.5 * min(
        attention, recurrent) else min(attention, recurrent)
    groups_a, groups_s = ceil(attention / group), ceil(recurrent / group)
    budget, length = 40 * GIB, 8192
    blocks = budget // (group * page)
    found = predict_vllm_kv_cache(arch, budget, block_size=16, kv_dtype="bf16",
                                  max_model_len=length, prefix_caching=False)
    assert (found.block_size, found.page_size_bytes, found.group_size) == (block, page, group)
    assert found.num_blocks == blocks
    assert found.max_concurrency == pytest.approx(
        blocks / (groups_a * ceil(length / block) + groups_s), rel=1e-12)
    # what one request holds: its attention tokens in whole blocks, one state page a layer
    held = attention * ceil(length / block) * block * per_token + recurrent * page
    assert kv_bytes_per_request(arch, length, "bf16", 16) == held
    # more than the exact sum (attention KV + state) only by the blocks' rounding and the
    # state page's padding (Qwen3-Next's 544-token blocks hold 8,192 tokens in 8,704: +5.5%)
    exact = attention * length * per_token + recurrent * state
    assert held - exact == attention * (ceil(length / block) * block - length) * per_token + (
        recurrent * (page - state))
    assert arch.params == pytest.approx(params, rel=0.03)


def test_the_issue_table_figures_are_what_the_state_adds_to_the_attention_kv():
    """By hand (attention KV + recurrent state, bf16, an 8,192-token request): Qwen3-Next
    240.8 MB, Jamba 142.9 MB, Nemotron-H 236.4 MB; the attention-only plan had 3.3-7.5x."""
    for name, mb in (("qwen3-next-80b-a3b", 240.8), ("jamba-v0.1", 142.9),
                     ("nemotron-h-8b", 236.4)):
        arch = parse_architecture(shipped(name))
        exact = sum(x.bytes_per_token("bf16") for x in arch.kv_layers) * 8192 + sum(
            s.bytes for s in arch.state_layers)
        assert exact / 1e6 == pytest.approx(mb, abs=0.05)


def test_prefix_caching_keeps_more_state_pages_a_request():
    """vLLM's ``align`` mode (prefix caching on, its default): two pages a Mamba-1 / gated
    delta net layer, three a Mamba-2 layer (a prefill checkpoint)."""
    arch = parse_architecture(shipped("jamba-v0.1"))
    off = predict_vllm_kv_cache(arch, 40 * GIB, block_size=16, kv_dtype="bf16",
                                max_model_len=8192, prefix_caching=False)
    on = predict_vllm_kv_cache(arch, 40 * GIB, block_size=16, kv_dtype="bf16",
                               max_model_len=8192)
    per_off = 1 * ceil(8192 / 80) + 7 * 1
    per_on = 1 * ceil(8192 / 80) + 7 * 2
    assert off.max_concurrency == pytest.approx(off.num_blocks / per_off)
    assert on.max_concurrency == pytest.approx(on.num_blocks / per_on)
    nemotron = parse_architecture(shipped("nemotron-h-8b"))
    found = predict_vllm_kv_cache(nemotron, 40 * GIB, block_size=16, kv_dtype="bf16",
                                  max_model_len=8192)
    assert found.max_concurrency == pytest.approx(found.num_blocks / (ceil(8192 / 1040) + 6 * 3))


def test_experts_only_on_expert_layers_and_nemotron_mixer_only_layers():
    jamba = parse_architecture(shipped("jamba-v0.1"))
    experts = next(m for m in jamba.modules if m.name == "experts")
    assert experts.matrices[0].count == 2 * 16 * 16  # gate and up, 16 experts, 16 odd layers
    nemotron = parse_architecture(shipped("nemotron-h-8b"))
    mlp = next(m for m in nemotron.modules if m.name == "mlp")
    assert [m.count for m in mlp.matrices] == [24, 24]  # the 24 "-" layers: up and down


def test_a_whole_plan_for_a_hybrid_counts_the_state_in_every_request():
    plan = plan_capacity(shipped("qwen3-next-80b-a3b"), PlanSettings(
        context=8192, max_context=8192, kv_budget_bytes=40 * GIB))
    assert plan.kv_bytes_per_request == 12 * 16 * 544 * 2048 + 36 * 544 * 2048
    assert plan.paged == 40 * GIB // plan.kv_bytes_per_request
    assert "36 gated delta net" in plan.arch.describe()


@pytest.mark.parametrize("field, value, named", [
    ("layer_types", ["full_attention", "mamba"], "'mamba'"),
    ("hybrid_override_pattern", "M*", "hybrid_override_pattern"),
    ("ssm_state_size", 16, "ssm_state_size"),
    ("full_attention_interval", 4, "full_attention_interval"),
])
def test_an_unknown_recurrent_marker_is_refused_not_planned_as_attention(field, value, named):
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
              field: value}
    with pytest.raises(PlanError, match=named) as err:
        parse_architecture(config)
    assert "attention" in str(err.value)


def test_a_bad_nemotron_pattern_names_the_layer():
    config = shipped("nemotron-h-8b")
    config["hybrid_override_pattern"] = "X" + config["hybrid_override_pattern"][1:]
    with pytest.raises(PlanError, match=r"layer 0 .*hybrid_override_pattern.*'X'"):
        parse_architecture(config)


def _tiny_granite(d_state: int, heads: int, head_dim: int) -> dict:
    """A 2-layer Granite-4.0-H-style config: one Mamba-2 layer, one attention layer."""
    return {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
            "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
            "shared_intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "num_local_experts": 0, "mamba_n_heads": heads,
            "mamba_d_head": head_dim, "mamba_d_state": d_state, "mamba_d_conv": 4,
            "mamba_expand": 2, "mamba_n_groups": 1, "layer_types": ["mamba", "attention"],
            "max_position_embeddings": 1024, "torch_dtype": "bfloat16",
            "tie_word_embeddings": False}


def test_vllm_cpu_with_bf16_keeps_the_ssm_state_in_float32() -> None:
    """vLLM 0.32 CPU on an AVX512-BF16 / AMX host resets the SSM cache dtype to float32
    (CpuPlatform.check_and_update_config), whatever the model's dtype: the state page, and
    the attention block raised to hold it, follow."""
    from pipeline.plan.vllm_kv import served_on_cpu

    cfg = _tiny_granite(128, 8, 32)
    conv = 3 * (256 + 2 * 128)  # (k - 1) x (inner + 2 groups x d_state)
    ssm = 8 * 32 * 128  # heads x head_dim x d_state
    bf16 = parse_architecture(cfg).state_layers[0]
    assert bf16.bytes == 2 * conv + 2 * ssm
    on_cpu = parse_architecture(served_on_cpu(cfg, bf16_cpu=True)).state_layers[0]
    assert on_cpu.bytes == 2 * conv + 4 * ssm
    assert served_on_cpu(cfg, bf16_cpu=False) is cfg  # AVX2 / AVX-512 without bf16: as is
    # 256 B of attention KV a token (1 KV head x 64 x K and V x 2 B): blocks in 128s hold it
    block = 128 * ceil((2 * conv + 4 * ssm) / (128 * 256))
    assert predict_vllm_kv_cache(served_on_cpu(cfg, True), GIB, block_size=128,
                                 kv_dtype="bf16", max_model_len=512).block_size == block == 640
    assert predict_vllm_kv_cache(cfg, GIB, block_size=128, kv_dtype="bf16",
                                 max_model_len=512).block_size == 384
    # a gated delta net asked for a 16-bit state keeps it; so does a nested text config's
    gdn = {**shipped("qwen3-next-80b-a3b"), "layer_types": None}
    assert served_on_cpu(gdn, True)["mamba_ssm_cache_dtype"] == "float32"
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    asked = {**shipped("qwen3-next-80b-a3b"), "mamba_ssm_cache_dtype": "bfloat16",
             "layer_types": kinds * (shipped("qwen3-next-80b-a3b")["num_hidden_layers"] // 4)}
    assert served_on_cpu(asked, True) is asked
    # a nested language-model config, whose own 16-bit choice vLLM CPU overrides as well
    nested = {"model_type": "x", "language_config": {**cfg, "mamba_ssm_cache_dtype": "bfloat16"}}
    assert served_on_cpu(nested, True)["mamba_ssm_cache_dtype"] == "float32"
    assert parse_architecture(served_on_cpu(nested, True)).state_layers[0].bytes == on_cpu.bytes


@pytest.mark.slow
@pytest.mark.serve
@pytest.mark.xdist_group("servers")
def test_vllm_cpu_serves_a_tiny_hybrid_with_the_kv_cache_the_planner_predicts(
        tmp_path_factory: pytest.TempPathFactory, workspace) -> None:
    """A random 2-layer Mamba-2 + attention model made here, served by vLLM CPU: its KV cache
    in tokens and its concurrency as the planner predicts them (the state larger than one
    128-token attention page, so vLLM raises the block; on a bf16 CPU in float32)."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    from pipeline.bench import stage as bench
    from pipeline.bench import workloads
    from pipeline.core import tracking
    from pipeline.quantize import baseline as baselines
    from pipeline.serve import EngineSettings
    from tests.conftest import TINY_LOAD, _train_tokenizer

    out = tmp_path_factory.mktemp("hybrid") / "tiny-hybrid"
    torch.manual_seed(0)
    cfg = {k: v for k, v in _tiny_granite(128, 8, 32).items()
           if k not in ("architectures", "model_type", "torch_dtype")}
    model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        **cfg, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    model.to(torch.bfloat16).save_pretrained(out)
    _train_tokenizer(out)
    base = baselines.resolve(str(out))
    (workspace / "tiny.yaml").write_text(TINY_LOAD.replace("load_points: [1, 2]",
                                                           "load_points: [2]")
                                         .replace("repeats: 2", "repeats: 1"))
    summary = bench.bench(base, [], [workloads.load(str(workspace / "tiny.yaml"))],
                          EngineSettings(max_model_len=512, kv_cache_space_gib=1),
                          target="cpu", reference_dtype="bfloat16")
    entry = summary.models["baseline"]
    assert entry.status == "ok", entry.reason
    assert abs(entry.kv[tracking.KV_CACHE_TOKENS_VS_PLANNED] - 1) <= 0.01, entry.kv
    assert abs(entry.kv[tracking.MAX_CONCURRENCY_VS_PLANNED] - 1) <= 0.01
    assert entry.kv[tracking.KV_PLAN_OFF] == 0
