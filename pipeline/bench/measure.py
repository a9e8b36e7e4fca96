"""The measurement loop: servers up, every step run against every model, failures recorded.

A step is one run of vLLM's client: a workload at one load point and repeat. The models of a
group are measured back to back in each step (on a CPU host every server is up at once, so they
take turns run by run, in a random order per repeat: interleaved). A model that fails (its
engine dies, requests fail, the client times out) is recorded as failed and stopped; the others
go on. A format the engine cannot serve here is recorded as unsupported and remembered at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.bench.client import BenchClient, run_client
from pipeline.bench.slo import PILOT, CapacitySearch, single_request_figures
from pipeline.bench.workloads import AUTO_CEILING, Workload
from pipeline.core import hardware, tracking
from pipeline.core import log as qlog
from pipeline.core.errors import PlanError
from pipeline.core.provenance import vllm_version
from pipeline.core.speedup import undecided
from pipeline.core.variant import BASELINE, Variant
from pipeline.plan import capacity, vllm_kv, wna16_kernels
from pipeline.plan.architecture import parse_architecture
from pipeline.quantize.checkpoint import checkpoint_kv_dtype
from pipeline.serve import (
    EngineSettings,
    ServeError,
    ServerPool,
    TooSlow,
    UnsupportedFormat,
    VllmServer,
    engine_metrics,
    known_refusal,
    remember_refusal,
)
from pipeline.serve.failure import TOO_SLOW
from pipeline.serve.server import (
    WARMUP_TOKENS,
    describe_command,
    server_environment,
    stop_servers,
)

log = qlog.get("bench")
HIT_TOLERANCE = 0.02  # hit rate above what the shared prefix allows (or above 0 in a sweep)
# A variant whose warm request takes this many times the baseline's is not benchmarked. On a
# 2-core Xeon with AMX, vLLM CPU 0.32 served FP8 W8A8 through torch's per-tensor scaled-mm at
# ~0.05 output tok/s (50x slower than that op's row-wise form there): one chat run had not
# ended after 17 min. FP8 on a 2-core AVX-512 EPYC (0.09-0.15x the baseline) passes it.
SLOW_FACTOR = 50.0
PROBE_FLOOR_S = 5.0  # the shortest wait for a variant's probe (a baseline's takes ~0.1 s)


@dataclass
class ModelRecord:
    """Everything measured for one model in one invocation."""

    variant: Variant
    status: str = "ok"  # ok | unsupported (a hardware limit) | failed (anything else)
    reason: str = ""
    log: str = ""  # the server log that says why, for a model that is not ok
    kv: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # what the engine chose and used
    peak_memory_bytes: int = 0
    # workload -> load point -> list of client results (one per repeat)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = field(default_factory=dict)
    # workload -> [queried tokens, hit tokens] of the prefix cache over its measured runs
    prefix_counters: dict[str, list[float]] = field(default_factory=dict)
    # workload -> the capacity search's result (workloads with an slo)
    searches: dict[str, dict[str, Any]] = field(default_factory=dict)
    serve_command: str = ""  # to reproduce by hand (docs/bench.md)


@dataclass(frozen=True)
class Step:
    """One measured run: a workload (under ``key``) at one load point and repeat."""

    workload: Workload
    key: str  # the workload's name; "<name>_nocache" for the caching-off half of a comparison
    repeat: int
    concurrency: int
    caching: bool

    def describe(self) -> str:
        """The step as errors name it: "load point chat at concurrency 4, repeat 2"."""
        return f"load point {self.key} at {self.workload.load_text(self.concurrency)}, " \
            f"repeat {self.repeat + 1}"

    def runs_on(self, model: str) -> bool:
        if self.workload.compare_prefix_caching and not self.caching:
            return self.workload.runs_off(model)
        return self.workload.runs_on(model)


def steps_for(loads: list[Workload], caching: bool) -> list[Step]:
    """Caching off: the speed sweeps (cold, distinct requests) and the caching-off half of
    each prefix comparison; caching on: only the other half of those comparisons."""
    out = []
    for w in loads:
        if caching and not w.compare_prefix_caching:
            continue
        key = f"{w.name}_nocache" if w.compare_prefix_caching and not caching else w.name
        out += [Step(w, key, r, c, caching) for r in range(w.repeats) for c in w.load_points
                if r < w.repeats_at(c)]
    return out


def recall_unsupported(records: dict[str, ModelRecord]) -> None:
    """Skip the minute-long failed start of a checkpoint this vLLM already refused here."""
    for record in records.values():
        reason = known_refusal(record.variant.identity)
        if reason:
            record.status, record.reason = "unsupported", reason
            log.info(f"{record.variant.name}: vLLM {vllm_version()} refused it here before "
                     f"({reason}); not retried (FORCE=1 retries)")


def failed(record: ModelRecord, err: ServeError, log_path: Path) -> None:
    """Record one model's failure; the other models go on being measured."""
    if isinstance(err, UnsupportedFormat):
        record.status, record.reason = "unsupported", err.reason
        remember_refusal(record.variant.identity, err.reason)  # now, not at the end of the run
        log.info(f"{record.variant.name}: unsupported here: {err}")
    else:
        record.status, record.reason = "failed", err.reason
        log.warning(f"{record.variant.name}: FAILED, the other models go on: {err}")
    record.log = str(log_path)


