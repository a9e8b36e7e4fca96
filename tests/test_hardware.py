"""The hardware profile: CPU ISA classes, forced ISA, nvidia-smi parsing, and the doctor's table."""

from __future__ import annotations

import pytest

from pipeline.core import hardware
from pipeline.core.errors import ConfigError
from pipeline.serve import doctor

AVX2_ONLY = """processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2
"""
AVX512_BF16 = AVX2_ONLY.replace("AMD EPYC 7B12", "AMD EPYC 9B14").replace(
    "bmi2", "bmi2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16")
SAPPHIRE = AVX512_BF16.replace("AMD EPYC 9B14", "Intel(R) Xeon(R) Platinum 8481C").replace(
    "avx512_bf16", "avx512_bf16 amx_bf16 amx_tile amx_int8")


def _cpu(cpuinfo: str, isa: str = "native") -> hardware.Profile:
    model, flags = hardware.parse_cpuinfo(cpuinfo)
    return hardware.Profile("cpu", "x86_64", model, 2, flags, isa, "0.32.0")


def test_cpu_isa_classes_decide_the_kernel_library_as_vllm_does() -> None:
    assert _cpu(AVX2_ONLY).kernel_library == "_C_AVX2"
    assert _cpu(AVX2_ONLY).key() == "cpu-avx2"
    assert _cpu(AVX512_BF16).kernel_library == "_C"
    assert _cpu(AVX512_BF16).key() == "cpu-avx512bf16"
    assert _cpu(SAPPHIRE).key() == "cpu-avx512bf16+amx"
    no_bf16 = _cpu(AVX512_BF16.replace(" avx512_bf16", ""))
    assert no_bf16.kernel_library == "_C_AVX512" and no_bf16.key() == "cpu-avx512"
    assert "AMD EPYC 7B12" in _cpu(AVX2_ONLY).describe()
    assert "loads _C_AVX2 (AVX2)" in _cpu(AVX2_ONLY).describe()


def test_a_forced_isa_hides_avx512_and_amx_from_the_profile_and_the_key() -> None:
    forced = _cpu(SAPPHIRE, "avx2")
    assert forced.kernel_library == "_C_AVX2" and forced.key() == "cpu-avx2"
    assert "amx_tile" in forced.cpu_flags and "amx_tile" not in forced.flags_seen
    assert "forced avx2" in forced.describe()
    assert _cpu(SAPPHIRE, "avx512").kernel_library == "_C_AVX512"


def test_the_forced_isa_reaches_the_serving_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    env = hardware.serving_environment("avx2")
    assert env[hardware.ISA_ENV] == "avx2"
    assert env["PYTHONPATH"].split(":")[0] == str(hardware.SHIM_DIR)
    assert (hardware.SHIM_DIR / "sitecustomize.py").is_file()
    assert hardware.serving_environment("native") == {}
    monkeypatch.setenv(hardware.ISA_ENV, "avx3")
    with pytest.raises(ConfigError, match="avx2"):
        hardware.forced_isa()


def test_nvidia_smi_rows_with_mig_memory_and_without_compute_capability() -> None:
    gpus = hardware.parse_nvidia_smi("NVIDIA H100 80GB HBM3, 81559, 9.0\n"
                                     "NVIDIA A100-SXM4-40GB MIG 1g.5gb, [N/A], 8.0\n"
                                     "Tesla T4, 15360\n")
    assert gpus[0] == hardware.Gpu("NVIDIA H100 80GB HBM3", 81559, "9.0")
    assert gpus[1].memory_mib is None and gpus[1].compute_capability == "8.0"
    assert gpus[2].compute_capability == ""
    h100 = hardware.Profile("cuda", "x86_64", "x", 8, (), "native", "0.32.0", gpus[:1])
    assert h100.key() == "cuda-nvidia-h100-80gb-hbm3-sm90-80g"
    assert "compute capability 9.0" in h100.describe()


def test_a_missing_kernel_op_is_explained_by_the_cpu_that_lacks_it() -> None:
    reason = "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"
    fact = hardware.explain(reason, _cpu(AVX2_ONLY))
    assert "_C_AVX2" in fact and "no cpu_gemm_wna16 kernel for W4A16" in fact
    assert "AMD EPYC" in hardware.explain("ValueError: Failed to find a kernel", _cpu(AVX2_ONLY))


def test_doctor_reads_w4a16_support_from_the_kernel_library_probe() -> None:
    avx2 = {s.recipes: s for s in doctor.cpu_support(
        _cpu(AVX2_ONLY), {"library": "_C_AVX2", "ops": ["onednn_scaled_mm"]})}
    assert avx2["int4"].status == doctor.UNSUPPORTED and avx2["int4"].source == "probe"
    assert "_C_AVX2 has no cpu_gemm_wna16" in avx2["int4"].why
    assert avx2["int8"].status == doctor.SERVES
    assert avx2["mxfp4"].status == doctor.UNSUPPORTED
    kv = next(s for s in doctor.cpu_support(_cpu(AVX2_ONLY), None) if "KV" in s.format)
    assert kv.status == doctor.UNSUPPORTED
    bf16 = {s.recipes: s for s in doctor.cpu_support(
        _cpu(AVX512_BF16), {"library": "_C", "ops": ["cpu_gemm_wna16", "onednn_scaled_mm"]})}
    assert bf16["int4"].status == doctor.SERVES


