"""The CUDA code path, checked without a GPU: settings objects, log lines and /metrics text built
from vLLM 0.32's own format strings, a stand-in nvidia-smi, and hardware profiles."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pipeline.bench import measure, stage
from pipeline.campaign import files as campaigns
from pipeline.campaign import runner as campaign
from pipeline.core import hardware, tracking
from pipeline.core.artifacts import CostTarget, PlanTarget, Row
from pipeline.core.variant import Variant
from pipeline.eval import EvalSettings, lm
from pipeline.plan import capacity
from pipeline.report import cost, placement
from pipeline.report.placement import resolve_plan_target
from pipeline.serve import EngineSettings, VllmServer, engine_metrics, failure, server

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
            "max_position_embeddings": 131072, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}
# vLLM 0.32's log lines, as its format strings write them (gpu_worker.py, gpu_model_runner.py,
# kernels/linear/__init__.py, marlin_utils_fp8.py)
A100_FP8_LOG = """\
(EngineCore pid=7) WARNING 11-30 10:00:01 [marlin_utils_fp8.py:108] Your GPU does not have \
native support for FP8 computation but FP8 quantization is being used. Weight-only FP8 \
compression will be used leveraging the Marlin kernel. This may degrade performance for \
compute-heavy workloads.
(EngineCore pid=7) INFO 11-30 10:00:09 [gpu_model_runner.py:5150] Model loading took 8.49 GiB \
memory and 6.123456 seconds
(EngineCore pid=7) INFO 11-30 10:00:30 [gpu_worker.py:760] Available KV cache memory: 22.47 GiB
"""
H100_INT4_LOG = """\
(EngineCore pid=7) INFO 11-30 10:00:02 [compressed_tensors_wNa16.py:138] Using \
MarlinLinearKernel for CompressedTensorsWNA16
(EngineCore pid=7) INFO 11-30 10:00:02 [compressed_tensors_wNa16.py:138] Using \
MacheteLinearKernel for CompressedTensorsWNA16
(EngineCore pid=7) INFO 11-30 10:00:09 [gpu_model_runner.py:5150] Model loading took 5.37 GiB \
memory and 4.2 seconds
"""


def _gpu(name: str, memory_mib: int | None, cc: str) -> hardware.Profile:
    return hardware.Profile("cuda", "x86_64", "x", 16, (), "native", "0.32.0",
                            (hardware.Gpu(name, memory_mib, cc),))


def test_gpus_run_compiled_with_cuda_graphs_and_cpus_eager(tmp_path: Path) -> None:
    assert EngineSettings().resolved("cuda").enforce_eager is False
    assert EngineSettings().resolved("cpu").enforce_eager is True
    assert EngineSettings(enforce_eager=True).resolved("cuda").enforce_eager is True
    gpu = VllmServer(tmp_path, "m", EngineSettings(), tmp_path / "l", target="cuda")
    cpu = VllmServer(tmp_path, "m", EngineSettings(), tmp_path / "l", target="cpu")
    assert "--enforce-eager" not in gpu.command() and "--enforce-eager" in cpu.command()
    assert gpu.settings.as_params()["engine.enforce_eager"] is False  # recorded as it ran


def test_fp8_on_ampere_is_recorded_as_weight_only_with_its_memory_split() -> None:
    log = engine_metrics.read_log(A100_FP8_LOG)
    assert log.fp8_weight_only and log.scheme.startswith("W8A16Fp8 (FP8 weights only")
    assert log.weight_memory_bytes == int(8.49 * 2**30)
    assert log.kv_cache_memory_bytes == int(22.47 * 2**30)
    h100 = engine_metrics.read_log(H100_INT4_LOG)
    assert h100.scheme == "WNA16" and not h100.fp8_weight_only
    assert h100.kernels == ("MarlinLinearKernel for CompressedTensorsWNA16",
                            "MacheteLinearKernel for CompressedTensorsWNA16")
    assert h100.kv_cache_memory_bytes is None


class _FakeServer:
    """The parts of a VllmServer that record_engine reads."""

    def __init__(self, metrics: str, log: str, target: str = "cuda") -> None:
        self._metrics, self._log, self.target = metrics, log, target
        self.settings = EngineSettings().resolved(target)

    def metrics_text(self, phase: str = "") -> str:
        return self._metrics

    def log_text(self) -> str:
        return self._log


def _cache_config_info(engine: capacity.VllmKVPrediction) -> str:
    """vLLM's cache_config_info gauge on CUDA, for a cache of ``engine``'s size."""
    return ('vllm:cache_config_info{block_size="16",cache_dtype="auto",'
            'enable_prefix_caching="False",kv_cache_memory_bytes="None",'
            f'kv_cache_size_tokens="{engine.kv_cache_tokens}",'
            f'kv_cache_max_concurrency="{engine.max_concurrency}",'
            f'num_gpu_blocks="{engine.num_blocks}"}} 1.0\n')


def test_kv_cache_on_a_gpu_is_planned_from_the_budget_the_engine_logged(tmp_path: Path) -> None:
    """cache_config_info's kv_cache_memory_bytes is None on CUDA unless set: the log's
    "Available KV cache memory" is the budget, not a fixed 1 GiB (~50x off)."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    budget = int(22.47 * 2**30)
    engine = capacity.predict_vllm_kv_cache(LLAMA_8B, budget, block_size=16, kv_dtype="bf16",
                                            max_model_len=2048)
    metrics = _cache_config_info(engine)
    fp8 = Variant("fp8", tmp_path, "id", "float-quantized")
    record = measure.ModelRecord(fp8)
    measure.record_engine(record, _FakeServer(metrics, A100_FP8_LOG),  # type: ignore[arg-type]
                          EngineSettings(max_model_len=2048))
    assert record.kv[tracking.KV_CACHE_MEMORY_BYTES] == budget
    assert record.kv[tracking.KV_CACHE_TOKENS_VS_PLANNED] == pytest.approx(1.0, abs=0.01)
    assert record.engine["kv_budget_source"].startswith("engine log")
    assert record.engine[tracking.ENGINE_WEIGHT_MEMORY_BYTES] == int(8.49 * 2**30)
    assert record.engine["fp8_weight_only"] and record.engine["enforce_eager"] is False
    # without the log line there is no budget to plan from: no made-up comparison
    bare = measure.ModelRecord(fp8)
    measure.record_engine(bare, _FakeServer(metrics, ""),  # type: ignore[arg-type]
                          EngineSettings(max_model_len=2048))
    assert tracking.KV_CACHE_TOKENS_VS_PLANNED not in bare.kv
    assert bare.engine["kv_budget_source"].startswith("unknown")


