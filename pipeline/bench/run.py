"""Serve the baseline and its variants through vLLM and load-test them with vLLM's own client.

For each workload, repeat and load point the models are measured back to back (interleaved),
so that the machine's drift cancels out of the speedup. On a CPU machine all servers stay up
at once (memory allows it, and a restart costs ~30 s); on a GPU each model gets the device to
itself in turn. Results of an unchanged invocation are reused (``--force`` re-measures).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import select
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipeline.bench import workloads as workloads_mod
from pipeline.bench.workloads import Workload
from pipeline.core import hardware, paths, tracking
from pipeline.core.errors import ConfigError
from pipeline.core.fsutil import atomic_dir, read_json
from pipeline.plan import capacity
from pipeline.quantize import baseline as baselines
from pipeline.quantize import checkpoint
from pipeline.serve import engine_metrics
from pipeline.serve.server import (
    WORKERS_DIR,
    EngineSettings,
    ServeError,
    ServerPool,
    UnsupportedFormat,
    VllmServer,
    add_engine_arguments,
    engine_settings_from,
    known_refusal,
    remember_refusal,
    serve_python,
    vllm_version,
)

STAGE = "bench"
# Every load point is logged as a step (step = concurrency) under "sweep.<metric>"; the plain
# name holds the headline load point's figure (MLflow shows a metric's highest step as its
# value, so the two cannot share a name).
SWEEP = "sweep."
BASELINE_RECIPE = "none"
CLIENT_TIMEOUT_S = 1800
# Which hardware serves a format that this machine's engine rejected.
SERVED_ON = {
    "mxfp4-pack-quantized": "NVIDIA Blackwell GPUs (native MXFP4); Hopper through vLLM's "
                            "Marlin/emulation kernels",
    "nvfp4-pack-quantized": "NVIDIA Blackwell GPUs (native NVFP4); Hopper/Ada through Marlin",
    "float-quantized": "GPUs with FP8 support (Ada, Hopper, Blackwell)",
}
# vllm bench serve result key -> qpipe metric name.
CLIENT_METRICS = {
    "output_throughput": tracking.OUTPUT_TOKENS_PER_S,
    "request_throughput": tracking.REQUESTS_PER_S,
    "median_ttft_ms": tracking.TTFT_MS_P50,
    "p99_ttft_ms": tracking.TTFT_MS_P99,
    "median_itl_ms": tracking.ITL_MS_P50,
    "p99_itl_ms": tracking.ITL_MS_P99,
    "median_e2el_ms": tracking.E2E_MS_P50,
}


@dataclass(frozen=True)
class Model:
    recipe: str  # "none" for the baseline
    path: Path
    identity: str
    format: str

    @property
    def name(self) -> str:
        return "baseline" if self.recipe == BASELINE_RECIPE else self.recipe


def models_for(base: baselines.Baseline, recipes: list[str] | None) -> list[Model]:
    """The baseline first, then the requested variants (default: every variant on disk)."""
    return [Model(BASELINE_RECIPE, base.path, base.identity, "dense"), *(
        Model(name, paths.variant_dir(base.name, name), m["cache_key"], m["format"])
        for name, m in checkpoint.variant_manifests(base.name, recipes).items())]


# --- one load point -----------------------------------------------------------------------
class BenchClient:
    """vLLM's benchmark client, kept loaded in one process of the serving environment.

    Each :meth:`run` is exactly ``vllm bench serve ARGS`` (vLLM's own parser and ``main``);
    only the import of vLLM is shared between runs.
    """

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[str] | None = None
        self._start()

    def _start(self) -> None:
        with self.log.open("ab") as stderr:
            self.proc = subprocess.Popen(
                [str(serve_python()), str(WORKERS_DIR / "vllm_bench_worker.py")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                env=self.env, start_new_session=True)
        self._answer(timeout=300)  # {"ready": true} once vLLM is imported

    def __enter__(self) -> BenchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()

    def _answer(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            self.close()  # a client that hangs or died is replaced before the next run
            raise ServeError("vLLM's benchmark client " + (
                f"exited (code {code})" if code is not None else f"gave no answer in {timeout} s")
                + f"; see {self.log}.")
        return json.loads(line)

    def run(self, argv: list[str], log: Path, timeout: float = CLIENT_TIMEOUT_S) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(timeout)
        if not answer.get("ok"):
            raise ServeError(f"vllm bench serve failed: {answer.get('error')}. Log: {log}")


def client_argv(server: VllmServer, model: Model, workload: Workload, concurrency: int,
                out_dir: Path, tag: str, repeat: int = 0) -> list[str]:
    """The ``vllm bench serve`` arguments for one load point (README: reproduce by hand)."""
    return ["--backend", "vllm", "--base-url", server.base_url, "--endpoint", "/v1/completions",
            "--model", server.served_name, "--tokenizer", str(model.path),
            *workload.client_args(concurrency, repeat), "--save-result", "--result-dir",
            str(out_dir), "--result-filename", f"{tag}.json", "--disable-tqdm"]


def run_client(client: BenchClient, server: VllmServer, model: Model, workload: Workload,
               concurrency: int, out_dir: Path, tag: str, repeat: int = 0) -> dict[str, Any]:
    """One load point against ``server``; returns vLLM's saved result JSON."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / f"{tag}.log"
    try:
        client.run(client_argv(server, model, workload, concurrency, out_dir, tag, repeat), log)
    except ServeError:
        server.check_alive()  # a dead server is the better explanation
        raise
    server.check_alive()
    result = read_json(out_dir / f"{tag}.json")
    if result.get("failed"):
        raise ServeError(f"{result['failed']} of {result['num_prompts']} requests to "
                         f"{model.name} failed. Client log: {log}; server log: "
                         f"{server.log_path}",
                         reason=f"{result['failed']} of {result['num_prompts']} requests failed")
    return result


# --- the invocation -----------------------------------------------------------------------
@dataclass
class ModelRecord:
    """Everything measured for one model in one invocation."""

    model: Model
    status: str = "ok"  # ok | unsupported (a hardware limit) | failed (anything else)
    reason: str = ""
    log: str = ""  # the server log that says why, for a model that is not ok
    kv: dict[str, Any] = dataclasses.field(default_factory=dict)
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the engine chose
    peak_memory_bytes: int = 0
    # workload -> load point -> list of client results (one per repeat)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = dataclasses.field(default_factory=dict)
    # workload -> [queried tokens, hit tokens] of the prefix cache over its measured runs
    prefix_counters: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    serve_command: str = ""  # to reproduce by hand (README)


def _cache_key(models: list[Model], loads: list[Workload], settings: EngineSettings,
               target: str) -> str:
    payload = {"models": [(m.recipe, m.identity) for m in models],
               "workloads": [{**dataclasses.asdict(w), "path": w.name} for w in loads],
               "engine": dataclasses.asdict(settings),
               "target": target, "vllm": vllm_version(), "hardware": hardware.profile().key()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _recall_unsupported(records: dict[str, ModelRecord]) -> None:
    """Skip the minute-long failed start of a checkpoint this vLLM already refused here."""
    for record in records.values():
        reason = known_refusal(record.model.identity)
        if reason:
            record.status, record.reason = "unsupported", reason
            print(f"[bench] {record.model.name}: vLLM {vllm_version()} refused it here before "
                  f"({reason}); not retried (FORCE=1 retries)", flush=True)


def _failed(record: ModelRecord, err: ServeError, log: Path) -> None:
    """Record one model's failure; the other models go on being measured."""
    if isinstance(err, UnsupportedFormat):
        record.status, record.reason = "unsupported", err.reason
        remember_refusal(record.model.identity, err.reason)  # now, not at the end of the run
        print(f"[bench] {record.model.name}: unsupported here: {err}", flush=True)
    else:
        record.status, record.reason = "failed", err.reason
        print(f"[bench] {record.model.name}: FAILED, the other models go on: {err}", flush=True)
    record.log = str(log)


@contextlib.contextmanager
def _servers(models: list[Model], records: dict[str, ModelRecord], settings: EngineSettings,
             logs: Path, label: str, pool: ServerPool | None = None
             ) -> Iterator[dict[str, VllmServer]]:
    """A server per model; an unsupported format is recorded, not fatal. With a ``pool``, a
    server it holds is reused and a new one is left running in it for the next stage."""
    with contextlib.ExitStack() as stack:
        live, starting = {}, []
        for model in models:  # launched together: on CPUs their loading overlaps
            record = records[model.name]
            if record.status != "ok":
                continue
            server = pool.get(model.path, model.name, settings) if pool else None
            if server is None:
                print(f"[bench] starting vLLM for {model.name} ({label}) ...", flush=True)
                server = VllmServer(model.path, model.name, settings,
                                    logs / f"server-{model.name}-{label}.log")
                server.launch()
                stack.callback(_stop_unless_kept, server, pool)
            else:
                print(f"[bench] {model.name}: reusing the running vLLM server "
                      f"({server.base_url})", flush=True)
            if not record.serve_command:  # the speed sweep's server (caching off)
                cpu_env = [f"{k}={v}" for k, v in server.environment().items()
                           if k.startswith(("VLLM_CPU", hardware.ISA_ENV))]
                record.serve_command = shlex.join([*cpu_env, *server.command()])
            starting.append((model, server))
        started = time.monotonic()
        for model, server in starting:
            try:
                server.wait_ready()
            except ServeError as err:
                _failed(records[model.name], err, server.log_path)
                continue
            live[model.name] = server
            if pool is not None:
                pool.keep(server)
            print(f"[bench] {model.name} is up after {time.monotonic() - started:.0f} s "
                  f"({server.base_url})", flush=True)
        try:
            yield live
        finally:
            for name, server in live.items():
                records[name].peak_memory_bytes = max(records[name].peak_memory_bytes,
                                                      server.peak_memory_bytes)


def _stop_unless_kept(server: VllmServer, pool: ServerPool | None) -> None:
    if pool is None or not pool.holds(server):
        server.stop()


def _kv_dtype(settings: EngineSettings) -> str:
    """The KV-cache dtype the engine was asked for (``--kv-cache-dtype`` through VLLM_ARGS)."""
    args = list(settings.extra_args)
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--kv-cache-dtype=") else (
            args[i + 1] if arg == "--kv-cache-dtype" and i + 1 < len(args) else None)
        if value is not None:
            return "fp8" if value.startswith("fp8") else "bf16"
    return "bf16"


def _record_kv(record: ModelRecord, server: VllmServer, settings: EngineSettings) -> None:
    """What the engine chose (kernels, scheme, weight memory) and its KV cache, beside the
    planner's prediction for the budget the engine really used: its own figure (CPU), its log's
    "Available KV cache memory" (GPU; ``kv_cache_memory_bytes`` is not exported there unless
    set), else the CPU setting. With no known budget there is no prediction to compare."""
    log = engine_metrics.read_log(server.log_text())
    record.engine = {"scheme": log.scheme, "kernels": list(log.kernels),
                     "fp8_weight_only": log.fp8_weight_only,
                     "enforce_eager": server.settings.enforce_eager}
    if log.weight_memory_bytes:
        record.engine[tracking.ENGINE_WEIGHT_MEMORY_BYTES] = log.weight_memory_bytes
    info = engine_metrics.kv_cache_info(engine_metrics.parse(server.metrics_text()),
                                        server.log_text())
    if info is None:
        return
    record.kv = {tracking.KV_CACHE_TOKENS: info.kv_cache_tokens,
                 tracking.MAX_CONCURRENCY: info.max_concurrency,
                 "kv_block_size": info.block_size, "kv_num_blocks": info.num_blocks}
    if info.kv_cache_memory_bytes:
        budget, source = info.kv_cache_memory_bytes, "engine metrics"
    elif log.kv_cache_memory_bytes:
        budget, source = log.kv_cache_memory_bytes, "engine log (0.01 GiB)"
    elif server.target == "cpu":
        budget, source = int(settings.kv_cache_space_gib * 2**30), "VLLM_CPU_KVCACHE_SPACE"
    else:
        record.engine["kv_budget_source"] = "unknown: no planned figure to compare"
        return
    record.engine["kv_budget_source"] = source
    record.kv[tracking.KV_CACHE_MEMORY_BYTES] = budget
    config = json.loads((record.model.path / "config.json").read_text())
    planned = capacity.predict_vllm_kv_cache(
        config, budget, block_size=info.block_size or (128 if server.target == "cpu" else 16),
        kv_dtype=_kv_dtype(settings), max_model_len=settings.max_model_len)
    record.kv.update({
        capacity.KV_CACHE_TOKENS: planned.kv_cache_tokens,
        capacity.VLLM_MAX_CONCURRENCY: planned.max_concurrency,
        tracking.KV_CACHE_TOKENS_VS_PLANNED: info.kv_cache_tokens / planned.kv_cache_tokens,
        tracking.MAX_CONCURRENCY_VS_PLANNED: info.max_concurrency / planned.max_concurrency,
    })


@dataclass(frozen=True)
class Step:
    """One measured run: a workload (under ``key``) at one load point and repeat."""

    workload: Workload
    key: str  # the workload's name; "<name>_nocache" for the caching-off half of a comparison
    repeat: int
    concurrency: int
    caching: bool

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
        out += [Step(w, key, r, c, caching) for r in range(w.repeats) for c in w.load_points]
    return out


def _measure(groups: list[list[Model]], steps: list[Step], records: dict[str, ModelRecord],
             settings: EngineSettings, out: Path, logs: Path, caching: bool,
             pool: ServerPool | None = None) -> None:
    """Every step, the models of a group back to back (interleaved). A model that fails (its
    engine dies, requests fail, the client times out) is recorded as failed and stopped; the
    others go on."""
    label = "cache-on" if caching else "cache-off"
    run_settings = dataclasses.replace(settings, enable_prefix_caching=caching)
    for group in groups:
        with _servers(group, records, run_settings, logs, label, pool) as live:
            if not live or not steps:
                continue
            for name, server in list(live.items()):
                if not records[name].kv:
                    try:
                        _record_kv(records[name], server, run_settings)
                    except ServeError as err:
                        _drop(live, name, records, err, pool)
            env = next(iter(live.values())).environment() if live else {}
            with BenchClient(env, logs / "bench-client.log") as client:
                for i, step in enumerate(steps, start=1):
                    for name, server in list(live.items()):
                        if not step.runs_on(name):
                            continue
                        print(f"[bench] {i}/{len(steps)} {name}: {step.key} concurrency "
                              f"{step.concurrency} repeat {step.repeat + 1}/"
                              f"{step.workload.repeats}", flush=True)
                        try:
                            _load_point(client, server, records[name], step, out / "runs")
                        except ServeError as err:
                            _drop(live, name, records, err, pool)


def _drop(live: dict[str, VllmServer], name: str, records: dict[str, ModelRecord],
          err: ServeError, pool: ServerPool | None) -> None:
    server = live.pop(name)
    _failed(records[name], err, server.log_path)
    records[name].peak_memory_bytes = max(records[name].peak_memory_bytes,
                                          server.peak_memory_bytes)
    if pool is not None:
        pool.discard(server)
    else:
        server.stop()


HIT_TOLERANCE = 0.02  # hit rate above what the shared prefix allows (or above 0 in a sweep)


def _load_point(client: BenchClient, server: VllmServer, record: ModelRecord, step: Step,
                out: Path) -> None:
    """One run; its prefix-cache counters are checked: a speed sweep must have no hit, and a
    prefix comparison no hit beyond its shared prefix (else the figure is not what it says)."""
    before = engine_metrics.prefix_cache_counters(engine_metrics.parse(server.metrics_text()))
    result = run_client(client, server, record.model, step.workload, step.concurrency, out,
                        f"{record.model.name}-{step.key}-c{step.concurrency}-r{step.repeat}",
                        step.repeat)
    after = engine_metrics.prefix_cache_counters(engine_metrics.parse(server.metrics_text()))
    queries, hits = after[0] - before[0], after[1] - before[1]
    rate = hits / queries if queries else 0.0
    expected = step.workload.expected_prefix_hit_rate(
        int(record.kv.get("kv_block_size") or 0), step.concurrency) if step.caching else 0.0
    if hits > 0 and rate > expected + HIT_TOLERANCE:
        what = ("a cold speed sweep must have none" if not step.caching else
                f"the shared prefix allows at most {expected:.1%}")
        raise ServeError(f"{record.model.name}: {step.key} at concurrency {step.concurrency} hit "
                         f"the prefix cache for {rate:.1%} of its prompt tokens; {what}. Its "
                         "figures would mix warm and cold requests, so none are kept.",
                         reason=f"prefix-cache hits {rate:.1%} in {step.key} (allowed "
                                f"{expected:.1%})")
    record.runs.setdefault(step.key, {}).setdefault(step.concurrency, []).append(result)
    counters = record.prefix_counters.setdefault(step.key, [0.0, 0.0])
    counters[0] += queries
    counters[1] += hits


# --- summary ------------------------------------------------------------------------------
def pairing(target: str) -> str:
    """How each speedup ratio pairs its two runs (said wherever a speedup is shown)."""
    return ("interleaved: the models alternate run by run, on the same prompts" if target == "cpu"
            else "sequential: each model's repeats back to back, on the same prompts")



def _spread(values: list[float]) -> dict[str, float]:
    mid = statistics.median(values)
    return {"": mid, "_min": min(values), "_max": max(values),
            "_rel_spread": (max(values) - min(values)) / mid if mid else 0.0}


def summarize(records: dict[str, ModelRecord], loads: list[Workload]) -> dict[str, Any]:
    """Medians and spread per model, workload and load point; speedup against the baseline:
    the median of the per-repeat ratios (each repeat's variant run over the baseline's run of
    the same prompts), with their min and max as its spread (one estimator for both)."""
    base = records["baseline"]
    summary: dict[str, Any] = {}
    by_name = {w.name: w for w in loads}
    for name, record in records.items():
        entry: dict[str, Any] = {"recipe": record.model.recipe, "status": record.status,
                                 "identity": record.model.identity,
                                 "serve_command": record.serve_command,
                                 "reason": record.reason, "log": record.log,
                                 "format": record.model.format,
                                 "kv": record.kv, "engine": record.engine,
                                 "peak_memory_bytes": record.peak_memory_bytes,
                                 "workloads": {}}
        # a model that failed mid-run has no complete measurement: no figures from it
        for key, points in (record.runs.items() if record.status == "ok" else ()):
            per_point = {}
            for concurrency, results in points.items():
                stats = {}
                for src, metric in CLIENT_METRICS.items():
                    values = [r[src] for r in results if r.get(src) is not None]
                    if values:  # how well the repeats agree: throughput's relative spread
                        stats.update({f"{metric}{k}": v for k, v in _spread(values).items()
                                      if k != "_rel_spread" or src == "output_throughput"})
                base_runs = base.runs.get(key, {}).get(concurrency, []) \
                    if base.status == "ok" else []
                if name != "baseline" and len(base_runs) == len(results) and results:
                    ratios = [v["output_throughput"] / b["output_throughput"]
                              for v, b in zip(results, base_runs, strict=True)]
                    stats.update({f"{tracking.SPEEDUP}{k}": v
                                  for k, v in _spread(ratios).items() if k != "_rel_spread"})
                per_point[concurrency] = stats
            queries, hits = record.prefix_counters.get(key, [0.0, 0.0])
            data: dict[str, Any] = {
                "points": per_point, tracking.PREFIX_CACHE_HIT_RATE: hits / queries if queries
                else 0.0, "prefix_cache_hit_tokens": hits, "prefix_cache_query_tokens": queries}
            workload = by_name.get(key)
            if workload is not None and workload.compare_prefix_caching:
                block = int(record.kv.get("kv_block_size") or 0)
                data[tracking.PREFIX_CACHE_EXPECTED_HIT_RATE] = workload.expected_prefix_hit_rate(
                    block, workload.headline)
            entry["workloads"][key] = data
        summary[name] = entry
    for workload in loads:
        for entry in summary.values():
            on = entry["workloads"].get(workload.name, {}).get("points", {})
            off = entry["workloads"].get(f"{workload.name}_nocache", {}).get("points", {})
            head = workload.headline
            if head in on and head in off:
                entry["workloads"][workload.name][tracking.PREFIX_CACHE_TTFT_SPEEDUP] = (
                    off[head][tracking.TTFT_MS_P50] / on[head][tracking.TTFT_MS_P50])
    return summary


def _points_by_int(summary: dict[str, Any]) -> dict[str, Any]:
    """JSON turns the load-point keys into strings; give them back their int."""
    for entry in summary.values():
        for data in entry["workloads"].values():
            data["points"] = {int(k): v for k, v in data["points"].items()}
    return summary


def metric_prefix(workload: Workload, loads: list[Workload]) -> str:
    """The first workload's metrics carry plain names; the others are prefixed by theirs."""
    return "" if workload is loads[0] else f"{workload.name}."


def _log(base: baselines.Baseline, summary: dict[str, Any], loads: list[Workload],
         settings: EngineSettings, key: str, out: Path, target: str) -> None:
    for name, entry in summary.items():
        metrics: dict[str, float] = {}
        stepped: list[tuple[str, float, int]] = []
        for workload in loads:
            prefix = metric_prefix(workload, loads)
            for suffix, label in (("", workload.name), ("nocache.", f"{workload.name}_nocache")):
                data = entry["workloads"].get(label)
                if not data:
                    continue
                for concurrency, stats in data["points"].items():
                    for metric, value in stats.items():
                        stepped.append((f"{SWEEP}{prefix}{suffix}{metric}", value,
                                        int(concurrency)))
                        if int(concurrency) == workload.headline:
                            metrics[f"{prefix}{suffix}{metric}"] = value
                # the hit counters of every measured run: ~0 in a sweep, the prefix's share
                # in a prefix comparison
                for name_, value in data.items():
                    if name_ != "points" and isinstance(value, (int, float)):
                        metrics[f"{prefix}{suffix}{name_}"] = value
        metrics.update({k: float(v) for k, v in entry["kv"].items()})
        engine = entry.get("engine", {})
        if engine.get(tracking.ENGINE_WEIGHT_MEMORY_BYTES):
            metrics[tracking.ENGINE_WEIGHT_MEMORY_BYTES] = engine[
                tracking.ENGINE_WEIGHT_MEMORY_BYTES]
        if entry["peak_memory_bytes"]:
            metrics[tracking.SERVER_PEAK_MEMORY_BYTES] = entry["peak_memory_bytes"]
        prof = hardware.profile()
        params = {tracking.PARAM_BASELINE: base.name, tracking.PARAM_RECIPE: entry["recipe"],
                  "format": entry["format"], "workloads": ",".join(w.name for w in loads),
                  "serve_target": target, "vllm": vllm_version(),
                  "speedup_pairing": pairing(target),
                  tracking.PARAM_HARDWARE: prof.describe()[:500], **settings.as_params()}
        if entry.get("serve_command"):
            params["serve_command"] = entry["serve_command"][:5000]
        if engine.get("scheme"):
            params["engine_scheme"] = engine["scheme"][:500]
            params["engine_kernels"] = "; ".join(engine.get("kernels", []))[:500] or "-"
        if entry["status"] != "ok":
            params["serving_reason"] = entry["reason"][:500]
            if entry.get("log"):
                params["serving_log"] = entry["log"][:500]
            metrics = {}
            stepped = []
        tracking.log_run(
            base.name, STAGE, f"bench:{name}", params, metrics,
            tags={tracking.TAG_CACHE_KEY: key, tracking.TAG_SERVING_STATUS: entry["status"],
                  tracking.TAG_HARDWARE_KEY: prof.key()},
            artifacts=[out / "summary.json",
                       *sorted((out.parent / "logs" / key).glob(f"server-{name}-*.log"))],
            stepped=stepped)


def format_table(summary: dict[str, Any], loads: list[Workload], pairing_text: str = "") -> str:
    """The terminal view: one line per model at each workload's headline load point."""
    lines = []
    for workload in loads:
        head = workload.headline
        caching = "prefix caching on vs off" if workload.compare_prefix_caching else \
            "prefix caching off: cold, distinct prompts"
        lines.append(f"\n{workload.name} (concurrency {head}, {workload.num_prompts(head)} "
                     f"requests x {workload.output_len} tokens out; {caching}; median of "
                     f"{workload.repeats} repeats [min-max], spread = (max - min) / median)")
        lines.append(f"  {'model':10s} {'out tok/s':>22s} {'spread':>7s} {'speedup':>18s} "
                     f"{'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} {'KV tokens':>10s} "
                     f"{'cache hits':>10s}")
        for name, entry in summary.items():
            if not workload.runs_on(name):
                continue
            if entry["status"] == "failed":
                lines.append(f"  {name:10s} FAILED: {entry['reason']}\n  {'':10s} log: "
                             f"{entry.get('log') or '-'}")
                continue
            if entry["status"] != "ok":
                where = SERVED_ON.get(entry["format"], "a GPU build of vLLM")
                lines.append(f"  {name:10s} unsupported on this hardware ({entry['format']}): "
                             f"{entry['reason']}\n  {'':10s} served on: {where}")
                continue
            data = entry["workloads"].get(workload.name, {})
            stats = data.get("points", {}).get(head)
            if not stats:
                continue
            tps = (f"{stats[tracking.OUTPUT_TOKENS_PER_S]:7.1f} "
                   f"[{stats[tracking.OUTPUT_TOKENS_PER_S + '_min']:.1f}-"
                   f"{stats[tracking.OUTPUT_TOKENS_PER_S + '_max']:.1f}]")
            spread = f"{stats.get(tracking.OUTPUT_TOKENS_PER_S + '_rel_spread', 0):.0%}"
            speed = (f"{stats[tracking.SPEEDUP]:.2f}x [{stats[tracking.SPEEDUP + '_min']:.2f}-"
                     f"{stats[tracking.SPEEDUP + '_max']:.2f}]") if tracking.SPEEDUP in stats \
                else "(reference)"
            kv = entry["kv"].get(tracking.KV_CACHE_TOKENS, 0)
            ttft50, ttft99 = stats[tracking.TTFT_MS_P50], stats[tracking.TTFT_MS_P99]
            hits = f"{data.get(tracking.PREFIX_CACHE_HIT_RATE, 0):.1%}"
            lines.append(f"  {name:10s} {tps:>22s} {spread:>7s} {speed:>18s} {ttft50:7.0f}ms "
                         f"{ttft99:7.0f}ms {stats[tracking.ITL_MS_P50]:6.1f}ms {kv:>10,} "
                         f"{hits:>10s}")
        if workload.compare_prefix_caching:
            for name, entry in summary.items():
                data = entry["workloads"].get(workload.name, {})
                if tracking.PREFIX_CACHE_TTFT_SPEEDUP in data:
                    allowed = data.get(tracking.PREFIX_CACHE_EXPECTED_HIT_RATE, 0.0)
                    lines.append(
                        f"  {name:10s} prefix cache: hit rate "
                        f"{data[tracking.PREFIX_CACHE_HIT_RATE]:.1%} of prompt tokens (the "
                        f"shared prefix allows {allowed:.1%}), TTFT p50 "
                        f"{data[tracking.PREFIX_CACHE_TTFT_SPEEDUP]:.2f}x faster than with "
                        "caching off")
    if pairing_text:
        lines.append(f"\nspeedup: median of the per-repeat ratios [min-max], {pairing_text}")
    return "\n".join(lines)


def bench(base: baselines.Baseline, recipes: list[str] | None, loads: list[Workload],
          settings: EngineSettings, force: bool = False, target: str | None = None,
          pool: ServerPool | None = None) -> dict[str, Any]:
    """Measure the baseline and the variants; returns the summary (also on disk and MLflow).

    With a ``pool``, the servers of the speed sweeps (prefix caching off) stay up in it for
    the next stage.
    """
    from pipeline.serve.server import serve_target

    target = target or serve_target()
    settings = settings.resolved(target)  # eager on CPUs, compiled on GPUs: recorded as such
    longest = max(w.max_tokens_per_request for w in loads)
    if longest > settings.max_model_len:
        raise ConfigError(f"the workloads send up to {longest} tokens per request, more than "
                          f"the engine's max_model_len {settings.max_model_len}: raise "
                          "--max-model-len (MAX_MODEL_LEN=) or shorten the workload.")
    models = models_for(base, recipes)
    key = _cache_key(models, loads, settings, target)
    out = paths.artifacts_dir() / "bench" / base.name / key
    cached = read_json(out / "summary.json")
    failed = [n for n, e in cached.get("models", {}).items() if e.get("status") == "failed"]
    if failed and not force:
        print(f"[bench] the last measurement with these inputs had failures ({', '.join(failed)}"
              "); measuring again", flush=True)
    reused = bool(cached) and not force and not failed
    if reused:
        print(f"[bench] unchanged since the last measurement ({out}); reusing it "
              "(FORCE=1 re-measures).")
        summary = _points_by_int(cached["models"])
    else:
        records = {m.name: ModelRecord(m) for m in models}
        if not force:
            _recall_unsupported(records)
        # On a CPU host every server is up at once and the models alternate run by run
        # (interleaved: drift cancels out of the speedup); on a GPU each model has the device
        # to itself in turn, so the repeats of one model run back to back (sequential).
        def groups(ms: list[Model]) -> list[list[Model]]:
            return ([ms] if ms else []) if target == "cpu" else [[m] for m in ms]

        # Server logs live outside the temp dir: a failed run's logs stay where errors point.
        logs = out.parent / "logs" / key
        cold, warm = steps_for(loads, caching=False), steps_for(loads, caching=True)
        with atomic_dir(out) as tmp:
            _measure(groups([m for m in models if any(s.runs_on(m.name) for s in cold)]), cold,
                     records, settings, tmp, logs, caching=False, pool=pool)
            _measure(groups([m for m in models if any(s.runs_on(m.name) for s in warm)]), warm,
                     records, settings, tmp, logs, caching=True)
            summary = summarize(records, loads)
            (tmp / "summary.json").write_text(json.dumps(
                {"baseline": base.name, "target": target, "engine": dataclasses.asdict(settings),
                 "hardware": hardware.profile().as_dict(), "key": key,
                 "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "speedup_pairing": pairing(target),
                 "workloads": [str(w.path) for w in loads],
                 "headline": {w.name: w.headline for w in loads},
                 "models": summary}, indent=2))
    print(format_table(summary, loads, pairing(target)))
    if not reused or not tracking.find_run(base.name, STAGE, key):
        _log(base, summary, loads, settings, key, out, target)
        print(f"[bench] recorded in MLflow ({paths.default_tracking_uri()})")
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    baselines.add_baseline_argument(parser)
    parser.add_argument("--recipe", action="append",
                        help="a variant to bench (repeatable; default: every variant on disk)")
    parser.add_argument("--workload", action="append",
                        help="workload name in configs/workloads or a YAML file (repeatable; "
                             f"default: {', '.join(workloads_mod.DEFAULT_WORKLOADS)})")
    parser.add_argument("--repeats", type=int, help="override every workload's repeats")
    parser.add_argument("--force", action="store_true", help="re-measure even if unchanged")
    add_engine_arguments(parser)
    parser.set_defaults(servers=None)  # a campaign passes its ServerPool here


def run(args: argparse.Namespace) -> int:
    tracking.check_store()  # seconds, before the work: not minutes after it
    loads = [workloads_mod.load(w) for w in args.workload or workloads_mod.DEFAULT_WORKLOADS]
    if args.repeats:
        loads = [dataclasses.replace(w, repeats=args.repeats) for w in loads]
    summary = bench(baselines.resolve(args.baseline), args.recipe, loads,
                    engine_settings_from(args), args.force, pool=args.servers)
    failed = {n: e for n, e in summary.items() if e["status"] == "failed"}
    if failed:
        print("[bench] failed, not a hardware limit: " + "; ".join(
            f"{n}: {e['reason']} (log {e.get('log') or '-'})" for n, e in failed.items()),
            file=sys.stderr)
        return 1
    return 0