def _own_settings(model: Variant, settings: EngineSettings,
                  dtypes: dict[str, str] | None) -> EngineSettings:
    return settings.model_copy(update={"dtype": (dtypes or {}).get(model.name, settings.dtype)})


def _new_server(model: Variant, settings: EngineSettings, logs: Path, label: str,
                dtypes: dict[str, str] | None) -> VllmServer:
    return VllmServer(model.path, model.served_name, _own_settings(model, settings, dtypes),
                      logs / f"server-{model.name}-{label}.log")


def launch_ahead(models: list[Variant], records: dict[str, ModelRecord],
                 settings: EngineSettings, logs: Path, label: str,
                 dtypes: dict[str, str] | None = None) -> dict[str, VllmServer]:
    """Launch, without waiting, the servers a later pass will use (:func:`servers` takes
    them): on a CPU they load with the first pass's instead of after it. The caller stops
    them (a pass that takes one stops it too)."""
    ahead = {}
    for model in models:
        if records[model.name].status == "ok":
            log.info(f"starting vLLM for {model.name} ({label}, for later) ...")
            ahead[model.name] = _new_server(model, settings, logs, label, dtypes)
            ahead[model.name].launch()
    return ahead


@contextlib.contextmanager
def servers(models: list[Variant], records: dict[str, ModelRecord], settings: EngineSettings,
            logs: Path, label: str, pool: ServerPool | None = None,
            dtypes: dict[str, str] | None = None,
            ahead: dict[str, VllmServer] | None = None) -> Iterator[dict[str, VllmServer]]:
    """A server per model; an unsupported format is recorded, not fatal. With a ``pool``, a
    server it holds is reused and a new one is left running in it for the next stage.
    ``dtypes``: a model served in another ``--dtype`` than the engine's (the reference);
    ``ahead``: servers already launched for these models (:func:`launch_ahead`)."""
    with contextlib.ExitStack() as stack:
        live, starting, own = {}, [], []
        stack.callback(stop_all, own, pool)
        for model in models:  # launched together: on CPUs their loading overlaps
            record = records[model.name]
            if record.status != "ok":
                continue
            server = (ahead or {}).pop(model.name, None)
            if server is None and pool is not None:
                server = pool.get(model.path, model.served_name,
                                  _own_settings(model, settings, dtypes))
                if server is not None:
                    log.info(f"{model.name}: reusing the running vLLM server "
                             f"({server.base_url})")
            elif server is not None:
                own.append(server)
            if server is None:
                log.info(f"starting vLLM for {model.name} ({label}) ...")
                server = _new_server(model, settings, logs, label, dtypes)
                server.launch()
                own.append(server)
            if not record.serve_command:  # the speed sweep's server (caching off)
                record.serve_command = describe_command(server)
            starting.append((model, server))
        started = time.monotonic()
        for model, server in starting:
            try:
                server.wait_ready()
            except ServeError as err:
                failed(records[model.name], err, server.log_path)
                continue
            live[model.name] = server
            if pool is not None:
                pool.keep(server)
            log.info(f"{model.name} is up after {time.monotonic() - started:.0f} s "
                     f"({server.base_url})")
        try:
            yield live
        finally:
            for name, server in live.items():
                records[name].peak_memory_bytes = max(records[name].peak_memory_bytes,
                                                      server.peak_memory_bytes)