def test_a_model_the_planner_refuses_is_a_note_in_bench_not_its_end(tmp_path: Path) -> None:
    """A hybrid whose layers the planner does not know: the engine's own figures are kept,
    the planned comparison is left out with the planner's reason, and the bench goes on."""
    hybrid = {**LLAMA_8B, "layer_types": ["full_attention", "mamba"] * 16}
    (tmp_path / "config.json").write_text(json.dumps(hybrid))
    engine = capacity.predict_vllm_kv_cache(LLAMA_8B, int(22.47 * 2**30), block_size=16,
                                            kv_dtype="bf16", max_model_len=2048)
    record = measure.ModelRecord(Variant("fp8", tmp_path, "id", "float-quantized"))
    measure.record_engine(record, _FakeServer(_cache_config_info(engine), A100_FP8_LOG),  # type: ignore[arg-type]
                          EngineSettings(max_model_len=2048))
    assert record.kv[tracking.KV_CACHE_TOKENS] == engine.kv_cache_tokens  # the engine's own
    assert tracking.KV_CACHE_TOKENS_VS_PLANNED not in record.kv
    note = record.engine["plan_note"]
    assert note.startswith("not planned, so not checked against the engine: ")
    assert "`layer_types` lists 'mamba' layers" in note and "not plan them as attention" in note
    # the bench's table and the comparison's row say it
    from pipeline.bench.table import format_table
    from pipeline.bench.workloads import load as load_workload
    from pipeline.core.artifacts import BenchSummary, ModelBench

    entry = ModelBench(recipe="fp8", status="ok", identity="id", format="float-quantized",
                       kv=record.kv, engine=record.engine)
    summary = BenchSummary(baseline="b", target="cuda", models={"fp8": entry})
    assert "fp8        plan: not planned" in format_table(summary, [load_workload("chat")])


