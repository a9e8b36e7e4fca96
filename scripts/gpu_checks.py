"""Check, from what a GPU run left on disk, each behaviour that only a GPU shows.

Run by ``scripts/gpu_smoke.sh`` after setup, quantize, bench, eval and compare on a CUDA
machine (reads ``$QPIPE_ARTIFACTS``, default ``artifacts/``); prints one line per check and
exits 1 if any failed. Every check names the issue item it covers (GPU path: 1-14).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("QPIPE_ARTIFACTS", ROOT / "artifacts"))
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
    summary = json.loads(summary_path.read_text())
    hw = summary.get("hardware", {})
    check(summary.get("target") == "cuda" and hw.get("key", "").startswith("cuda-"),
          f"bench ran on CUDA, hardware key {hw.get('key')} (7: caches keyed by GPU model)")
    gpus = hw.get("gpus") or [{}]
    cc = float(gpus[0].get("compute_capability") or 0)
    check(summary.get("speedup_pairing", "").startswith("sequential"),
          "speedups labelled sequential on a GPU, not 'interleaved'")
    for name, entry in summary.get("models", {}).items():
        if entry.get("status") != "ok":
            print(f"[gpu-check] note {name}: {entry.get('status')}: {entry.get('reason')}")
            continue
        engine, kv = entry.get("engine", {}), entry.get("kv", {})
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
        if entry.get("format") == "float-quantized":
            weight_only = bool(engine.get("fp8_weight_only"))
            check(weight_only == (cc < 8.9),
                  f"{name}: scheme {engine.get('scheme')!r} at compute capability {cc} (4)")
        sweep = next(iter(entry.get("workloads", {}).values()), {})
        check(sweep.get("prefix_cache_hit_tokens", 1) == 0,
              f"{name}: the headline sweep was cold (0 prefix-cache hit tokens)")
    served = [p.parent.name for p in ARTIFACTS.glob("evals/*/*/recovery.json")
              if any(t.get("backend") == "served"
                     for t in json.loads(p.read_text()).get("tasks", {}).values())]
    check(bool(served), f"eval scored through the GPU vLLM server: {', '.join(served) or 'none'}")
    report = newest("reports/*/comparison.json")
    if report is not None:
        comparison = json.loads(report.read_text())
        check(comparison.get("plan_note", "x") == "",
              f"planned for this machine's card: {comparison.get('plan_target', {}).get('gpu')} "
              f"{comparison.get('plan_target', {}).get('memory_gb') or ''} (6)")
    divergence = newest("evals/*/divergence/*-cuda.json")
    check(divergence is not None, "held-out divergence ran on the GPU (10)")
    failed = [what for ok, what in results if not ok]
    print(f"[gpu-check] {len(results) - len(failed)} of {len(results)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