def stop_all(servers: list[VllmServer], pool: ServerPool | None = None) -> None:
    """Stop those the pool does not keep, all shutting down at once."""
    stop_servers([s for s in servers if pool is None or not pool.holds(s)])


def kv_dtype(settings: EngineSettings, config: dict[str, Any] | None = None) -> str:
    """The KV-cache dtype the engine uses: ``--kv-cache-dtype`` (through VLLM_ARGS) if given,
    else the checkpoint's ``kv_cache_scheme`` (vLLM honours it when the flag is "auto")."""
    args = list(settings.extra_args)
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--kv-cache-dtype=") else (
            args[i + 1] if arg == "--kv-cache-dtype" and i + 1 < len(args) else None)
        if value is not None and value != "auto":
            return "fp8" if value.startswith("fp8") else "bf16"
    return checkpoint_kv_dtype(config or {}) or "bf16"


def record_engine(record: ModelRecord, server: VllmServer, settings: EngineSettings) -> None:
    """What the engine chose (kernels, scheme, weight memory) and its KV cache, beside the
    planner's prediction for the budget the engine really used: its own figure (CPU), its log's
    "Available KV cache memory" (GPU; ``kv_cache_memory_bytes`` is not exported there unless
    set), else the CPU setting. With no known budget there is no prediction to compare."""
    engine_log = engine_metrics.read_log(server.log_text())
    tp, pp = settings.tensor_parallel_size, settings.pipeline_parallel_size
    record.engine = {"scheme": engine_log.scheme, "kernels": list(engine_log.kernels),
                     "fp8_weight_only": engine_log.fp8_weight_only,
                     "enforce_eager": server.settings.enforce_eager, "devices": tp * pp}
    if engine_log.weight_memory_bytes:
        # "Model loading took" is one worker's: each of the TP x PP devices holds its share
        per_device = engine_log.weight_memory_bytes
        record.engine[tracking.ENGINE_WEIGHT_MEMORY_BYTES] = per_device * tp * pp
        record.engine["engine_weight_memory_bytes_per_device"] = per_device
    config = json.loads((record.variant.path / "config.json").read_text())
    try:
        if server.target == "cuda" and "WNA16" in engine_log.schemes:
            _wna16_kernels(record, engine_log, config, tp)
        _record_kv(record, server, settings, engine_log, config)
    except PlanError as err:  # one model the planner cannot plan is a note, not the bench's end
        record.engine["plan_note"] = f"not planned, so not checked against the engine: {err}"


PLAN_AGREES = (0.9, 1.1)  # engine / planned KV figures within this: the planner agrees


