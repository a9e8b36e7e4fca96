"""Serve the baseline and its variants through vLLM and load-test them with vLLM's own client.

For each workload, repeat and load point the models are measured back to back (interleaved on
a CPU host, where every server is up at once), so that the machine's drift cancels out of the
speedup; on a GPU each model has the device to itself in turn (sequential). Results of an
unchanged invocation are reused (``--force`` re-measures); a run with a failed model is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from datetime import datetime, timezone

from pipeline.bench import slo
from pipeline.bench import workloads as workloads_mod
from pipeline.bench.client import BenchClient
from pipeline.bench.measure import (
    ModelRecord,
    launch_ahead,
    measure,
    pass_label,
    pass_settings,
    recall_unsupported,
    steps_for,
    stop_all,
)
from pipeline.bench.reference_dtype import choose as choose_reference
from pipeline.bench.settings import BenchSettings
from pipeline.bench.summary import STAGE, log_runs, pairing, summarize
from pipeline.bench.table import format_table
from pipeline.bench.workloads import Workload
from pipeline.core import hardware, paths, tracking
from pipeline.core import log as qlog
from pipeline.core.artifacts import BenchSummary
from pipeline.core.errors import ConfigError
from pipeline.core.fsutil import atomic_dir
from pipeline.core.provenance import content_key, vllm_version
from pipeline.core.variant import BASELINE, Variant, with_baseline
from pipeline.quantize import baseline as baselines
from pipeline.serve import EngineSettings, ServerPool
from pipeline.serve.server import server_environment

log = qlog.get("bench")


def cache_key(models: list[Variant], loads: list[Workload], settings: EngineSettings,
              target: str, reference_dtype: str = "auto") -> str:
    payload = {"models": [(m.recipe, m.identity) for m in models],
               # a request file counts by its content (file_sha256), not where it lies
               "workloads": [{**dataclasses.asdict(w), "path": w.name, "prompts": "",
                              "trace": ""} for w in loads],
               "engine": settings.identity(), "target": target, "vllm": vllm_version(),
               "attainment": slo.COUNTED, "warm_up": workloads_mod.WARM_UP,
               "hardware": hardware.profile().key(),
               **({"reference": reference_dtype} if reference_dtype != "auto" else {}),
               **({"capacity_rule": slo.RULE} if any(w.slo is not None for w in loads) else {})}
    return content_key(payload)


def bench(base: baselines.Baseline, recipes: list[str] | None, loads: list[Workload],
          settings: EngineSettings, force: bool = False, target: str | None = None,
          pool: ServerPool | None = None, reference_dtype: str = "auto") -> BenchSummary:
    """Measure the baseline and the variants; the summary is also on disk and in MLflow.

    With a ``pool``, the servers of the speed sweeps (prefix caching off) stay up in it for
    the next stage. ``reference_dtype``: the baseline's dtype every speedup is against
    (``auto``: :mod:`pipeline.bench.reference_dtype` chooses).
    """
    target = target or hardware.serve_target()
    settings = settings.resolved(target)  # eager on CPUs, compiled on GPUs: recorded as such
    longest = max(w.max_tokens_per_request for w in loads)
    if longest > settings.max_model_len:
        raise ConfigError(f"the workloads send up to {longest} tokens per request, more than "
                          f"the engine's max_model_len {settings.max_model_len}: raise "
                          "--max-model-len (MAX_MODEL_LEN=) or shorten the workload.")
    models = with_baseline(base, recipes)
    key = cache_key(models, loads, settings, target, reference_dtype)
    path = BenchSummary.path(base.name, key)
    cached = BenchSummary.read(path)
    failed = [n for n, e in cached.models.items() if e.status == "failed"] if cached else []
    if failed and not force:
        log.info(f"the last measurement with these inputs had failures ({', '.join(failed)}); "
                 "measuring again")
    reused = cached is not None and not force and not failed
    if reused:
        assert cached is not None
        log.info(f"unchanged since the last measurement ({path.parent}); reusing it (FORCE=1 "
                 "re-measures).")
        summary = cached
    else:
        summary = _measure_all(base, models, loads, settings, key, target, force, pool,
                               reference_dtype)
    print(format_table(summary, loads))
    if not reused or not tracking.find_run(base.name, STAGE, key):
        log_runs(summary, loads, settings, path.parent)
        log.info(f"recorded in MLflow ({paths.default_tracking_uri()})")
    return summary


def _measure_all(base: baselines.Baseline, models: list[Variant], loads: list[Workload],
                 settings: EngineSettings, key: str, target: str, force: bool,
                 pool: ServerPool | None, reference_dtype: str = "auto") -> BenchSummary:
    records = {m.name: ModelRecord(m) for m in models}
    if not force:
        recall_unsupported(records)

    def groups(ms: list[Variant]) -> list[list[Variant]]:
        return ([ms] if ms else []) if target == "cpu" else [[m] for m in ms]

    out = BenchSummary.path(base.name, key).parent
    # Server logs live outside the temp dir: a failed run's logs stay where errors point.
    logs = out.parent / "logs" / key
    cold, warm = steps_for(loads, caching=False), steps_for(loads, caching=True)
    searches = tuple(w for w in loads if w.slo is not None)
    started = time.monotonic()
    with atomic_dir(out) as tmp, contextlib.ExitStack() as stack:
        # one benchmark client for every pass, importing vLLM while the first servers load
        client = stack.enter_context(BenchClient(
            server_environment(settings, target), logs / "bench-client.log"))
        chosen = choose_reference(models[0], loads, settings, tmp, logs, target,
                                  reference_dtype, force, client)
        dtypes = {BASELINE: chosen["dtype"]} if chosen["dtype"] != settings.dtype else None
        cold_models = [m for m in models if any(s.runs_on(m.name) for s in cold)
                       or any(w.runs_on(m.name) for w in searches)]
        warm_models = [m for m in models if any(s.runs_on(m.name) for s in warm)]
        # on a CPU the second pass's servers (prefix caching on) load with the first's: no
        # start-up after the first pass (~45 s on 2 cores)
        ahead = launch_ahead(warm_models, records, pass_settings(settings, True), logs,
                             pass_label(True), dtypes) if target == "cpu" and cold_models else {}
        stack.callback(lambda: stop_all(list(ahead.values())))
        measure(groups(cold_models), cold, records, settings, tmp, logs, caching=False,
                pool=pool, searches=searches, dtypes=dtypes, client=client)
        measure(groups(warm_models), warm, records, settings, tmp, logs, caching=True,
                dtypes=dtypes, client=client, ahead=ahead)
        summary = BenchSummary(
            baseline=base.name, target=target, key=key,
            measured=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            seconds=round(time.monotonic() - started, 1), engine=settings.model_dump(),
            hardware=hardware.profile().as_dict(),
            devices=hardware.serving_devices(hardware.profile(), settings.tensor_parallel_size,
                                             settings.pipeline_parallel_size),
            speedup_pairing=pairing(target), workloads=[str(w.path) for w in loads],
            reference=chosen,
            headline={w.name: w.headline for w in loads},
            models=summarize(records, loads, target))
        summary.write(tmp / BenchSummary.FILE)
    return summary.as_read()


def run(settings: BenchSettings, pool: ServerPool | None = None) -> BenchSummary:
    """``qpipe bench`` / ``make bench``; a campaign passes its pool."""
    tracking.check_store()  # seconds, before the work: not minutes after it
    loads = [workloads_mod.load(w) for w in settings.workloads]
    if settings.repeats:
        loads = [dataclasses.replace(w, repeats=settings.repeats) for w in loads]
    loads = [workloads_mod.with_objective(w, ttft=settings.slo_ttft_ms, itl=settings.slo_itl_ms)
             for w in loads]
    for w in loads:  # REPEATS= can leave a search too few requests to decide a point
        workloads_mod.check_search(w)
    return bench(baselines.resolve(settings.baseline), list(settings.recipes) or None, loads,
                 settings.engine, settings.force, pool=pool,
                 reference_dtype=settings.reference)