def test_a_plan_off_the_engine_by_more_than_ten_percent_is_flagged(tmp_path: Path) -> None:
    """The engine holds 3x the requests the planner predicts for its budget (as an attention-only
    plan of a hybrid would): the ratio is kept, flagged in the record, the table and MLflow's
    figures, not only logged."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    budget = int(22.47 * 2**30)
    engine = capacity.predict_vllm_kv_cache(LLAMA_8B, budget, block_size=16, kv_dtype="bf16",
                                            max_model_len=2048)
    tripled = engine.__class__(**{**engine.__dict__, "max_concurrency": 3 * engine.max_concurrency})
    record = measure.ModelRecord(Variant("fp8", tmp_path, "id", "float-quantized"))
    measure.record_engine(record, _FakeServer(_cache_config_info(tripled), A100_FP8_LOG),  # type: ignore[arg-type]
                          EngineSettings(max_model_len=2048))
    assert record.kv[tracking.MAX_CONCURRENCY_VS_PLANNED] == pytest.approx(3.0, rel=0.01)
    assert record.kv[tracking.KV_PLAN_OFF] == 1.0
    check = record.engine["plan_check"]
    assert "max concurrency 3.00x the planned" in check and "[0.9, 1.1]" in check
    assert "kv cache tokens" not in check  # that one agrees
    from pipeline.bench.table import format_table
    from pipeline.bench.workloads import load as load_workload
    from pipeline.core.artifacts import BenchSummary, ModelBench

    entry = ModelBench(recipe="fp8", status="ok", identity="id", format="float-quantized",
                       kv=record.kv, engine=record.engine)
    summary = BenchSummary(baseline="b", target="cuda", models={"fp8": entry})
    assert "fp8        plan: the planner disagrees with the engine" in format_table(
        summary, [load_workload("chat")])
    # within the band: no flag
    agreed = measure.ModelRecord(Variant("fp8", tmp_path, "id", "float-quantized"))
    measure.record_engine(agreed, _FakeServer(_cache_config_info(engine), A100_FP8_LOG),  # type: ignore[arg-type]
                          EngineSettings(max_model_len=2048))
    assert agreed.kv[tracking.KV_PLAN_OFF] == 0.0 and "plan_check" not in agreed.engine


def test_at_tp_2_each_workers_budget_holds_its_share_of_the_kv_heads(tmp_path: Path) -> None:
    """vLLM's budget ("Available KV cache memory") and "Model loading took" are one worker's;
    at TP = 2 each holds 4 of Llama-3.1-8B's 8 KV heads, so the cache holds twice the tokens
    the whole model's page would give for that budget."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    per_worker = int(22.47 * 2**30)
    halved = {**LLAMA_8B, "num_key_value_heads": 4}  # what one worker's layers hold
    engine = capacity.predict_vllm_kv_cache(halved, per_worker, block_size=16, kv_dtype="bf16",
                                            max_model_len=2048)
    metrics = _cache_config_info(engine)
    record = measure.ModelRecord(Variant("fp8", tmp_path, "id", "float-quantized"))
    tp2 = EngineSettings(max_model_len=2048, tensor_parallel_size=2)
    measure.record_engine(record, _FakeServer(metrics, A100_FP8_LOG),  # type: ignore[arg-type]
                          tp2)
    assert record.kv[tracking.KV_CACHE_TOKENS_VS_PLANNED] == pytest.approx(1.0, abs=0.01)
    assert record.kv[tracking.MAX_CONCURRENCY_VS_PLANNED] == pytest.approx(1.0, abs=0.01)
    assert record.engine[tracking.ENGINE_WEIGHT_MEMORY_BYTES] == 2 * int(8.49 * 2**30)
    assert record.engine["engine_weight_memory_bytes_per_device"] == int(8.49 * 2**30)
    assert record.engine["devices"] == 2