def _record_kv(record: ModelRecord, server: VllmServer, settings: EngineSettings,
               engine_log: engine_metrics.EngineLog, config: dict[str, Any]) -> None:
    """The engine's KV cache and the planner's figure for the budget it used."""
    info = engine_metrics.kv_cache_info(
        engine_metrics.parse(server.metrics_text("the KV-cache read-out (/metrics)")),
        server.log_text())
    if info is None:
        return
    cache_dtype = record.engine["kv_cache_dtype"] = kv_dtype(settings, config)
    record.kv = {tracking.KV_CACHE_TOKENS: info.kv_cache_tokens,
                 tracking.MAX_CONCURRENCY: info.max_concurrency,
                 "kv_block_size": info.block_size, "kv_num_blocks": info.num_blocks}
    if info.kv_cache_memory_bytes:
        budget, source = info.kv_cache_memory_bytes, "engine metrics"
    elif engine_log.kv_cache_memory_bytes:
        budget, source = engine_log.kv_cache_memory_bytes, "engine log (0.01 GiB)"
    elif server.target == "cpu":
        budget, source = int(settings.kv_cache_space_gib * 2**30), "VLLM_CPU_KVCACHE_SPACE"
    else:
        record.engine["kv_budget_source"] = "unknown: no planned figure to compare"
        return
    record.engine["kv_budget_source"] = source
    record.kv[tracking.KV_CACHE_MEMORY_BYTES] = budget
    # the budget is one worker's, and each worker holds its share of every token's KV cache
    # (its KV heads, its layers): the whole cache is the budget over that share, as make plan
    # counts it
    if server.target == "cpu":  # torch's own check of the CPU, not a forced kernel library
        config = vllm_kv.served_on_cpu(
            config, "avx512_bf16" in hardware.profile().cpu_flags)
    arch = parse_architecture(config)
    shards = arch.kv_shards(settings.tensor_parallel_size, settings.pipeline_parallel_size)
    alignment = 128 if server.target == "cpu" else 16
    planned = capacity.predict_vllm_kv_cache(
        config, budget * shards,
        # a hybrid's block is vLLM's alignment raised to hold a state (the planner raises
        # it as vLLM does); the block size /metrics reports for one is not that alignment
        block_size=alignment if arch.state_layers else info.block_size or alignment,
        kv_dtype=cache_dtype, max_model_len=settings.max_model_len,
        prefix_caching=bool(settings.enable_prefix_caching))
    ratios = {
        tracking.KV_CACHE_TOKENS_VS_PLANNED: info.kv_cache_tokens / planned.kv_cache_tokens,
        tracking.MAX_CONCURRENCY_VS_PLANNED: info.max_concurrency / planned.max_concurrency,
    }
    off = {name: r for name, r in ratios.items() if not PLAN_AGREES[0] <= r <= PLAN_AGREES[1]}
    record.kv.update({capacity.KV_CACHE_TOKENS: planned.kv_cache_tokens,
                      capacity.VLLM_MAX_CONCURRENCY: planned.max_concurrency, **ratios,
                      tracking.KV_PLAN_OFF: float(bool(off))})
    if off:
        record.engine["plan_check"] = (
            "the planner disagrees with the engine: " + ", ".join(
                f"{name.replace('_vs_planned', '').replace('_', ' ')} {r:.2f}x the planned"
                for name, r in off.items())
            + f" (outside [{PLAN_AGREES[0]}, {PLAN_AGREES[1]}]); its memory plan and the "
            "device counts from it are not to be trusted for this model")


def _wna16_kernels(record: ModelRecord, engine_log: engine_metrics.EngineLog,
                   config: dict[str, Any], tp: int) -> None:
    """Which kernel each layer group ran on (vLLM's rules on this card), checked against the
    kernels its log names."""
    gpus = hardware.profile().gpus
    chosen = wna16_kernels.by_layer(config, gpus[0].compute_capability if gpus else "", tp)
    if not chosen:
        return
    logged = {k.split(" for ")[0] for k in engine_log.kernels if k.endswith("WNA16")}
    predicted = set(chosen.values())
    record.engine["kernels_by_layer"] = chosen
    record.engine["kernels_by_layer_text"] = wna16_kernels.describe(chosen) + (
        " (vLLM's kernel rules on this card's layer shapes; its log names the same kernels)"
        if predicted == logged else
        f" (vLLM's kernel rules; its log names {', '.join(sorted(logged)) or 'none'}: the "
        "rules here are not vLLM's for this version)")


def pass_label(caching: bool) -> str:
    return "cache-on" if caching else "cache-off"


def pass_settings(settings: EngineSettings, caching: bool) -> EngineSettings:
    return settings.model_copy(update={"enable_prefix_caching": caching})


