"""Check, from what a connected GPU smoke run left, each behaviour only a GPU shows.

Run by ``scripts/gpu_smoke.sh`` (connected mode) after quantize, bench, eval and compare on a
CUDA machine. Everything is found by key: the comparison of the baseline, and from its rows the
bench run each model was measured in and the server log vLLM wrote; the checks read vLLM's own
log lines. One PASS / FAIL line per check; exits 1 if any failed.

    python scripts/gpu_checks.py --recipes "fp8 int4" [--baseline NAME]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core.artifacts import SERVED, BenchSummary, Comparison  # noqa: E402
from pipeline.quantize import baseline as baselines  # noqa: E402

results: list[tuple[bool, str]] = []
GRAPHS = re.compile(r"Graph capturing finished in \d+ secs")
KV_DTYPE = re.compile(r"kv_cache_dtype=(\w+)")


def check(ok: bool, what: str) -> None:
    results.append((bool(ok), what))
    print(f"[gpu-check] {'PASS' if ok else 'FAIL'} {what}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="fp8 int4")
    parser.add_argument("--baseline", default="smollm2-135m-instruct")
    args = parser.parse_args()
    base = baselines.resolve(args.baseline)
    comparison = Comparison.read(Comparison.directory(base.name) / Comparison.FILE)
    if comparison is None:
        print(f"[gpu-check] FAIL no comparison of {base.name}: run make compare first")
        return 1
    rows = {r.name: r for r in comparison.rows}
    for name in ["baseline", *args.recipes.split()]:
        row = rows.get(name)
        if row is None:
            check(False, f"{name}: in the comparison")
            continue
        source = comparison.sources.get(f"bench:{name}")
        summary = BenchSummary.read(Path(source)) if source else None
        entry = summary.models.get(name) if summary else None
        if entry is None:
            check(False, f"{name}: measured in a bench run ({source or 'none'})")
            continue
        check(summary.target == "cuda",
              f"{name}: bench ran on CUDA ({summary.hardware.get('key')})")
        if entry.status != "ok":  # refused: said with vLLM's own words, not as a failure
            check(entry.status == "unsupported" and bool(entry.reason),
                  f"{name}: {entry.status}: {entry.reason[:200]}")
            continue
        log = Path(entry.log).read_text(errors="replace") if entry.log and Path(
            entry.log).is_file() else ""
        check(bool(GRAPHS.search(log)), f"{name}: CUDA graphs captured (vLLM's 'Graph "
              "capturing finished' line)")
        dtypes = set(KV_DTYPE.findall(log))
        check(bool(dtypes), f"{name}: KV cache dtype in the engine's config line: "
              f"{', '.join(sorted(dtypes)) or 'not found'} (recorded "
              f"{entry.engine.kv_cache_dtype})")
        check(entry.engine.kv_budget_source.startswith("engine log"),
              f"{name}: KV budget from 'Available KV cache memory': "
              f"{entry.kv.get('kv_cache_memory_bytes')} B per device")
        ratio = entry.kv.get("kv_cache_tokens_vs_planned")
        check(ratio is not None and abs(ratio - 1) <= 0.01,
              f"{name}: vLLM's KV tokens / planned = {ratio} (within 1%)")
        if name != "baseline":
            kernels = entry.engine.kernels
            check(bool(kernels), f"{name}: kernels from vLLM's log: {', '.join(kernels)}; "
                  f"{entry.engine.kernels_by_layer_text}")
        check(row.eval_backend == SERVED, f"{name}: scored through the GPU vLLM server "
              f"({row.eval_backend or 'not scored'})")
    check(comparison.plan_note == "" or "planned as the servers" in comparison.plan_note,
          f"planned for this machine's card: {comparison.plan_target.gpu} "
          f"{comparison.plan_note}")
    failed = [what for ok, what in results if not ok]
    print(f"[gpu-check] {len(results) - len(failed)} of {len(results)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