def test_an_fp8_kv_cache_asked_through_vllm_args_is_planned_as_fp8() -> None:
    assert measure.kv_dtype(EngineSettings()) == "bf16"
    assert measure.kv_dtype(EngineSettings(extra_args=("--kv-cache-dtype=fp8_e4m3",))) == "fp8"
    assert measure.kv_dtype(EngineSettings(extra_args=("--kv-cache-dtype", "fp8"))) == "fp8"


def test_the_plan_target_is_the_card_this_machine_has() -> None:
    auto = PlanTarget()
    a100 = _gpu("NVIDIA A100-SXM4-40GB", 40960, "8.0")
    target, note = resolve_plan_target(auto, a100)
    assert target.gpu == "a100-40gb" and note == ""
    h200 = _gpu("NVIDIA H200", 143771, "9.0")
    assert resolve_plan_target(auto, h200)[0].gpu == "h200-141gb"
    odd = _gpu("NVIDIA RTX 6000 Ada Generation", 49140, "8.9")
    target, _ = resolve_plan_target(auto, odd)
    assert target.memory_gb == pytest.approx(49140 * 2**20 / 1e9)
    cpu = hardware.Profile("cpu", "x86_64", "x", 2, ("avx2",), "native", "0.32.0")
    target, note = resolve_plan_target(auto, cpu)
    assert target.gpu == "h100-80gb" and "this machine has no GPU" in note
    # asked for an H100 on an A100: planned as asked, and the report says it differs
    target, note = resolve_plan_target(PlanTarget(gpu="h100-80gb"), a100)
    assert target.gpu == "h100-80gb" and "not for this machine's NVIDIA A100-SXM4-40GB" in note


def test_caches_and_refusals_are_kept_per_gpu_model(monkeypatch: pytest.MonkeyPatch,
                                                    workspace: Path) -> None:
    models = [Variant("baseline", Path("/m"), "id")]
    keys = {}
    for profile in (_gpu("NVIDIA L40S", 46068, "8.9"), _gpu("NVIDIA H100 80GB HBM3", 81559,
                                                             "9.0")):
        monkeypatch.setattr(hardware, "profile", lambda p=profile: p)
        keys[profile.key()] = (stage.cache_key(models, [], EngineSettings(), "cuda"),
                               failure._refusal_file("id").name)
    (l40s_bench, l40s_refusal), (h100_bench, h100_refusal) = keys.values()
    assert l40s_bench != h100_bench and l40s_refusal != h100_refusal
    assert "sm89" in l40s_refusal and "sm90" in h100_refusal


def test_one_engine_configuration_for_every_server_of_a_campaign() -> None:
    """GPU_UTIL and MAX_MODEL_LEN reach eval's servers as well as bench's; calibration settings
    reach every quantize stage."""
    from pipeline.cli import build_parser
    from pipeline.core.settings import from_args

    args = build_parser("campaign").parse_args([
        "campaign", "--baseline=tiny", "--gpu-memory-utilization=0.5",
        "--vllm-arg=--enable-lora", "--calib-samples", "512"])
    settings = from_args(campaign.CampaignSettings, args)
    quantize, bench, evaluate = campaign.stages(settings, settings.file())
    assert bench is not None
    for one in (bench, evaluate):
        assert one.engine.gpu_memory_utilization == 0.5
        assert one.engine.extra_args == ("--enable-lora",)
    for name, one in (("bench", bench), ("eval", evaluate)):
        line = one.command(name)
        assert "--gpu-memory-utilization=0.5" in line and "--vllm-arg=--enable-lora" in line
    assert {q.calibration.calib_samples for q in quantize} == {512}
    settings = EvalSettings(engine=EngineSettings(gpu_memory_utilization=0.5,
                                                  extra_args=("--enable-lora",)))
    engine = lm.engine_for(Variant("x", Path("/nowhere"), "id"), settings)
    assert engine.gpu_memory_utilization == 0.5 and engine.extra_args == ("--enable-lora",)