def measure(groups: list[list[Variant]], steps: list[Step], records: dict[str, ModelRecord],
            settings: EngineSettings, out: Path, logs: Path, caching: bool,
            pool: ServerPool | None = None, searches: tuple[Workload, ...] = (),
            dtypes: dict[str, str] | None = None, client: BenchClient | None = None,
            ahead: dict[str, VllmServer] | None = None) -> None:
    """Every step, the models of a group back to back (interleaved); then each capacity
    search (``searches``: workloads with an slo), the models' runs interleaved too.
    ``client``: vLLM's benchmark client to use (one is started otherwise, while the servers
    load); ``ahead``: servers launched earlier for this pass (:func:`launch_ahead`)."""
    label = pass_label(caching)
    run_settings = pass_settings(settings, caching)
    derived: dict[str, Workload] = {}  # ``auto`` settings derived once, for every group
    if not any(groups) or not (steps or searches):
        return
    with contextlib.ExitStack() as stack:
        if client is None:
            client = stack.enter_context(BenchClient(
                server_environment(run_settings, hardware.serve_target()),
                logs / "bench-client.log"))
        for group in groups:
            with servers(group, records, run_settings, logs, label, pool, dtypes,
                         ahead) as live:
                if not live:
                    continue
                for name, server in list(live.items()):
                    if not records[name].kv:
                        try:
                            record_engine(records[name], server, run_settings)
                        except ServeError as err:
                            _drop(live, name, records, err, pool)
                if not caching:
                    drop_too_slow(live, records, pool)
                for i, step in enumerate(steps, start=1):
                    _run_step(client, live, records, step, out, pool, f"{i}/{len(steps)}",
                              list(live))
                if not caching:
                    _repeat_undecided(client, live, records, steps, out, pool)
                for workload in searches:
                    search_capacity(client, live, records, workload, out / "runs", pool,
                                    derived)


def drop_too_slow(live: dict[str, VllmServer], records: dict[str, ModelRecord],
                  pool: ServerPool | None) -> None:
    """Time the warm-up request once more on every server, now that all are up (the
    baseline's twice, the faster kept), and drop each variant over :data:`SLOW_FACTOR` times
    the baseline's *and* over :data:`PROBE_FLOOR_S` as :class:`TooSlow`: it is remembered like
    a missing kernel, so eval scores it emulated and the report says "too slow here", instead
    of a sweep that runs for hours. A variant's probe is abandoned at that limit; one over it
    is probed once more (the faster kept, as for the baseline), so a single request slowed by
    a busy host drops nothing, and neither does a large ratio of two tiny timings (a tiny
    model's baseline answers in ~0.01 s)."""
    if BASELINE not in live or len(live) < 2:
        return
    server = live[BASELINE]
    try:
        timings = [server.probe(server.warmup_timeout) for _ in range(2)]
    except ServeError as err:
        _drop(live, BASELINE, records, err, pool)
        return
    if None in timings:  # the baseline itself barely answers: its runs will say so
        return
    base = min(t for t in timings if t is not None)
    waited = max(PROBE_FLOOR_S, SLOW_FACTOR * base)
    log.info(f"probe: the baseline answers a warm request of {WARMUP_TOKENS} tokens in "
             f"{base:.2f} s; a variant over {waited:.1f} s twice is too slow here")
    for name in [n for n in live if n != BASELINE]:
        try:
            took = _probe_twice(live[name], waited)
        except ServeError as err:
            _drop(live, name, records, err, pool)
            continue
        log.info(f"probe: {name} " + (f"{took:.2f} s" if took is not None else
                                      f"no answer within {waited:.1f} s"))
        if took is not None:
            continue
        how = f"gave no answer within {waited:.1f} s, twice (abandoned)"
        kernels = ", ".join(records[name].engine.get("kernels") or []) or "kernels not logged"
        _drop(live, name, records, TooSlow(
            f"{name}: one warm request of {WARMUP_TOKENS} tokens {how}, the baseline's "
            f"{base:.2f} s: not benchmarked", reason=(
                f"{TOO_SLOW}: vLLM serves it ({kernels}), but one warm request of "
                f"{WARMUP_TOKENS} tokens {how} against the baseline's {base:.2f} s, "
                f"over {waited / base:,.0f}x slower (the limit is {SLOW_FACTOR:g}x and "
                f"{PROBE_FLOOR_S:g} s): a sweep would take hours, so it is not benchmarked "
                "(FORCE=1 probes it again)")), pool)


def _probe_twice(server: VllmServer, limit: float) -> float | None:
    """The warm request's seconds within ``limit``, a second try when the first was over it;
    None when neither answered in time."""
    for _ in range(2):
        took = server.probe(limit)
        if took is not None and took <= limit:
            return took
    return None


