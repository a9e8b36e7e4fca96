"""Check, from what a GPU run left on disk, each behaviour that only a GPU shows.

Run by ``scripts/gpu_smoke.sh`` after setup, quantize, bench, eval and compare on a CUDA
machine (reads ``$QPIPE_ARTIFACTS``, default ``artifacts/``); prints one line per check and
exits 1 if any failed. Every check says, in words, the behaviour it covers.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.core.artifacts import SERVED, BenchSummary, Comparison, RecoverySummary
from pipeline.core.paths import artifacts_dir

ARTIFACTS = artifacts_dir()
results: list[tuple[bool, str]] = []


def check(ok: bool, what: str) -> None:
    results.append((bool(ok), what))
    print(f"[gpu-check] {'PASS' if ok else 'FAIL'} {what}", flush=True)


def newest(pattern: str) -> Path | None:
    found = sorted(ARTIFACTS.glob(pattern), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def main() -> int:
    summary_path = newest("bench/*/*/summary.json")
    if summary_path is None:
        print("[gpu-check] no bench summary under", ARTIFACTS, "- run the bench first")
        return 1
    summary = BenchSummary.read(summary_path)
    assert summary is not None
    hw = summary.hardware
    check(summary.target == "cuda" and hw.get("key", "").startswith("cuda-"),
          f"bench ran on CUDA, hardware key {hw.get('key')} (7: caches keyed by GPU model)")
    gpus = hw.get("gpus") or [{}]
    cc = float(gpus[0].get("compute_capability") or 0)
    check(summary.speedup_pairing.startswith("sequential"),
          "speedups labelled sequential on a GPU, not 'interleaved'")
    for name, entry in summary.models.items():
        if entry.status != "ok":
            print(f"[gpu-check] note {name}: {entry.status}: {entry.reason}")
            continue
        engine, kv = entry.engine, entry.kv
        check(engine.get("enforce_eager") is False,
              f"{name}: served compiled with CUDA graphs, not eager (1)")
        check(engine.get("kv_budget_source", "").startswith("engine log"),
              f"{name}: KV budget read from the engine's log: {engine.get('kv_budget_source')} (2)")
        ratio = kv.get("kv_cache_tokens_vs_planned")
        check(ratio is not None and abs(ratio - 1) <= 0.01,
              f"{name}: vLLM's KV tokens / planned = {ratio} (2: within 1%)")
        check(bool(engine.get("engine_weight_memory_bytes")),
              f"{name}: weight memory from 'Model loading took': "
              f"{engine.get('engine_weight_memory_bytes')} B (3)")
        if entry.format == "float-quantized":
            weight_only = bool(engine.get("fp8_weight_only"))
            check(weight_only == (cc < 8.9),
                  f"{name}: scheme {engine.get('scheme')!r} at compute capability {cc} (4)")
        sweep = next(iter(entry.workloads.values()), None)
        check(sweep is not None and sweep.prefix_cache_hit_tokens == 0,
              f"{name}: the headline sweep was cold (0 prefix-cache hit tokens)")
        search = next((w.capacity for w in entry.workloads.values() if w.capacity), None)
        check(search is not None and search.get("slo_max_concurrency", 0) > 0,
              f"{name}: capacity at the objective: "
              f"{search and search.get('slo_max_concurrency')} users, limited by "
              f"{search and search.get('limited_by')} (15.1)")
        if engine.get("kv_cache_dtype") == "fp8" or name.endswith("fp8kv"):
            base = summary.models.get("baseline")
            per_byte = kv.get("kv_cache_tokens", 0) / max(1, kv.get("kv_cache_memory_bytes", 1))
            base_per_byte = (base.kv.get("kv_cache_tokens", 0)
                             / max(1, base.kv.get("kv_cache_memory_bytes", 1))) if base else 0
            check(engine.get("kv_cache_dtype") == "fp8" and base_per_byte > 0
                  and abs(per_byte / base_per_byte - 2) <= 0.05,
                  f"{name}: FP8 KV cache holds {per_byte / max(base_per_byte, 1e-12):.2f}x the "
                  "tokens per byte of the baseline's bf16 cache (15.4: ~2x, as planned)")
    recoveries = [RecoverySummary.read(p) for p in ARTIFACTS.glob(
        f"evals/*/*/{RecoverySummary.FILE}")]
    served = [r.recipe or "?" for r in recoveries
              if r is not None and any(t.backend == SERVED for t in r.tasks.values())]
    check(bool(served), f"eval scored through the GPU vLLM server: {', '.join(served) or 'none'}")
    report = newest(f"reports/*/{Comparison.FILE}")
    comparison = Comparison.read(report) if report is not None else None
    if comparison is not None:
        target = comparison.plan_target
        check(comparison.plan_note == "",
              f"planned for this machine's card: {target.gpu} {target.memory_gb or ''} (6)")
        priced = [r.name for r in comparison.rows if r.cost.get("usd_per_million_output_tokens")]
        check(bool(priced) and "preset" in comparison.price.get("source", ""),
              f"cost per million tokens at the card's preset price for: {', '.join(priced)} "
              "(15.5)")
    divergence = newest("evals/*/divergence/*-cuda.json")
    check(divergence is not None, "held-out divergence ran on the GPU (10)")
    failed = [what for ok, what in results if not ok]
    print(f"[gpu-check] {len(results) - len(failed)} of {len(results)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
