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
from pathlib import Path
from typing import Any

from pipeline import baseline as baselines
from pipeline import capacity, checkpoint, engine_metrics, hardware, paths, tracking
from pipeline import workloads as workloads_mod
from pipeline.errors import ConfigError
from pipeline.fsutil import atomic_dir, read_json
from pipeline.serve import (
    EngineSettings,
    ServeError,
    ServerPool,
    UnsupportedFormat,
    VllmServer,
    known_refusal,
    remember_refusal,
    serve_python,
    vllm_version,
)
from pipeline.workloads import Workload

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
                [str(serve_python()), str(Path(__file__).with_name("vllm_bench_worker.py"))],
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
                out_dir: Path, tag: str) -> list[str]:
    """The ``vllm bench serve`` arguments for one load point (README: reproduce by hand)."""
    return ["--backend", "vllm", "--base-url", server.base_url, "--endpoint", "/v1/completions",
            "--model", server.served_name, "--tokenizer", str(model.path),
            *workload.client_args(concurrency), "--save-result", "--result-dir", str(out_dir),
            "--result-filename", f"{tag}.json", "--disable-tqdm"]


def run_client(client: BenchClient, server: VllmServer, model: Model, workload: Workload,
               concurrency: int, out_dir: Path, tag: str) -> dict[str, Any]:
    """One load point against ``server``; returns vLLM's saved result JSON."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / f"{tag}.log"
    try:
        client.run(client_argv(server, model, workload, concurrency, out_dir, tag), log)
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
    peak_memory_bytes: int = 0
    # workload -> load point -> list of client results (one per repeat)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = dataclasses.field(default_factory=dict)
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
            if settings.enable_prefix_caching:
                cpu_env = [f"{k}={v}" for k, v in server.environment().items()
                           if k.startswith("VLLM_CPU")]
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


def _record_kv(record: ModelRecord, server: VllmServer, settings: EngineSettings) -> None:
    info = engine_metrics.kv_cache_info(engine_metrics.parse(server.metrics_text()),
                                        server.log_text())
    if info is None:
        return
    record.kv = {tracking.KV_CACHE_TOKENS: info.kv_cache_tokens,
                 tracking.MAX_CONCURRENCY: info.max_concurrency,
                 "kv_block_size": info.block_size, "kv_num_blocks": info.num_blocks}
    budget = info.kv_cache_memory_bytes or int(settings.kv_cache_space_gib * 2**30)
    config = json.loads((record.model.path / "config.json").read_text())
    planned = capacity.predict_vllm_kv_cache(
        config, budget, block_size=info.block_size or 16, kv_dtype="bf16",
        max_model_len=settings.max_model_len)
    record.kv.update({
        capacity.KV_CACHE_TOKENS: planned.kv_cache_tokens,
        capacity.VLLM_MAX_CONCURRENCY: planned.max_concurrency,
        tracking.KV_CACHE_TOKENS_VS_PLANNED: info.kv_cache_tokens / planned.kv_cache_tokens,
        tracking.MAX_CONCURRENCY_VS_PLANNED: info.max_concurrency / planned.max_concurrency,
    })


def _measure(groups: list[list[Model]], loads: list[Workload], records: dict[str, ModelRecord],
             settings: EngineSettings, out: Path, logs: Path, caching: bool,
             pool: ServerPool | None = None) -> None:
    """Every workload, repeat and load point, the models of a group back to back. A model
    that fails (its engine dies, requests fail, the client times out) is recorded as failed
    and stopped; the others go on."""
    label = "cache-on" if caching else "cache-off"
    run_settings = dataclasses.replace(settings, enable_prefix_caching=caching)
    todo = [w for w in loads if caching or w.compare_prefix_caching]
    steps = [(w, r, c) for w in todo for r in range(w.repeats) for c in w.load_points]
    for group in groups:
        with _servers(group, records, run_settings, logs, label, pool) as live:
            if not live or not steps:
                continue
            if caching:
                for name, server in list(live.items()):
                    try:
                        _record_kv(records[name], server, run_settings)
                    except ServeError as err:
                        _drop(live, name, records, err, pool)
            env = next(iter(live.values())).environment() if live else {}
            with BenchClient(env, logs / "bench-client.log") as client:
                for i, (workload, repeat, concurrency) in enumerate(steps, start=1):
                    key = workload.name if caching else f"{workload.name}_nocache"
                    for name, server in list(live.items()):
                        if not (workload.runs_on(name) if caching else workload.runs_off(name)):
                            continue
                        print(f"[bench] {i}/{len(steps)} {name}: {key} concurrency "
                              f"{concurrency} repeat {repeat + 1}/{workload.repeats}", flush=True)
                        try:
                            _load_point(client, server, records[name], workload, concurrency,
                                        out / "runs", key, repeat)
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


def _load_point(client: BenchClient, server: VllmServer, record: ModelRecord, workload: Workload,
                concurrency: int, out: Path, key: str, repeat: int) -> None:
    before = engine_metrics.prefix_cache_counters(engine_metrics.parse(server.metrics_text()))
    result = run_client(client, server, record.model, workload, concurrency, out,
                        f"{record.model.name}-{key}-c{concurrency}-r{repeat}")
    after = engine_metrics.prefix_cache_counters(engine_metrics.parse(server.metrics_text()))
    record.runs.setdefault(key, {}).setdefault(concurrency, []).append(result)
    counters = record.prefix_counters.setdefault(key, [0.0, 0.0])
    counters[0] += after[0] - before[0]
    counters[1] += after[1] - before[1]


# --- summary ------------------------------------------------------------------------------
def summarize(records: dict[str, ModelRecord], loads: list[Workload]) -> dict[str, Any]:
    """Medians and spread per model, workload and load point; speedup against the baseline."""
    base = records["baseline"]
    summary: dict[str, Any] = {}
    for name, record in records.items():
        entry: dict[str, Any] = {"recipe": record.model.recipe, "status": record.status,
                                 "identity": record.model.identity,
                                 "serve_command": record.serve_command,
                                 "reason": record.reason, "log": record.log,
                                 "format": record.model.format,
                                 "kv": record.kv, "peak_memory_bytes": record.peak_memory_bytes,
                                 "workloads": {}}
        # a model that failed mid-run has no complete measurement: no figures from it
        for key, points in (record.runs.items() if record.status == "ok" else ()):
            per_point = {}
            for concurrency, results in points.items():
                stats = {}
                for src, metric in CLIENT_METRICS.items():
                    values = [r[src] for r in results if r.get(src) is not None]
                    if values:
                        stats[metric] = statistics.median(values)
                        stats[f"{metric}_min"], stats[f"{metric}_max"] = min(values), max(values)
                base_runs = base.runs.get(key, {}).get(concurrency, []) \
                    if base.status == "ok" else []
                if name != "baseline" and base_runs:
                    ratios = [v["output_throughput"] / b["output_throughput"]
                              for v, b in zip(results, base_runs, strict=False)]
                    base_tps = statistics.median(b["output_throughput"] for b in base_runs)
                    stats[tracking.SPEEDUP] = stats[tracking.OUTPUT_TOKENS_PER_S] / base_tps
                    stats[f"{tracking.SPEEDUP}_min"] = min(ratios)
                    stats[f"{tracking.SPEEDUP}_max"] = max(ratios)
                per_point[concurrency] = stats
            queries, hits = record.prefix_counters.get(key, [0.0, 0.0])
            entry["workloads"][key] = {
                "points": per_point,
                tracking.PREFIX_CACHE_HIT_RATE: hits / queries if queries else 0.0,
            }
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
                if not suffix:
                    metrics[f"{prefix}{tracking.PREFIX_CACHE_HIT_RATE}"] = data[
                        tracking.PREFIX_CACHE_HIT_RATE]
                    if tracking.PREFIX_CACHE_TTFT_SPEEDUP in data:
                        metrics[f"{prefix}{tracking.PREFIX_CACHE_TTFT_SPEEDUP}"] = data[
                            tracking.PREFIX_CACHE_TTFT_SPEEDUP]
        metrics.update({k: float(v) for k, v in entry["kv"].items()})
        if entry["peak_memory_bytes"]:
            metrics[tracking.SERVER_PEAK_MEMORY_BYTES] = entry["peak_memory_bytes"]
        prof = hardware.profile()
        params = {tracking.PARAM_BASELINE: base.name, tracking.PARAM_RECIPE: entry["recipe"],
                  "format": entry["format"], "workloads": ",".join(w.name for w in loads),
                  "serve_target": target, "vllm": vllm_version(),
                  tracking.PARAM_HARDWARE: prof.describe()[:500], **settings.as_params()}
        if entry.get("serve_command"):
            params["serve_command"] = entry["serve_command"][:5000]
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


def format_table(summary: dict[str, Any], loads: list[Workload]) -> str:
    """The terminal view: one line per model at each workload's headline load point."""
    lines = []
    for workload in loads:
        head = workload.headline
        lines.append(f"\n{workload.name} (concurrency {head}; median of {workload.repeats}, "
                     "[min-max])")
        lines.append(f"  {'model':10s} {'out tok/s':>22s} {'speedup':>18s} {'TTFT p50':>9s} "
                     f"{'TTFT p99':>9s} {'ITL p50':>8s} {'KV tokens':>10s} {'peak mem':>9s}")
        for name, entry in summary.items():
            if entry["status"] == "failed":
                lines.append(f"  {name:10s} FAILED: {entry['reason']}\n  {'':10s} log: "
                             f"{entry.get('log') or '-'}")
                continue
            if entry["status"] != "ok":
                where = SERVED_ON.get(entry["format"], "a GPU build of vLLM")
                lines.append(f"  {name:10s} unsupported on this hardware ({entry['format']}): "
                             f"{entry['reason']}\n  {'':10s} served on: {where}")
                continue
            stats = entry["workloads"].get(workload.name, {}).get("points", {}).get(head)
            if not stats:
                continue
            tps = (f"{stats[tracking.OUTPUT_TOKENS_PER_S]:7.1f} "
                   f"[{stats[tracking.OUTPUT_TOKENS_PER_S + '_min']:.0f}-"
                   f"{stats[tracking.OUTPUT_TOKENS_PER_S + '_max']:.0f}]")
            speed = (f"{stats[tracking.SPEEDUP]:.2f}x [{stats[tracking.SPEEDUP + '_min']:.2f}-"
                     f"{stats[tracking.SPEEDUP + '_max']:.2f}]") if tracking.SPEEDUP in stats \
                else "(reference)"
            kv = entry["kv"].get(tracking.KV_CACHE_TOKENS, 0)
            ttft50, ttft99 = stats[tracking.TTFT_MS_P50], stats[tracking.TTFT_MS_P99]
            lines.append(f"  {name:10s} {tps:>22s} {speed:>18s} {ttft50:7.0f}ms {ttft99:7.0f}ms"
                         f" {stats[tracking.ITL_MS_P50]:6.1f}ms {kv:>10,} "
                         f"{entry['peak_memory_bytes'] / 1e9:7.2f}GB")
        if workload.compare_prefix_caching:
            for name, entry in summary.items():
                data = entry["workloads"].get(workload.name, {})
                if tracking.PREFIX_CACHE_TTFT_SPEEDUP in data:
                    lines.append(f"  {name:10s} prefix cache: hit rate "
                                 f"{data[tracking.PREFIX_CACHE_HIT_RATE]:.1%}, TTFT "
                                 f"{data[tracking.PREFIX_CACHE_TTFT_SPEEDUP]:.2f}x faster "
                                 "than with caching off")
    return "\n".join(lines)