def _run_step(client: BenchClient, live: dict[str, VllmServer], records: dict[str, ModelRecord],
              step: Step, out: Path, pool: ServerPool | None, progress: str,
              names: list[str]) -> None:
    """One step for ``names``, in :func:`run_order`."""
    for name in run_order(names, step.repeat):
        if name not in live or not step.runs_on(name):
            continue
        log.info(f"{progress} {name}: {step.key} concurrency {step.concurrency} repeat "
                 f"{step.repeat + 1}")
        try:
            _load_point(client, live[name], records[name], step, out / "runs")
        except ServeError as err:
            _drop(live, name, records, err, pool)


def run_order(names: list[str], repeat: int) -> list[str]:
    """The order of one repeat's runs: a random permutation, drawn from ``repeat`` alone (the
    same in every bench, so that a run can be redone).

    This host's speed drifts: a run's speed correlates 0.66-0.68 with the next run's, 0.4-0.5
    with the one after (three make all runs, 2026-12-03). With the baseline first and the order
    reversed every other repeat (the rule until then), the baseline's runs of two repeats sat
    side by side (B v | v B), successive ratios correlated, and the t interval was too narrow:
    a false "slower" 7.3% against its 5% on that drift (simulated). In a random order the
    baseline and a variant are exchangeable, so successive ratios are uncorrelated on average
    and neither side runs first more often (``make calibrate``'s drifting-host rows)."""
    order = list(names)
    random.Random(repeat).shuffle(order)
    return order


def speed_ratios(runs: list[dict[str, Any]], base_runs: list[dict[str, Any]]) -> list[float]:
    """Per repeat, the variant's output throughput over the baseline's run of the same prompts
    (repeat r of each: a variant that stopped early pairs with the baseline's first runs)."""
    return [v["output_throughput"] / b["output_throughput"]
            for v, b in zip(runs, base_runs, strict=False)
            if v.get("output_throughput") and b.get("output_throughput")]


def _repeat_undecided(client: BenchClient, live: dict[str, VllmServer],
                      records: dict[str, ModelRecord], steps: list[Step], out: Path,
                      pool: ServerPool | None) -> None:
    """Past the fixed repeats, each speed sweep's headline load point is repeated for the
    baseline and the variants whose speedup there is still undecided (or faster, but not yet
    after Holm's correction over the variants), up to the workload's cap (the sequential rule
    of :mod:`pipeline.core.speedup`: stopping when decided keeps its error rate)."""
    points: dict[tuple[str, int], Step] = {}
    for step in steps:
        if step.workload.slo is None and not step.caching and \
                step.concurrency == step.workload.headline:
            points[(step.key, step.concurrency)] = step
    for (key, concurrency), last in points.items():
        looks = last.workload.looks("cpu", concurrency)
        cap = max(last.workload.repeats, last.workload.max_repeats)
        repeat = last.repeat + 1
        while repeat < cap and BASELINE in live:
            base = records[BASELINE].runs.get(key, {}).get(concurrency, [])
            ratios = {name: speed_ratios(records[name].runs.get(key, {}).get(concurrency, []),
                                         base)
                      for name in live if name != BASELINE and last.runs_on(name)}
            pending = undecided(ratios, looks)
            if not pending:
                break
            step = Step(last.workload, key, repeat, concurrency, caching=False)
            _run_step(client, live, records, step, out, pool,
                      f"undecided ({', '.join(pending)}):", [BASELINE, *pending])
            repeat += 1


