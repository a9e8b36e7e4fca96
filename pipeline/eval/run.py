"""Score the baseline and its variants with lm-eval, and report percent recovery.

Each variant is scored through vLLM (lm-eval ``local-completions`` against a ``VllmServer``)
when vLLM serves its format here; otherwise with lm-eval's ``hf`` backend on de-compressed
weights, and every figure of it is marked ``emulated``. The baseline is scored through the same
backend as each variant it is compared with. Seeds, limits and few-shot settings are the same
for both and recorded. Results are cached per (model identity, task file + data, settings)
under ``artifacts/evals/`` so an unchanged re-run does no work.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core import hardware, paths, tracking
from pipeline.core.errors import QpipeError
from pipeline.core.fsutil import atomic_dir, read_json, write_json_atomic
from pipeline.eval import divergence, recovery, suites
from pipeline.quantize import baseline as baselines
from pipeline.quantize import checkpoint
from pipeline.serve.server import EngineSettings, add_engine_arguments, engine_settings_from

if TYPE_CHECKING:
    from pipeline.serve.server import ServerPool

STAGE = "eval"
SERVED = "served"  # local-completions against vLLM: the serving numerics
EMULATED = "emulated"  # lm-eval hf on de-compressed weights
RESULT_FILE = "qpipe_task_result.json"
SUMMARY_FILE = "recovery.json"
FAILURE_FILE = "eval_failure.json"  # beside recovery.json while a variant's last scoring failed
# lm-eval's defaults (its CLI's --seed 0,1234,1234,1234): random, numpy, torch, few-shot.
SEEDS = {"random_seed": 0, "numpy_random_seed": 1234, "torch_random_seed": 1234,
         "fewshot_random_seed": 1234}
CHANCE_METRICS = {"acc", "acc_norm", "acc_mutual_info"}  # 1/choices for multiple_choice


class EvalError(QpipeError):
    """lm-eval failed on a task."""


@dataclass(frozen=True)
class Settings:
    """What determines a score besides the model and the task; recorded with every result."""

    limit: int | str | None = None  # None: each task's qpipe_limit, else every item; "all"
    num_fewshot: int | None = None  # None: the task's own
    batch_size: int = 16  # hf: sequences per forward; served: prompts per request
    num_concurrent: int = 2  # served: requests in flight
    backend: str = "auto"  # auto | served | hf
    engine: EngineSettings = field(default_factory=EngineSettings)  # served: as bench's

    def for_task(self, task: suites.Task) -> dict[str, Any]:
        limit = None if self.limit == "all" else (
            self.limit if self.limit is not None else task.default_limit)
        return {"limit": limit,
                "num_fewshot": self.num_fewshot, "seeds": SEEDS,
                "lm_eval": metadata.version("lm_eval")}


@dataclass(frozen=True)
class Model:
    """A model to score: the baseline or one variant."""

    label: str  # "baseline" or the recipe name
    recipe: str | None
    path: Path
    identity: str  # the variant's manifest cache_key, or the baseline's content hash

    @property
    def served_name(self) -> str:
        return self.label  # as `qpipe bench` names it, so a campaign can share the server


@dataclass
class TaskResult:
    """One task scored on one model through one backend."""

    task: str
    backend: str
    metrics: dict[str, float]  # lm-eval's "acc,none" -> score (and "..._stderr,none")
    per_item: dict[str, dict[str, float]]  # metric key -> doc_id (str) -> per-item score
    chance: dict[str, float]  # metric key -> score of random answers
    settings: dict[str, Any]
    command: str  # the lm_eval command line that reproduces it
    directory: str = ""  # where results.json and samples_<task>.jsonl lie
    seconds: float = 0.0
    cached: bool = field(default=False, compare=False)

    @classmethod
    def load(cls, directory: Path) -> TaskResult | None:
        data = read_json(directory / RESULT_FILE)
        return cls(**data, cached=True) if data else None


# ---------------------------------------------------------------------------- models


def variant_models(base: baselines.Baseline, recipes: list[str] | None) -> list[Model]:
    """The variants to score: the named ones, or every one on disk for this baseline."""
    return [Model(name, name, paths.variant_dir(base.name, name), str(manifest["cache_key"]))
            for name, manifest in checkpoint.variant_manifests(base.name, recipes).items()]


def baseline_model(base: baselines.Baseline) -> Model:
    return Model("baseline", None, base.path, base.identity)


# ---------------------------------------------------------------------------- cache


def cache_root(base_name: str) -> Path:
    return paths.artifacts_dir() / "evals" / base_name


def task_key(model: Model, task: suites.Task, backend: str, settings: Settings) -> str:
    payload = {"model": model.identity, "task": task.name, "task_sha": task.sha256,
               "backend": backend, "settings": settings.for_task(task),
               "batch_size": settings.batch_size,
               "engine": _engine_settings(settings, model) if backend == SERVED else None,
               # served numerics follow the kernels this hardware runs
               "hardware": hardware.profile().key() if backend == SERVED else None,
               "hf_dtype": divergence.HF_DTYPE if backend == EMULATED else None}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def task_dir(base_name: str, model: Model, task: suites.Task, backend: str,
             settings: Settings) -> Path:
    key = task_key(model, task, backend, settings)
    return cache_root(base_name) / "cache" / model.identity / f"{backend}-{task.name}-{key}"


# ---------------------------------------------------------------------------- lm-eval


def _quiet_libraries() -> None:
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("lm-eval", "lm_eval", "datasets", "transformers", "httpx", "urllib3"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _max_model_len(model: Model, settings: Settings) -> int:
    config = read_json(model.path / "config.json")
    limit = config.get("max_position_embeddings") or settings.engine.max_model_len
    return int(min(settings.engine.max_model_len, limit))


def engine_for(model: Model, settings: Settings) -> EngineSettings:
    """The engine settings a served model is scored with: the campaign's (or eval's) own, its
    context capped at the model's, every automatic choice made for this host."""
    from pipeline.serve.server import serve_target

    return replace(settings.engine, max_model_len=_max_model_len(model, settings)).resolved(
        serve_target())