def test_mig_instances_report_no_memory_without_killing_the_sampler(
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = "4242, [N/A]\n4243, 1024\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout=out, stderr=""))
    assert server.gpu_memory_of({4242, 4243}) == 1024 * 2**20


def test_the_full_campaign_leads_with_a_gpu_sized_workload_on_every_item() -> None:
    full = campaigns.load("full")
    assert full.workloads[0] == "smoke" and full.limit == "all"
    assert full.plan.gpu == "auto"


def test_the_comparisons_plan_follows_the_servers_utilisation_and_parallelism() -> None:
    """A 70B in bf16 (~141 GB) fits 4 H100s at TP 4, not one; half the memory utilisation
    plans fewer requests, not the 0.9 default's."""
    config = json.loads((Path(__file__).parents[1] / "configs/models/llama-3.1-70b/config.json"
                         ).read_text())
    target = PlanTarget(gpu="h100-80gb", context=2048, max_context=8192)
    def row() -> Row:
        return Row(name="baseline", recipe="none", scheme="bf16", format="dense",
                   precision="bf16", weight_bytes=1, weight_ratio=1.0)

    one = row()
    placement.apply_plan(one, config, target)
    assert not one.plan and one.notes[0].startswith("plan: ")  # one H100 cannot hold it
    tp4 = {"tensor_parallel_size": 4, "pipeline_parallel_size": 1,
           "gpu_memory_utilization": 0.9}
    four = row()
    placement.apply_plan(four, config, target, tp4)
    paged = four.plan.planned_max_concurrency_paged
    assert paged > 0 and not four.notes
    half = {**tp4, "gpu_memory_utilization": 0.5}
    halved = row()
    placement.apply_plan(halved, config, target, half)
    assert 0 < halved.plan.planned_max_concurrency_paged < paged / 2
    assert placement.served_as(half) == ("planned as the servers were started: TP 4 x PP 1: "
                                        "weights and KV heads split over 4 devices, 50% of "
                                        "each device's memory")
    assert placement.served_as({}) == ""


NVIDIA_SMI_L = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1a2b3c4d-0000-0000-0000-000000000000)
  MIG 1g.10gb     Device  0: (UUID: MIG-5c6b7a8e-1111-1111-1111-111111111111)
  MIG 3g.40gb     Device  1: (UUID: MIG-9d8c7b6a-2222-2222-2222-222222222222)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-5e6f7a8b-0000-0000-0000-000000000000)