def search_capacity(client: BenchClient, live: dict[str, VllmServer],
                    records: dict[str, ModelRecord], workload: Workload, out: Path,
                    pool: ServerPool | None = None,
                    derived: dict[str, Workload] | None = None) -> None:
    """Each live model's capacity at the workload's objective, one run per model in turn.
    What is ``auto`` is derived first from the baseline's single-request run (:func:`derive`);
    an ``auto`` ceiling is what each model's KV cache holds of the workload's longest requests.
    ``derived``: the workloads derived so far (the baseline's group runs first), by name."""
    derived = {} if derived is None else derived
    assert workload.slo is not None
    if workload.needs_probe and workload.name in derived:  # derived with an earlier group
        workload = derived[workload.name]
    elif workload.needs_probe:
        if BASELINE not in live:
            log.warning(f"{workload.name}: its objective is derived from the baseline, which is "
                        "not being served: no capacity search")
            return
        # one user at a time, whatever the search varies: the single-request figures
        single = dataclasses.replace(workload, search_by="concurrency")
        probe = Step(single, f"{workload.name}_objective", workload.repeats, 1, caching=False)
        try:
            result = _load_point(client, live[BASELINE], records[BASELINE], probe, out)
        except ServeError as err:
            _drop(live, BASELINE, records, err, pool)
            return
        workload = derived[workload.name] = derive(workload, result)
        assert workload.slo is not None
        log.info(f"{workload.name}: the objective is {workload.slo.describe()}"
                 + (f": {workload.slo.basis}" if workload.slo.basis else "")
                 + (f"; rates from {workload.rate_start:g} req/s" if workload.by_rate else ""))
    assert workload.slo is not None
    searches = {name: CapacitySearch(ceiling_for(workload, records[name]), workload.slo.target,
                                     workload.repeats,
                                     bracket_step=workload.doubling if workload.by_rate else 0,
                                     pilot=workload.search_pilot)
                for name in live if workload.runs_on(name)}
    unit = "arrival rate" if workload.by_rate else "concurrency"
    log.info(f"{workload.name}: searching each model's highest {unit} with "
             f"{workload.slo.describe()} (up to "
             + ", ".join(f"{n} {workload.load_text(s.ceiling)}" for n, s in searches.items())
             + f"; each point up to {workload.repeats} runs)")
    progressed = True
    while progressed:
        progressed = False
        for name, search in searches.items():
            run = search.next_run() if name in live else None
            if run is None:
                continue
            progressed = True
            concurrency, repeat = run
            sent = workload.pilot_run() if search.is_pilot(concurrency, repeat) \
                else workload
            step = Step(sent, workload.name, repeat, concurrency, caching=False)
            try:
                result = _load_point(client, live[name], records[name], step, out)
            except ServeError as err:
                _drop(live, name, records, err, pool)
                continue
            result[PILOT] = sent is not workload
            # a closed loop's start-up wave is not counted; Poisson arrivals are not a wave
            good, counted = workload.slo.attainment(result, skip_start=not workload.by_rate)
            search.record(concurrency, good, counted)
            point = search.points[concurrency]
            kind = "pilot run" if result[PILOT] else "run"
            log.info(f"{name}: {workload.name} {workload.load_text(concurrency)} {kind} "
                     f"{repeat + 1}: {good}/{counted} within the objective ({point.good}/"
                     f"{point.counted} over its full runs)")
    for name, search in searches.items():
        if name in live:
            rates = {"rate_start": workload.rate_start, "rate_ceiling": workload.rate_ceiling} \
                if workload.by_rate else {}  # as derived: the levels' rates
            found = records[name].searches[workload.name] = {
                **search.result(), "slo": workload.slo.model_dump(), **rates,
                "ceiling_from": "the KV cache" if not (workload.search_ceiling or workload.by_rate)
                else "the workload"}
            if workload.by_rate:  # the rate at the knee, as the table and exports give it
                at, *interval = (workload.rate(v) for v in workload.rate_levels(found))
                point = f"{at:.3g} req/s"
                ends = [f"{v:.3g} req/s" if v is not None else "unbounded" for v in interval]
            else:
                point = workload.load_text(found["capacity"])
                ends = [workload.load_text(v) if v is not None else "unbounded"
                        for v in (found["capacity_low"], found["capacity_high"])]
            log.info(f"{name}: {workload.slo.describe()}: {found['outcome']}, capacity "
                     f"{point} ({found['level']:.0%} interval {ends[0]} to {ends[1]})")


