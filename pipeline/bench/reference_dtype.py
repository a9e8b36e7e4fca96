"""The reference every speedup is measured against: the unquantized serving a user would choose.

On a CPU without native bf16 (no AVX-512 bf16, no AMX), vLLM emulates bf16 arithmetic, and the
unquantized model may serve faster in float32: a team serving it there would pick the faster of
the two, so a speedup against slow bf16 would be inflated. On such a CPU the baseline is served
both ways side by side at the first speed sweep's headline load point (interleaved, repeats
added while undecided: the speed rule of :mod:`pipeline.core.speedup`), and float32 becomes the
reference when it is shown faster. Elsewhere the reference is the engine's dtype.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pipeline.bench.client import BenchClient
from pipeline.bench.measure import ModelRecord, Step, measure
from pipeline.bench.summary import point_figures
from pipeline.bench.workloads import Workload
from pipeline.core import hardware, paths
from pipeline.core import log as qlog
from pipeline.core.fsutil import read_json, write_json_atomic
from pipeline.core.provenance import content_key, vllm_version
from pipeline.core.speedup import FASTER
from pipeline.core.variant import BASELINE, Variant
from pipeline.serve import EngineSettings

log = qlog.get("bench")
FLOAT32 = "float32"


def _probe_record(base: Variant, sweep: Workload, settings: EngineSettings) -> Path:
    """Where a probe's decision is kept: by the baseline, this hardware, the engine, vLLM and
    the sweep it ran at, so that the next bench run here takes the same reference."""
    payload = {"baseline": base.identity, "hardware": hardware.profile().key(),
               "engine": settings.identity(), "vllm": vllm_version(),
               "sweep": dataclasses.asdict(sweep)}
    return paths.artifacts_dir() / "cache" / "reference" / f"{content_key(payload)}.json"


def choose(base: Variant, loads: list[Workload], settings: EngineSettings, out: Path,
           logs: Path, target: str, wanted: str = "auto", force: bool = False,
           client: BenchClient | None = None) -> dict[str, Any]:
    """``{"dtype": ..., "why": ...}`` (and the probe's figures where one ran); ``wanted``: a
    dtype the user set (``REFERENCE=``), taken as it is. A probe's decision is kept and reused
    by the next bench run with the same inputs (``FORCE=1`` probes again)."""
    if wanted != "auto":
        return {"dtype": wanted, "why": f"REFERENCE={wanted} (set, not probed)"}
    if target != "cpu":
        return {"dtype": settings.dtype, "why": "the engine's dtype (GPU)"}
    prof = hardware.profile()
    if prof.native_bf16:
        return {"dtype": settings.dtype, "why": "this CPU runs bf16 natively (AVX-512 bf16 or "
                "AMX): no faster unquantized dtype to look for"}
    sweep = next((w for w in loads if w.slo is None and not w.compare_prefix_caching
                  and w.models == "all"), None)
    if sweep is None:
        return {"dtype": settings.dtype, "why": "no speed sweep to compare bf16 and float32 on"}
    record = _probe_record(base, sweep, settings)
    kept = read_json(record) if record.is_file() and not force else None
    if kept and kept.get("dtype"):
        log.info(f"reference: the baseline in {kept['dtype']}, as probed before ({record})")
        return {**kept, "why": f"{kept['why']}; probed in an earlier bench run here, reused "
                               "(FORCE=1 probes again)"}
    fp32 = Variant(f"{BASELINE}-{FLOAT32}", base.path, base.identity)
    records = {BASELINE: ModelRecord(base), fp32.name: ModelRecord(fp32)}
    log.info(f"this CPU has no native bf16 ({prof.kernel_library}): serving the baseline in "
             f"{settings.dtype} and {FLOAT32} side by side at {sweep.name} concurrency "
             f"{sweep.headline}; the faster is the reference of every speedup")
    steps = [Step(sweep, sweep.name, r, sweep.headline, caching=False)
             for r in range(sweep.repeats)]
    measure([[base, fp32]], steps, records, settings, out / "reference", logs, caching=False,
            dtypes={fp32.name: FLOAT32}, client=client)
    if records[fp32.name].status != "ok" or records[BASELINE].status != "ok":
        failed = next(r for r in records.values() if r.status != "ok")
        return {"dtype": settings.dtype, "why": f"the {FLOAT32} probe did not complete "
                f"({failed.variant.name}: {failed.reason})"}
    runs = records[fp32.name].runs.get(sweep.name, {}).get(sweep.headline, [])
    base_runs = records[BASELINE].runs.get(sweep.name, {}).get(sweep.headline, [])
    found = point_figures(runs, base_runs, sweep.looks(target)).speedup
    assert found is not None
    chosen = FLOAT32 if found.verdict == FASTER else settings.dtype
    why = (f"{FLOAT32} serves the baseline at {found.text()} its {settings.dtype} throughput "
           f"here ({found.verdict}; no native bf16 on this CPU)")
    log.info(f"reference: the baseline in {chosen}: {why}")
    decided = {"dtype": chosen, "why": why, "probe": {
        "workload": sweep.name, "concurrency": sweep.headline, "float32_vs_bf16": found.as_dict(),
        "bf16_tok_s": [r["output_throughput"] for r in base_runs],
        "float32_tok_s": [r["output_throughput"] for r in runs]}}
    write_json_atomic(record, decided)
    return decided