"""


def test_a_mig_slice_and_an_unlisted_card_are_not_the_full_preset(
        monkeypatch: pytest.MonkeyPatch, workspace: Path) -> None:
    """nvidia-smi names the parent card for a MIG slice, and an H100 NVL (94 GB) is an
    "H100": keyed, planned and described by the memory the servers see."""
    assert hardware.mig_profile(NVIDIA_SMI_L, "") == "1g.10gb"  # card 0 is in MIG mode
    assert hardware.mig_profile(NVIDIA_SMI_L, "MIG-9d8c7b6a-2222-2222-2222-222222222222") \
        == "3g.40gb"
    assert hardware.mig_profile(NVIDIA_SMI_L, "1") == ""  # a whole card
    full = _gpu("NVIDIA H100 80GB HBM3", 81559, "9.0")
    gpu = hardware.Gpu("NVIDIA H100 80GB HBM3", None, "9.0", "1g.10gb")
    mig = hardware.Profile("cuda", "x86_64", "x", 16, (), "native", "0.32.0", (gpu,))
    nvl = _gpu("NVIDIA H100 NVL", 95830, "9.0")
    keys = {p.key() for p in (full, mig, nvl)}
    assert len(keys) == 3 and mig.key().endswith("-mig1g10gb")
    models = [Variant("baseline", Path("/m"), "id")]
    cached = set()
    for profile in (full, mig, nvl):  # nothing measured on one is reused on another
        monkeypatch.setattr(hardware, "profile", lambda p=profile: p)
        cached.add((stage.cache_key(models, [], EngineSettings(), "cuda"),
                    failure._refusal_file("id").name))
    assert len(cached) == 3
    assert "MIG slice 1g.10gb, 9 GiB" in mig.describe()
    assert resolve_plan_target(PlanTarget(), full)[0].gpu == "h100-80gb"
    target, note = resolve_plan_target(PlanTarget(), nvl)
    assert target.memory_gb == pytest.approx(95830 * 2**20 / 1e9)
    assert "NVIDIA H100 NVL, not a preset" in note
    target, note = resolve_plan_target(PlanTarget(), mig)
    assert target.memory_gb == pytest.approx(10, rel=1e-3) and "MIG slice 1g.10gb" in note
    # priced: the slice as its whole card, the unlisted card as its family's nearest, said
    devices = hardware.serving_devices(mig, visible="")
    assert devices["mig"] and devices["memory_mib"] == gpu.visible_memory_mib
    priced = cost.price_of(CostTarget(), devices)
    assert "a MIG slice, priced as the whole GPU" in priced.source
    priced = cost.price_of(CostTarget(), hardware.serving_devices(nvl, visible=""))
    assert "NVIDIA H100 NVL has no preset, priced as the nearest" in priced.source


def test_every_served_score_comes_before_any_model_loaded_in_this_process(
        monkeypatch: pytest.MonkeyPatch, workspace: Path) -> None:
    """An emulated model (hf, on the GPU) holds memory a vLLM server started after it lacks
    ("Free memory on device ... less than desired GPU memory utilization"): every served
    score first, the refused format's emulated score after, the emulated baseline last."""
    from types import SimpleNamespace

    from pipeline.eval import score as scoring
    from pipeline.eval import stage as evaluation
    from pipeline.serve import UnsupportedFormat

    calls: list[tuple[str, str]] = []

    def fake_score(base_name: str, model: Variant, tasks: list, backend: str, *a: object,
                   **k: object) -> dict:
        calls.append((model.name, backend))
        if model.name == "mxfp4" and backend == lm.SERVED:
            raise UnsupportedFormat("no MXFP4 kernel", reason="no MXFP4 kernel")
        return {"t": SimpleNamespace(command="lm_eval ...")}

    monkeypatch.setattr(scoring, "score", fake_score)
    monkeypatch.setattr(evaluation, "score", fake_score)
    for name in ("compare", "run_suite_figures", "print_report", "write_summary", "log_mlflow"):
        monkeypatch.setattr(evaluation, name, lambda *a, **k: None)
    monkeypatch.setattr(evaluation, "prepare_for", lambda tasks: tasks)
    base = SimpleNamespace(name="tiny", path=Path("/m"), identity="b")
    monkeypatch.setattr(evaluation, "baseline_variant",
                        lambda b: Variant("baseline", Path("/m"), "b"))
    models = [Variant(n, Path(f"/{n}"), n) for n in ("fp8", "mxfp4", "int8")]
    report = evaluation.evaluate(base, models, [SimpleNamespace(name="t")],  # type: ignore
                                 EvalSettings(baseline="tiny", divergence=False), track=False)
    assert calls == [("fp8", lm.SERVED), ("mxfp4", lm.SERVED), ("int8", lm.SERVED),
                     ("baseline", lm.SERVED), ("mxfp4", lm.EMULATED),
                     ("baseline", lm.EMULATED)]
    assert report["mxfp4"].backend == lm.EMULATED and report["int8"].backend == lm.SERVED


SMOLLM2_INT4 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "vocab_size": 49152, "quantization_config": {"config_groups": {"group_0": {
                    "weights": {"num_bits": 4, "type": "int", "group_size": 64}}}}}


def test_int4_on_hopper_runs_machete_only_where_its_shape_rules_hold(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """vLLM logs the kernels it used, not which layers: by its rules, SmolLM2's 576-wide
    (q/o, down) and 960-wide (merged qkv) layers miss Machete's 128-column blocks."""
    from pipeline.plan import wna16_kernels

    kernels = wna16_kernels.by_layer(SMOLLM2_INT4, "9.0")
    assert kernels == {"qkv_proj": "MarlinLinearKernel", "o_proj": "MarlinLinearKernel",
                       "gate_up_proj": "MacheteLinearKernel", "down_proj": "MarlinLinearKernel"}
    llama = {**LLAMA_8B, "quantization_config": SMOLLM2_INT4["quantization_config"]}
    assert set(wna16_kernels.by_layer(llama, "9.0").values()) == {"MacheteLinearKernel"}
    assert set(wna16_kernels.by_layer(llama, "8.0").values()) == {"MarlinLinearKernel"}
    assert set(wna16_kernels.by_layer(llama, "10.0").values()) == {"MarlinLinearKernel"}
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_INT4))
    monkeypatch.setattr(hardware, "profile", lambda: _gpu("NVIDIA H100 80GB HBM3", 81559, "9.0"))
    record = measure.ModelRecord(Variant("int4", tmp_path, "id", "pack-quantized"))
    measure.record_engine(record, _FakeServer("", H100_INT4_LOG),  # type: ignore[arg-type]
                          EngineSettings())
    text = record.engine["kernels_by_layer_text"]
    assert text.startswith("MarlinLinearKernel for qkv_proj, o_proj, down_proj; "
                           "MacheteLinearKernel for gate_up_proj")
    assert "its log names the same kernels" in text
    only_machete = H100_INT4_LOG.split("\n", 1)[1]  # a log naming Machete alone
    measure.record_engine(record, _FakeServer("", only_machete),  # type: ignore[arg-type]
                          EngineSettings())
    assert "its log names MacheteLinearKernel" in record.engine["kernels_by_layer_text"]