def _engine_settings(settings: Settings, model: Model) -> dict[str, Any]:
    engine = engine_for(model, settings).as_params()
    engine.pop("engine.enable_prefix_caching", None)  # scores do not depend on it
    return {**engine, "num_concurrent": settings.num_concurrent}


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(paths.PROJECT_ROOT))
    except ValueError:
        return str(path)


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def hf_model_args(model: Model) -> str:
    return f"pretrained={_shown(model.path)},dtype={divergence.HF_DTYPE}"


def served_model_args(model: Model, base_url: str, settings: Settings) -> str:
    return (f"model={model.served_name},base_url={base_url}/v1/completions,"
            f"tokenizer_backend=huggingface,tokenizer={_shown(model.path)},"
            f"num_concurrent={settings.num_concurrent},max_retries=3,timeout=3600,"
            f"max_length={_max_model_len(model, settings)}")


def lm_eval_command(model: Model, task: suites.Task, backend: str, settings: Settings,
                    limit: int | None, base_url: str = "http://127.0.0.1:8000") -> str:
    """The ``lm_eval`` command line that reproduces one task's score (from the project root)."""
    if backend == SERVED:
        args = ["--model", "local-completions", "--model_args",
                served_model_args(model, base_url, settings)]
    else:
        args = ["--model", "hf", "--model_args", hf_model_args(model), "--device", _device()]
    args += ["--batch_size", str(settings.batch_size)]
    if task.path != Path():
        args += ["--include_path", _shown(task.include_path)]
    args += ["--tasks", task.name]
    if limit is not None:
        args += ["--limit", str(limit)]
    if settings.num_fewshot is not None:
        args += ["--num_fewshot", str(settings.num_fewshot)]
    args += ["--log_samples", "--output_path", f"lm_eval_out/{model.label}"]
    return shlex.join([".venv/bin/lm_eval", *args])


def serve_command(model: Model, settings: Settings) -> str:
    """The ``vllm serve`` command for the hand-made served run (port 8000)."""
    from pipeline.serve.server import VllmServer

    server = VllmServer(Path(_shown(model.path)), model.served_name,
                        engine_for(model, settings), Path("/dev/null"))
    server.port = 8000
    cpu_env = [f"{k}={v}" for k, v in server.environment().items()
               if k.startswith("VLLM_CPU_KVCACHE")]
    command = server.command()
    command[0] = ".venv-serve/bin/vllm"
    return shlex.join([*cpu_env, *command])


def _task_manager(task: suites.Task) -> Any:
    from lm_eval.tasks import TaskManager

    if task.path == Path():  # an lm-eval built-in task, passed through by name
        return TaskManager()
    return TaskManager(include_path=str(task.include_path), include_defaults=False)