def test_doctor_on_gpus_follows_the_compute_capability() -> None:
    def on(cc: str) -> dict[str, doctor.Support]:
        prof = hardware.Profile("cuda", "x86_64", "x", 8, (), "native", "0.32.0",
                                (hardware.Gpu("GPU", 40960, cc),))
        return {s.recipes: s for s in doctor.cuda_support(prof)}

    assert on("8.0")["fp8"].status == doctor.PARTIAL and "W8A16" in on("8.0")["fp8"].why
    assert on("9.0")["fp8"].status == doctor.SERVES
    assert on("7.5")["int4"].status == doctor.UNSUPPORTED and on("7.5")["int8"].status == \
        doctor.SERVES
    assert [s.status for s in on("").values()] == [doctor.UNKNOWN]


def test_native_bf16_decides_whether_float32_is_probed_as_the_reference(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from pipeline.bench import reference_dtype as reference
    from pipeline.core.variant import Variant
    from pipeline.serve import EngineSettings

    assert _cpu(AVX512_BF16).native_bf16 and _cpu(SAPPHIRE).native_bf16
    assert not _cpu(AVX2_ONLY).native_bf16 and not _cpu(SAPPHIRE, "avx2").native_bf16
    assert not _cpu(AVX512_BF16.replace(" avx512_bf16", "")).native_bf16
    # native bf16, or a GPU: the engine's dtype, nothing measured
    monkeypatch.setattr(hardware, "profile", lambda: _cpu(AVX512_BF16))
    base = Variant("baseline", tmp_path, "B")
    chosen = reference.choose(base, [], EngineSettings(), tmp_path, tmp_path, "cpu")
    assert chosen["dtype"] == "bfloat16" and "natively" in chosen["why"]
    assert reference.choose(base, [], EngineSettings(), tmp_path, tmp_path, "cuda")[
        "dtype"] == "bfloat16"
    # no native bf16 but no speed sweep to compare on: said so
    monkeypatch.setattr(hardware, "profile", lambda: _cpu(AVX2_ONLY))
    assert "no speed sweep" in reference.choose(base, [], EngineSettings(), tmp_path,
                                                tmp_path, "cpu")["why"]
    # set by the user: taken as it is, nothing probed
    assert reference.choose(base, [], EngineSettings(), tmp_path, tmp_path, "cpu",
                            "float32") == {"dtype": "float32",
                                           "why": "REFERENCE=float32 (set, not probed)"}


def test_a_probes_decision_is_reused_by_the_next_bench_run_here(
        monkeypatch: pytest.MonkeyPatch, workspace) -> None:
    """The float32-against-bf16 probe costs two servers and a few runs: its decision is kept
    by the baseline, hardware, engine, vLLM and sweep, and reused until FORCE=1."""
    from pipeline.bench import reference_dtype as reference
    from pipeline.bench import workloads
    from pipeline.core.artifacts import PointFigures
    from pipeline.core.speedup import FASTER, Speedup
    from pipeline.core.variant import Variant
    from pipeline.serve import EngineSettings
    from tests.conftest import TINY_LOAD

    monkeypatch.setattr(hardware, "profile", lambda: _cpu(AVX2_ONLY))
    (workspace / "tiny.yaml").write_text(TINY_LOAD)
    sweep = workloads.load(str(workspace / "tiny.yaml"))
    probes = []

    def measure(groups, steps, records, *args, **kwargs):  # float32 1.5x bf16, every repeat
        probes.append(len(steps))
        for name, record in records.items():
            tps = 15.0 if name.endswith("float32") else 10.0
            record.runs[sweep.name] = {sweep.headline: [
                {"output_throughput": tps * (1 + 0.01 * r), "completed": 4, "num_prompts": 4}
                for r in range(len(steps))]}

    monkeypatch.setattr(reference, "measure", measure)
    monkeypatch.setattr(reference, "point_figures", lambda runs, base, looks: PointFigures(
        speedup=Speedup(1.5, 1.4, 1.6, 2, 0.95, FASTER, 0.01)))
    base = Variant("baseline", workspace, "B")
    first = reference.choose(base, [sweep], EngineSettings(), workspace, workspace, "cpu")
    assert first["dtype"] == "float32" and probes == [sweep.repeats]
    again = reference.choose(base, [sweep], EngineSettings(), workspace, workspace, "cpu")
    assert again["dtype"] == "float32" and "reused" in again["why"] and len(probes) == 1
    reference.choose(base, [sweep], EngineSettings(), workspace, workspace, "cpu", force=True)
    assert len(probes) == 2


def test_the_worker_cpus_are_one_per_physical_core_on_one_numa_node() -> None:
    # 4 logical CPUs on 2 cores (SMT siblings 0/2 and 1/3), one node: the highest of each core
    cores = {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)}
    assert hardware.worker_cpus({0, 1, 2, 3}, cores, dict.fromkeys(range(4), 0)) == (2, 3)
    assert hardware.worker_cpus({0, 1}, cores, dict.fromkeys(range(4), 0)) == (0, 1)
    # two nodes, or a CPU of unknown topology: vLLM's own binding is kept
    assert hardware.worker_cpus({0, 1}, cores, {0: 0, 1: 1}) is None
    assert hardware.worker_cpus({0, 5}, cores, dict.fromkeys(range(6), 0)) is None


def test_serving_cpus_reads_sysfs(tmp_path) -> None:
    import os

    allowed = sorted(os.sched_getaffinity(0))
    for cpu in allowed:
        topology = tmp_path / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{cpu // 2}\n")  # pairs of SMT siblings
    (tmp_path / "node" / "node0").mkdir(parents=True)
    (tmp_path / "node" / "node0" / "cpulist").write_text(f"0-{max(allowed)}\n")
    expected = tuple(sorted({cpu // 2: cpu for cpu in allowed}.values()))
    assert hardware.serving_cpus.__wrapped__(tmp_path) == expected