def derive(workload: Workload, result: dict[str, Any]) -> Workload:
    """The workload with its ``auto`` bounds and ``auto`` first rate set from the baseline's
    single-request run ``result``: the rate search starts at half of what one user at a time
    sends (1 / the median request latency), so the first level is met where anything is."""
    assert workload.slo is not None
    out = dataclasses.replace(workload, slo=workload.slo.derived(result, "the baseline"))
    if workload.by_rate and not workload.rate_start:
        serial = 1 / single_request_figures(result)["e2el"] * 1000
        start = float(f"{serial / 2:.2g}")
        out = dataclasses.replace(out, rate_start=start,
                                  rate_ceiling=max(out.rate_ceiling, 64 * start))
    return out


def ceiling_for(workload: Workload, record: ModelRecord) -> int:
    """The search's ceiling: the workload's, or (``auto``) the requests of its longest length
    that this model's KV cache holds at once, at most AUTO_CEILING (32 where unknown); a rate
    search's highest level (``rate_ceiling``)."""
    if workload.by_rate:
        return workload.levels
    if workload.search_ceiling:
        return workload.search_ceiling
    held = requests_held(record.kv, workload.max_tokens_per_request)
    return max(1, min(AUTO_CEILING, held)) if held is not None else 32


def requests_held(kv: dict[str, Any], tokens_per_request: int) -> int | None:
    """How many requests of ``tokens_per_request`` tokens the engine's KV cache (``kv``, as
    :func:`record_engine` keeps it) holds at once, each in whole blocks; None when the engine
    reported none."""
    block = int(kv.get("kv_block_size") or 1)
    tokens = int(kv.get(tracking.KV_CACHE_TOKENS) or 0)
    return tokens // (-(-tokens_per_request // block) * block) if tokens else None


def _drop(live: dict[str, VllmServer], name: str, records: dict[str, ModelRecord],
          err: ServeError, pool: ServerPool | None) -> None:
    server = live.pop(name)
    failed(records[name], err, server.log_path)
    records[name].peak_memory_bytes = max(records[name].peak_memory_bytes,
                                          server.peak_memory_bytes)
    if pool is not None:
        pool.discard(server)
    else:
        server.stop()


def _load_point(client: BenchClient, server: VllmServer, record: ModelRecord, step: Step,
                out: Path) -> dict[str, Any]:
    """One run; its prefix-cache counters are checked: a speed sweep must have no hit, and a
    prefix comparison no hit beyond its shared prefix (else the figure is not what it says).
    The engine's preemptions over the run are added to the result (a full KV cache)."""
    point = step.describe()
    samples = engine_metrics.parse(server.metrics_text(f"the /metrics scrape before {point}"))
    before = engine_metrics.prefix_cache_counters(samples)
    preempted = engine_metrics.preemptions(samples)
    name = record.variant.name
    result = run_client(client, server, record.variant, step.workload, step.concurrency, out,
                        f"{name}-{step.key}-c{step.concurrency}-r{step.repeat}", step.repeat,
                        phase=point)
    samples = engine_metrics.parse(server.metrics_text(f"the /metrics scrape after {point}"))
    after = engine_metrics.prefix_cache_counters(samples)
    result[tracking.PREEMPTIONS] = engine_metrics.preemptions(samples) - preempted
    queries, hits = after[0] - before[0], after[1] - before[1]
    rate = hits / queries if queries else 0.0
    expected = step.workload.expected_prefix_hit_rate(
        int(record.kv.get("kv_block_size") or 0), step.concurrency) if step.caching else 0.0
    if hits > 0 and rate > expected + HIT_TOLERANCE:
        what = ("a cold speed sweep must have none" if not step.caching else
                f"the shared prefix allows at most {expected:.1%}")
        raise ServeError(f"{name}: {step.key} at concurrency {step.concurrency} hit the prefix "
                         f"cache for {rate:.1%} of its prompt tokens; {what}. Its figures would "
                         "mix warm and cold requests, so none are kept.",
                         reason=f"prefix-cache hits {rate:.1%} in {step.key} (allowed "
                                f"{expected:.1%})")
    record.runs.setdefault(step.key, {}).setdefault(step.concurrency, []).append(result)
    counters = record.prefix_counters.setdefault(step.key, [0.0, 0.0])
    counters[0] += queries
    counters[1] += hits
    return result