def per_item_scores(samples: list[dict], output_type: str
                    ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """From lm-eval's per-sample records: metric key -> {doc_id: score}, and chance levels."""
    scores: dict[str, dict[str, float]] = {}
    chance_sum: dict[str, float] = {}
    for sample in samples:
        for metric in sample.get("metrics", []):
            value = sample.get(metric)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            key = f"{metric},{sample.get('filter', 'none')}"
            scores.setdefault(key, {})[str(sample["doc_id"])] = float(value)
            n_choices = len(sample.get("arguments") or [])
            level = 1 / n_choices if (output_type == "multiple_choice" and n_choices
                                      and metric in CHANCE_METRICS) else 0.0
            chance_sum[key] = chance_sum.get(key, 0.0) + level
    chance = {k: chance_sum[k] / len(scores[k]) for k in scores}
    return scores, chance


def _json_default(obj: Any) -> Any:
    from lm_eval.utils import handle_non_serializable

    return handle_non_serializable(obj)


def run_task(lm: Any, model_args: str | None, model: Model, task: suites.Task, backend: str,
             settings: Settings, target: Path) -> TaskResult:
    """One ``simple_evaluate`` call; writes results.json, the samples and qpipe's summary."""
    from lm_eval import simple_evaluate

    task_settings = settings.for_task(task)
    started = time.monotonic()
    try:
        with suites.chdir(suites.data_root()):  # data_files are relative to the project root
            out = simple_evaluate(
                model=lm, model_args=model_args, tasks=[task.name],
                num_fewshot=settings.num_fewshot,
                batch_size=settings.batch_size,
                device=_device() if backend == EMULATED else None,
                limit=task_settings["limit"], log_samples=True, task_manager=_task_manager(task),
                **SEEDS)
    except KeyboardInterrupt:
        raise
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise EvalError(
            f"lm-eval failed on task {task.name} ({_shown(task.path)}) for {model.label} "
            f"({backend}): {type(err).__name__}: {first}. Check the task with `qpipe suites "
            f"validate {_shown(task.path)}`.") from err
    seconds = time.monotonic() - started
    samples = out.pop("samples", {}).get(task.name, [])
    output_type = out.get("configs", {}).get(task.name, {}).get("output_type", task.output_type)
    per_item, chance = per_item_scores(samples, output_type)
    metrics = {k: float(v) for k, v in out["results"][task.name].items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    task_settings["num_fewshot_used"] = out.get("n-shot", {}).get(task.name)
    result = TaskResult(
        task=task.name, backend=backend, metrics=metrics, per_item=per_item, chance=chance,
        settings=task_settings, seconds=round(seconds, 2), directory=str(target),
        command=lm_eval_command(model, task, backend, settings, task_settings["limit"]))
    with atomic_dir(target) as tmp:
        (tmp / "results.json").write_text(json.dumps(out, indent=2, default=_json_default))
        with (tmp / f"samples_{task.name}.jsonl").open("w") as f:
            for sample in samples:
                f.write(json.dumps(sample, default=_json_default) + "\n")
        data = asdict(result)
        data.pop("cached")
        write_json_atomic(tmp / RESULT_FILE, data)
    return result


@contextlib.contextmanager
def _lm(model: Model, backend: str, settings: Settings, log_dir: Path,
        pool: ServerPool | None = None) -> Iterator[tuple[Any, str | None]]:
    """(model or its name, model_args) for simple_evaluate; serves the model when SERVED
    (through the pool's server when it holds one started with the same settings)."""
    if backend == SERVED:
        from pipeline.serve.server import VllmServer

        engine = engine_for(model, settings)
        running = pool.get(model.path, model.served_name, engine, any_caching=True) \
            if pool else None
        if running is not None:
            print(f"[eval] {model.label}: scoring through the running vLLM server "
                  f"({running.base_url})", flush=True)
            yield "local-completions", served_model_args(model, running.base_url, settings)
            return
        log = log_dir / f"{model.label}-vllm.log"
        print(f"[eval] {model.label}: starting vLLM (log {_shown(log)})", flush=True)
        with VllmServer(model.path, model.served_name, engine, log) as server:
            yield "local-completions", served_model_args(model, server.base_url, settings)
    else:
        from lm_eval.models.huggingface import HFLM

        yield HFLM(pretrained=str(model.path), dtype=divergence.HF_DTYPE,
                   batch_size=settings.batch_size,
                   device=_device()), None


def score(base_name: str, model: Model, tasks: list[suites.Task], backend: str,
          settings: Settings, force: bool = False, pool: ServerPool | None = None
          ) -> dict[str, TaskResult]:
    """Every task on one model through one backend; cached results are reused."""
    _quiet_libraries()
    results: dict[str, TaskResult] = {}
    todo = []
    for task in tasks:
        target = task_dir(base_name, model, task, backend, settings)
        cached = None if force else TaskResult.load(target)
        if cached:
            results[task.name] = cached
        else:
            todo.append(task)
    tag = f"{model.label} ({backend})"
    if not todo:
        print(f"[eval] {tag}: all {len(tasks)} task(s) up to date (cached; FORCE=1 redoes them)")
        return results
    if results:
        print(f"[eval] {tag}: {len(results)} task(s) cached, {len(todo)} to score")
    with _lm(model, backend, settings, cache_root(base_name) / "logs", pool) as (lm, model_args):
        for number, task in enumerate(todo, start=1):
            limit = settings.for_task(task)["limit"]
            print(f"[eval] {tag}: task {number}/{len(todo)} {task.name}"
                  f"{f' (limit {limit})' if limit else ''} ...", flush=True)
            target = task_dir(base_name, model, task, backend, settings)
            result = run_task(lm, model_args, model, task, backend, settings, target)
            key = primary_key(task, result)
            print(f"[eval] {tag}: {task.name} {key} = {result.metrics.get(key, float('nan')):.4f} "
                  f"({result.seconds:.0f} s)", flush=True)
            results[task.name] = result
    return {t.name: results[t.name] for t in tasks}


def score_variant(base_name: str, model: Model, tasks: list[suites.Task], settings: Settings,
                  force: bool = False, pool: ServerPool | None = None
                  ) -> tuple[str, dict[str, TaskResult]]:
    """Served when vLLM serves this format here (or ``--backend``), else emulated."""
    from pipeline.serve.server import UnsupportedFormat, known_refusal, remember_refusal

    if settings.backend == "hf":
        return EMULATED, score(base_name, model, tasks, EMULATED, settings, force)
    known = known_refusal(model.identity)
    if settings.backend == "auto" and known and not force:
        print(f"[eval] {model.label}: vLLM cannot serve it here ({known}); scoring "
              "with lm-eval's hf backend on de-compressed weights (emulated)")
        return EMULATED, score(base_name, model, tasks, EMULATED, settings, force)
    try:
        return SERVED, score(base_name, model, tasks, SERVED, settings, force, pool)
    except UnsupportedFormat as err:
        if settings.backend == "served":
            raise
        reason = err.reason
        remember_refusal(model.identity, reason)
        print(f"[eval] {model.label}: vLLM cannot serve it here ({reason}); scoring with "
              "lm-eval's hf backend on de-compressed weights (emulated)")
        return EMULATED, score(base_name, model, tasks, EMULATED, settings, force)


# ---------------------------------------------------------------------------- recovery


def metric_name(task: str, key: str) -> str:
    """MLflow name of a task score: ``app_facts.acc``, ``qpipe_gsm8k.exact_match/strict-match``."""
    metric, _, flt = key.partition(",")
    name = f"{task}.{metric}" + (f"/{flt}" if flt and flt != "none" else "")
    return re.sub(r"[^\w\-./ ]", "_", name)  # the characters MLflow allows


def compare(tasks: list[suites.Task], base: dict[str, TaskResult], var: dict[str, TaskResult]
            ) -> dict[str, dict[str, recovery.Recovery]]:
    """Task -> metric key -> recovery, from paired per-item results."""
    out: dict[str, dict[str, recovery.Recovery]] = {}
    for task in tasks:
        b, v = base[task.name], var[task.name]
        out[task.name] = {}
        for key, b_items in b.per_item.items():
            v_items = v.per_item.get(key, {})
            ids = sorted(set(b_items) & set(v_items), key=int)
            if not ids:
                continue
            out[task.name][key] = recovery.recovery(
                [b_items[i] for i in ids], [v_items[i] for i in ids], b.chance.get(key, 0.0))
    return out


def primary_key(task: suites.Task, result: TaskResult) -> str:
    if task.primary_metric in result.per_item:
        return task.primary_metric
    return next(iter(result.per_item), task.primary_metric)


def suite_figures(tasks: list[suites.Task],
                  recoveries: dict[str, dict[str, recovery.Recovery]]
                  ) -> dict[str, recovery.SuiteRecovery]:
    """Suite -> mean of its tasks' recoveries (primary metric, MOVER interval), and ``*`` for
    all of them when there are several suites."""
    groups: dict[str, list[suites.Task]] = {}
    for task in tasks:
        groups.setdefault(task.suite, []).append(task)
    if len(groups) > 1:
        groups["*"] = tasks
    out = {}
    for suite, members in groups.items():
        chosen = {}
        for task in members:
            by_key = recoveries.get(task.name, {})
            key = task.primary_metric if task.primary_metric in by_key else next(iter(by_key),
                                                                                 None)
            if key is not None:
                chosen[task.name] = by_key[key]
        out[suite] = recovery.suite_from_tasks(chosen)
    return out


# ---------------------------------------------------------------------------- reporting


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(model: Model, backend: str, tasks: list[suites.Task],
                 recoveries: dict[str, dict[str, recovery.Recovery]],
                 figures: dict[str, recovery.SuiteRecovery],
                 div: divergence.Divergence | None) -> None:
    mark = " [emulated: hf backend, de-compressed weights]" if backend == EMULATED else ""
    print(f"\n{model.label} vs baseline, both {backend}{mark}")
    print(f"  {'task':14s} {'metric':28s} {'base':>6s} {'variant':>7s} {'recovery':>9s} "
          f"{'95% CI':>15s} {'flips':>9s} {'n certifies':>11s}")
    for task in tasks:
        for key, r in recoveries[task.name].items():
            if r.meaningful:
                rec = f"{_fmt(r.recovery_pct)}%"
                ci = f"[{_fmt(r.ci_low)}, {_fmt(r.ci_high)}]"
            else:
                rec, ci = "not meaningful", f"(chance {r.chance:.2f})"
            flips = f"{r.flips}/{r.n}"
            best = f"{_fmt(r.certifiable_pct)}%" if r.meaningful else "-"
            print(f"  {task.name:14s} {key:28s} {r.baseline_score:6.3f} {r.variant_score:7.3f} "
                  f"{rec:>9s} {ci:>15s} {flips:>9s} {best:>9s}")
    for suite, fig in figures.items():
        name = "all suites" if suite == "*" else f"suite {suite}"
        if fig.recovery_pct is None:
            print(f"  {name}: not meaningful (no task above chance)")
        else:
            skipped = f"; not meaningful: {', '.join(fig.skipped)}" if fig.skipped else ""
            print(f"  {name}: {_fmt(fig.recovery_pct)}% [{_fmt(fig.ci_low)}, "
                  f"{_fmt(fig.ci_high)}] = mean of the recoveries of {', '.join(fig.tasks)}"
                  f" ({fig.items} items can certify at best {_fmt(fig.certifiable_pct)}%)"
                  f"{skipped}")
    if div is not None:
        print(f"  held-out text ({div.tokens} tokens, {divergence.BACKEND}): KL "
              f"{div.kl_div_mean:.4f} nats/token, top-1 agreement {div.top1_agreement:.3f}, "
              f"perplexity {div.perplexity:.2f} (baseline {div.baseline_perplexity:.2f})")


def write_summary(base: baselines.Baseline, model: Model, backend: str,
                  tasks: list[suites.Task], recoveries: dict[str, dict[str, recovery.Recovery]],
                  results: dict[str, TaskResult], div: divergence.Divergence | None) -> Path:
    """This run's tasks into ``artifacts/evals/<baseline>/<recipe>/recovery.json`` (the gate's
    input). Each task carries what it was scored on (checkpoint, baseline, task file, backend,
    settings): results of an older checkpoint are dropped here, and the gate judges only those
    that are still current. Suite figures are computed from the tasks when read."""
    target = cache_root(base.name) / model.label / SUMMARY_FILE
    old = read_json(target)
    kept = {name: entry for name, entry in old.get("tasks", {}).items()
            if entry.get("identity") == model.identity}
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for task in tasks:
        key = primary_key(task, results[task.name])
        kept[task.name] = {
            "suite": task.suite, "backend": backend, "primary_metric": key, "updated": now,
            "identity": model.identity, "baseline_identity": base.identity,
            "task_sha": task.sha256, "settings": results[task.name].settings,
            "command": results[task.name].command,
            "recovery": {k: r.as_dict() for k, r in recoveries[task.name].items()}}
    summary: dict[str, Any] = {"baseline": base.name, "recipe": model.recipe,
                               "identity": model.identity, "tasks": kept,
                               "hardware": hardware.profile().as_dict()}
    if div is not None:
        summary["divergence"] = {**div.as_dict(), "backend": divergence.BACKEND,
                                 "identity": model.identity}
    elif old.get("divergence", {}).get("identity") == model.identity:
        summary["divergence"] = old["divergence"]
    write_json_atomic(target, summary)
    (target.parent / FAILURE_FILE).unlink(missing_ok=True)
    return target


def write_failure(base_name: str, model: Model, err: QpipeError) -> dict[str, Any]:
    """Record that scoring ``model`` failed; compare and gate show it, the rest go on."""
    failure = {"identity": model.identity, "reason": str(err), "stage": STAGE,
               "hardware": hardware.profile().describe(),
               "when": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_json_atomic(cache_root(base_name) / model.label / FAILURE_FILE, failure)
    return failure


def _scores(tasks: list[suites.Task], results: dict[str, TaskResult]) -> dict[str, float]:
    out = {}
    for task in tasks:
        for key, value in results[task.name].metrics.items():
            metric, _, flt = key.partition(",")
            if metric.endswith("_stderr"):
                out[metric_name(task.name, f"{metric[:-7]},{flt}") + "_stderr"] = value
            else:
                out[metric_name(task.name, key)] = value
    return out


def log_mlflow(base: baselines.Baseline, model: Model, backend: str, tasks: list[suites.Task],
               results: dict[str, TaskResult],
               recoveries: dict[str, dict[str, recovery.Recovery]] | None,
               figures: dict[str, recovery.SuiteRecovery] | None,
               div: divergence.Divergence | None, summary: Path | None,
               settings: Settings) -> str | None:
    """One run per model and backend; skipped when an identical run is recorded."""
    keys = sorted(Path(r.directory).name for r in results.values())
    run_key = hashlib.sha256(json.dumps([model.identity, backend, keys, div and div.as_dict()],
                                        sort_keys=True).encode()).hexdigest()[:16]
    if tracking.find_run(base.name, STAGE, run_key):
        print(f"[eval] {model.label} ({backend}): already recorded in MLflow")
        return None
    metrics = _scores(tasks, results)
    not_meaningful = []
    for task in tasks:
        for key, r in (recoveries or {}).get(task.name, {}).items():
            suffix = "" if key == primary_key(task, results[task.name]) else \
                "." + metric_name(task.name, key).split(".", 1)[1]
            name = re.sub(r"[^\w\-./ ]", "_", f"{task.name}{suffix}")
            metrics[tracking.FLIP_RATE_PREFIX + name] = r.flip_rate
            metrics[tracking.FLIPS_PREFIX + name] = r.flips
            if r.recovery_pct is None:
                not_meaningful.append(name)
                continue
            metrics[tracking.RECOVERY_PREFIX + name] = r.recovery_pct
            if r.ci_low is not None:
                metrics[tracking.RECOVERY_CI_LOW_PREFIX + name] = r.ci_low
                metrics[tracking.RECOVERY_CI_HIGH_PREFIX + name] = r.ci_high
    for suite, fig in (figures or {}).items():
        if fig.recovery_pct is None:
            continue
        if suite == "*" or len(figures or {}) == 1:
            metrics[tracking.RECOVERY_PCT] = fig.recovery_pct
            metrics[tracking.RECOVERY_PCT_CI_LOW] = fig.ci_low
            metrics[tracking.RECOVERY_PCT_CI_HIGH] = fig.ci_high
        if suite != "*":
            metrics[tracking.SUITE_RECOVERY_PREFIX + suite] = fig.recovery_pct
    if div is not None:
        if model.recipe is not None:
            metrics[tracking.KL_DIV_MEAN] = div.kl_div_mean
            metrics[tracking.TOP1_AGREEMENT] = div.top1_agreement
        metrics[tracking.PERPLEXITY] = div.perplexity
    params: dict[str, Any] = {
        tracking.PARAM_BASELINE: base.name, tracking.PARAM_RECIPE: model.recipe or "none",
        "suites": ",".join(sorted({t.suite for t in tasks})),
        "tasks": ",".join(t.name for t in tasks),
        "lm_eval": metadata.version("lm_eval"), "seeds": json.dumps(SEEDS),
        "batch_size": settings.batch_size,
        tracking.PARAM_HARDWARE: hardware.profile().describe()[:500]}
    if backend == SERVED:
        params["num_concurrent"] = settings.num_concurrent
    for task in tasks:
        s = results[task.name].settings
        params[f"limit.{task.name}"] = s.get("limit") if s.get("limit") is not None else "all"
        params[f"num_fewshot.{task.name}"] = s.get("num_fewshot_used")
    tags = {tracking.TAG_EVAL_BACKEND: backend, tracking.TAG_CACHE_KEY: run_key,
            "qpipe.model_identity": model.identity,
            tracking.TAG_HARDWARE_KEY: hardware.profile().key()}
    if div is not None:
        tags[tracking.TAG_DIVERGENCE_BACKEND] = f"{divergence.BACKEND} on {divergence.device()}"
    if not_meaningful:
        tags[tracking.TAG_NOT_MEANINGFUL] = ",".join(not_meaningful)
    name = f"eval:{model.label}" + (" (emulated)" if backend == EMULATED else "")
    with tempfile.TemporaryDirectory() as tmp:
        # one file name per task: MLflow keeps artifacts by file name
        artifacts = []
        for r in results.values():
            for src, dst in ((f"samples_{r.task}.jsonl", f"samples_{r.task}.jsonl"),
                             ("results.json", f"results_{r.task}.json")):
                shutil.copyfile(Path(r.directory) / src, Path(tmp) / dst)
                artifacts.append(Path(tmp) / dst)
        if summary is not None:
            artifacts.append(summary)
        run_id = tracking.log_run(base.name, STAGE, name, params, metrics, tags, artifacts)
    print(f"[eval] {model.label} ({backend}): recorded in MLflow, run {run_id}")
    return run_id


# ---------------------------------------------------------------------------- the command


def resolve_tasks(suite_names: list[str] | None, task_names: list[str] | None) -> list[suites.Task]:
    """Tasks from evals/ by suite or name; other names pass through as lm-eval built-ins."""
    if not task_names:
        return suites.select(suite_names)
    local = {t.name: t for ts in suites.discover().values() for t in ts}
    out = []
    for name in task_names:
        if name in local:
            out.append(local[name])
        else:
            out.append(suites.Task(name=name, suite="lm-eval", path=Path(), config={},
                                   data_files={}, sha256=suites.builtin_task_sha(name),
                                   default_limit=None,
                                   primary_metric=""))
    return out


def _score_baseline(base: baselines.Baseline, model: Model, tasks: list[suites.Task],
                    backend: str, settings: Settings, force: bool, pool: ServerPool | None
                    ) -> dict[str, TaskResult]:
    from pipeline.serve.server import UnsupportedFormat

    try:
        return score(base.name, model, tasks, backend, settings, force, pool)
    except UnsupportedFormat as err:
        raise EvalError(f"the baseline {base.name} cannot be served by vLLM here, so the served "
                        f"variants have nothing to be compared with: {err} Fix: score everything "
                        "with BACKEND=hf (qpipe eval --backend hf).") from None


def _divergences(base: baselines.Baseline, variants: list[Model]
                 ) -> dict[Path, divergence.Divergence]:
    """Held-out divergence of each variant (and the baseline's own perplexity), cached per
    model identity, held-out text and dtype."""
    div_dir = cache_root(base.name) / "divergence"
    # the figures depend on the text and on the dtype the models ran in
    text = (f"{divergence.text_hash(divergence.heldout_text())}-{divergence.HF_DTYPE}-"
            f"{divergence.device()}")
    caches = {base.path: div_dir / f"{base.identity}-self-{text}.json",
              **{m.path: div_dir / f"{m.identity}-vs-{base.identity}-{text}.json"
                 for m in variants}}
    todo = sum(not cache.is_file() for cache in caches.values())
    if todo:
        print(f"[eval] divergence on held-out text ({_shown(divergence.HELDOUT)}, on "
              f"{divergence.device()}): {todo} model(s) against the baseline ...", flush=True)
    return divergence.measure_all(base.path, caches)


def evaluate(base: baselines.Baseline, variants: list[Model], tasks: list[suites.Task],
             settings: Settings, force: bool = False, with_divergence: bool = True,
             track: bool = True, pool: ServerPool | None = None) -> dict[str, dict[str, Any]]:
    """Score, compare and record; returns label -> {backend, results, recoveries, figures}.

    A ``pool`` (a campaign's) lends servers its bench stage left running.
    """
    from pipeline.serve.server import ServeError

    tasks = suites.prepare_for(tasks)
    base_model = baseline_model(base)
    scored: dict[str, tuple[str, dict[str, TaskResult]]] = {}
    report: dict[str, dict[str, Any]] = {}
    for number, model in enumerate(variants, start=1):
        print(f"[eval] variant {number}/{len(variants)}: {model.label} ({len(tasks)} task(s))")
        try:
            scored[model.label] = score_variant(base.name, model, tasks, settings, force, pool)
        except (EvalError, ServeError) as err:  # one variant never sinks the others
            print(f"[eval] {model.label}: FAILED, the other variants go on: {err}", flush=True)
            report[model.label] = {"failed": write_failure(base.name, model, err)}
    variants = [m for m in variants if m.label in scored]
    backends = sorted({b for b, _ in scored.values()}) or [
        EMULATED if settings.backend == "hf" else SERVED]
    base_results = {b: _score_baseline(base, base_model, tasks, b, settings, force, pool)
                    for b in backends}
    divs = _divergences(base, variants) if with_divergence else {}
    base_div = divs.get(base.path)
    for backend, results in base_results.items():
        if track:
            log_mlflow(base, base_model, backend, tasks, results, None, None, base_div, None,
                       settings)
        report[f"baseline ({backend})"] = {"backend": backend, "results": results}
    for model in variants:
        backend, results = scored[model.label]
        recoveries = compare(tasks, base_results[backend], results)
        figures = suite_figures(tasks, recoveries)
        div = divs.get(model.path)
        print_report(model, backend, tasks, recoveries, figures, div)
        summary = write_summary(base, model, backend, tasks, recoveries, results, div)
        if track:
            log_mlflow(base, model, backend, tasks, results, recoveries, figures, div, summary,
                       settings)
        report[model.label] = {"backend": backend, "results": results, "recoveries": recoveries,
                               "figures": figures, "divergence": div, "summary": summary}
    print("\nreproduce a score by hand (from the project root; docs/evals.md):")
    for backend, results in base_results.items():
        if backend == SERVED:
            print(f"  {serve_command(base_model, settings)} &")
        print(f"  {results[tasks[0].name].command}")
    return report


def parse_limit(value: str) -> int | str:
    """``--limit``: a positive number of items per task, or ``all``."""
    if value == "all":
        return value
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise argparse.ArgumentTypeError(
        f"{value!r}: give a positive number of items (LIMIT=50) or `all`, or leave it empty for "
        "each task's default")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    baselines.add_baseline_argument(parser)
    parser.add_argument("--recipe", action="append",
                        help="a variant to score (repeatable; default: every variant on disk)")
    parser.add_argument("--suite", action="append",
                        help="a suite folder under evals/ (repeatable; default: every suite)")
    parser.add_argument("--task", action="append",
                        help="a task by name (repeatable); names not in evals/ go to lm-eval's "
                             "built-in tasks (need their dataset hub)")
    parser.add_argument("--limit", type=parse_limit,
                        help="items per task, or `all` (default: each task's qpipe_limit, "
                             "else all)")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples (default: the task's)")
    parser.add_argument("--backend", choices=["auto", "served", "hf"], default="auto",
                        help="auto: served where vLLM serves the format, else hf (emulated)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="hf: sequences per forward pass; served: prompts per request")
    parser.add_argument("--num-concurrent", type=int, default=2,
                        help="requests in flight to the vLLM server")
    add_engine_arguments(parser)  # the same engine settings as bench's (a campaign passes both)
    parser.add_argument("--no-divergence", action="store_true",
                        help="skip KL divergence / top-1 agreement / perplexity")
    parser.add_argument("--force", action="store_true", help="re-score even if cached")
    parser.set_defaults(servers=None)  # a campaign passes its ServerPool here


def run(args: argparse.Namespace) -> int:
    tracking.check_store()  # seconds, before the work: not minutes after it
    base = baselines.resolve(args.baseline)
    recipes = [r for r in args.recipe or [] if r != "none"]
    variants = [] if args.recipe == ["none"] else variant_models(base, recipes or None)
    settings = Settings(limit=args.limit, num_fewshot=args.num_fewshot,
                        batch_size=args.batch_size, num_concurrent=args.num_concurrent,
                        backend=args.backend, engine=engine_settings_from(args))
    tasks = resolve_tasks(args.suite, args.task)
    if not variants:
        print(f"[eval] no variant of {base.name} on disk: scoring the baseline only "
              "(make quantize makes the variants)")
    report = evaluate(base, variants, tasks, settings, force=args.force,
                      with_divergence=not args.no_divergence, pool=args.servers)
    failed = {label: r["failed"] for label, r in report.items() if "failed" in r}
    if failed:
        print("[eval] failed: " + "; ".join(f"{label}: {f['reason']}"
                                            for label, f in failed.items()), file=sys.stderr)
        return 1
    return 0