def test_an_older_compression_config_is_read_as_a_quantization_config() -> None:
    """Checkpoints from before compressed-tensors renamed its section keep it under
    ``compression_config``: the kernel rule and the planner read it as the table does."""
    from pipeline.plan import architecture, wna16_kernels

    older = {k: v for k, v in SMOLLM2_INT4.items() if k != "quantization_config"}
    older["compression_config"] = {**SMOLLM2_INT4["quantization_config"],
                                   "quant_method": "compressed-tensors"}
    assert wna16_kernels.weight_group_size(older) == 64
    assert wna16_kernels.by_layer(older, "9.0") == wna16_kernels.by_layer(SMOLLM2_INT4, "9.0")
    section = {"compression_config": older["compression_config"]}
    assert architecture.parse_architecture({**LLAMA_8B, **section}
                                           ).checkpoint_quantization == "compressed-tensors"
    nested = {"architectures": ["LlavaForConditionalGeneration"], "text_config": LLAMA_8B}
    assert architecture.parse_architecture({**nested, **section}
                                           ).checkpoint_quantization == "compressed-tensors"


def test_the_plan_takes_the_kv_block_the_engine_used_on_that_card() -> None:
    """A GPU attention backend's block is not always the preset's 16 (FlashInfer, MLA): where
    the plan is for the card measured, each request is rounded up to the engine's blocks."""
    config = json.loads((Path(__file__).parents[1] / "configs/models/llama-3.1-70b/config.json"
                         ).read_text())
    target = PlanTarget(gpu="h100-80gb", context=2050, max_context=8192)
    tp4 = {"tensor_parallel_size": 4}
    preset = capacity.plan_capacity(config, placement.plan_settings(target, "bf16", 128,
                                                                  engine=tp4))
    engine = capacity.plan_capacity(config, placement.plan_settings(target, "bf16", 128,
                                                                  engine=tp4, block_size=64))
    per_token = preset.kv_bytes_per_token_all_layers
    assert preset.kv_bytes_per_request == 2064 * per_token  # 129 blocks of 16
    assert engine.kv_bytes_per_request == 2112 * per_token  # 33 blocks of 64
    assert engine.paged < preset.paged


def test_make_all_on_a_gpu_host_runs_the_gpu_sized_workloads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.campaign import settings as campaign_settings
    from pipeline.core.settings import from_options

    monkeypatch.setattr(campaign_settings, "serve_target", lambda: "cuda")
    settings = campaign.CampaignSettings(baseline="tiny")
    bench = campaign.stages(settings, settings.file())[1]
    assert bench is not None and bench.workloads == ("smoke", "chat", "prefix")
    cost = from_options(campaign.CampaignSettings, baseline="tiny", objective="cost")
    bench = campaign.stages(cost, cost.file())[1]
    assert bench is not None and bench.workloads[-1] == "capacity-gpu"
    chosen = from_options(campaign.CampaignSettings, baseline="tiny", workloads=("chat",))
    assert campaign.stages(chosen, chosen.file())[1].workloads == ("chat",)  # type: ignore
    monkeypatch.setattr(campaign_settings, "serve_target", lambda: "cpu")
    assert campaign.stages(settings, settings.file())[1].workloads == (  # type: ignore
        "chat", "prefix")