def bench(base: baselines.Baseline, recipes: list[str] | None, loads: list[Workload],
          settings: EngineSettings, force: bool = False, target: str | None = None,
          pool: ServerPool | None = None) -> dict[str, Any]:
    """Measure the baseline and the variants; returns the summary (also on disk and MLflow).

    With a ``pool``, the servers (prefix caching on) stay up in it for the next stage.
    """
    from pipeline.serve import serve_target

    target = target or serve_target()
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
        groups = [models] if target == "cpu" else [[m] for m in models]
        # Server logs live outside the temp dir: a failed run's logs stay where errors point.
        logs = out.parent / "logs" / key
        with atomic_dir(out) as tmp:
            _measure(groups, loads, records, settings, tmp, logs, caching=True, pool=pool)
            off = [w for w in loads if w.compare_prefix_caching]
            if off:
                off_models = [m for m in models if any(w.runs_off(m.name) for w in off)]
                off_groups = [off_models] if target == "cpu" else [[m] for m in off_models]
                _measure(off_groups, loads, records, settings, tmp, logs, caching=False)
            summary = summarize(records, loads)
            (tmp / "summary.json").write_text(json.dumps(
                {"baseline": base.name, "target": target, "engine": dataclasses.asdict(settings),
                 "hardware": hardware.profile().as_dict(),
                 "workloads": [str(w.path) for w in loads],
                 "headline": {w.name: w.headline for w in loads},
                 "models": summary}, indent=2))
    print(format_table(summary, loads))
    if not reused or not tracking.find_run(base.name, STAGE, key):
        _log(base, summary, loads, settings, key, out, target)
        print(f"[bench] recorded in MLflow ({paths.default_tracking_uri()})")
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineSettings()
    baselines.add_baseline_argument(parser)
    parser.add_argument("--recipe", action="append",
                        help="a variant to bench (repeatable; default: every variant on disk)")
    parser.add_argument("--workload", action="append",
                        help="workload name in configs/workloads or a YAML file (repeatable; "
                             f"default: {', '.join(workloads_mod.DEFAULT_WORKLOADS)})")
    parser.add_argument("--repeats", type=int, help="override every workload's repeats")
    parser.add_argument("--force", action="store_true", help="re-measure even if unchanged")
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    parser.add_argument("--kv-cache-gib", type=int, default=defaults.kv_cache_space_gib,
                        help="CPU: VLLM_CPU_KVCACHE_SPACE (%(default)s)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=defaults.gpu_memory_utilization)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--compile", action="store_true",
                        help="let vLLM compile (slower start-up, faster steady state)")
    parser.set_defaults(servers=None)  # a campaign passes its ServerPool here


def settings_from(args: argparse.Namespace) -> EngineSettings:
    return EngineSettings(max_model_len=args.max_model_len, kv_cache_space_gib=args.kv_cache_gib,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          enforce_eager=not args.compile)


def run(args: argparse.Namespace) -> int:
    tracking.check_store()  # seconds, before the work: not minutes after it
    loads = [workloads_mod.load(w) for w in args.workload or workloads_mod.DEFAULT_WORKLOADS]
    if args.repeats:
        loads = [dataclasses.replace(w, repeats=args.repeats) for w in loads]
    summary = bench(baselines.resolve(args.baseline), args.recipe, loads, settings_from(args),
                    args.force, pool=args.servers)
    failed = {n: e for n, e in summary.items() if e["status"] == "failed"}
    if failed:
        print("[bench] failed, not a hardware limit: " + "; ".join(
            f"{n}: {e['reason']} (log {e.get('log') or '-'})" for n, e in failed.items()),
            file=sys.stderr)
        return 1
    return 0
