"""From scores to recovery: per task and suite, the terminal report, ``recovery.json`` and the
MLflow run of each model."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.core import hardware, tracking
from pipeline.core import log as qlog
from pipeline.core.artifacts import (
    UNSUPPORTED,
    EvalFailure,
    RecoverySummary,
    SuiteFigure,
    TaskEntry,
)
from pipeline.core.errors import QpipeError
from pipeline.core.provenance import content_key
from pipeline.core.variant import Variant
from pipeline.eval import divergence, recovery, suites
from pipeline.eval.lm import EMULATED, SERVED, NotDecompressible, TaskResult, primary_key
from pipeline.eval.settings import SEEDS, EvalSettings
from pipeline.quantize import baseline as baselines

log = qlog.get("eval")
STAGE = "eval"




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


def run_suite_figures(tasks: list[suites.Task],
                      recoveries: dict[str, dict[str, recovery.Recovery]]
                      ) -> dict[str, SuiteFigure]:
    """This eval run's figures, as it prints and logs them: suite -> mean of its tasks'
    recoveries (primary metric, MOVER interval), and ``*`` for all of them when there are
    several suites. (What the gate and the report judge is :func:`pipeline.eval.gate.
    suite_figures`, over the recorded entries still current.)"""
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


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(model: Variant, backend: str, tasks: list[suites.Task],
                 recoveries: dict[str, dict[str, recovery.Recovery]],
                 figures: dict[str, SuiteFigure],
                 div: divergence.Divergence | None) -> None:
    mark = " [emulated: hf backend, de-compressed weights]" if backend == EMULATED else ""
    print(f"\n{model.name} vs baseline, both {backend}{mark}")
    print(f"  {'task':14s} {'metric':28s} {'base':>6s} {'variant':>7s} {'recovery':>9s} "
          f"{'95% CI':>15s} {'flips':>9s} {'n certifies':>11s} {'above chance':>12s}")
    for task in tasks:
        for key, r in recoveries[task.name].items():
            if r.meaningful:
                rec = f"{_fmt(r.recovery_pct)}%"
                ci = f"[{_fmt(r.ci_low)}, {_fmt(r.ci_high)}]"
            else:
                rec, ci = "not meaningful", f"(chance {r.chance:.2f})"
            flips = f"{r.flips}/{r.n}"
            best = f"{_fmt(r.certifiable_pct)}%" if r.meaningful else "-"
            skill = f"{_fmt(r.above_chance_pct)}%" if r.above_chance_pct is not None else "-"
            print(f"  {task.name:14s} {key:28s} {r.baseline_score:6.3f} {r.variant_score:7.3f} "
                  f"{rec:>9s} {ci:>15s} {flips:>9s} {best:>11s} {skill:>12s}")
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


def write_summary(base: baselines.Baseline, model: Variant, backend: str,
                  tasks: list[suites.Task], recoveries: dict[str, dict[str, recovery.Recovery]],
                  results: dict[str, TaskResult], div: divergence.Divergence | None) -> Path:
    """This run's tasks into ``recovery.json`` (the gate's input). Each task carries what it
    was scored on (checkpoint, baseline, task file, backend, settings): results of an older
    checkpoint are dropped here, and the gate judges only those that are still current. Suite
    figures are computed from the tasks when read."""
    path = RecoverySummary.path(base.name, model.name)
    old = RecoverySummary.read(path)
    kept = {name: entry for name, entry in (old.tasks if old else {}).items()
            if entry.identity == model.identity}
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for task in tasks:
        result = results[task.name]
        kept[task.name] = TaskEntry(
            suite=task.suite, backend=backend, primary_metric=primary_key(task, result),
            updated=now, identity=model.identity, baseline_identity=base.identity,
            task_sha=task.sha256, settings=result.settings, command=result.command,
            recovery=dict(recoveries[task.name]))
    divergence_figures = None
    if div is not None:
        divergence_figures = {**div.as_dict(), "backend": divergence.BACKEND,
                              "identity": model.identity}
    elif old is not None and (old.divergence or {}).get("identity") == model.identity:
        divergence_figures = old.divergence
    RecoverySummary(baseline=base.name, recipe=model.recipe, identity=model.identity,
                    tasks=kept, hardware=hardware.profile().as_dict(),
                    divergence=divergence_figures).write(path)
    EvalFailure.path(base.name, model.name).unlink(missing_ok=True)
    return path


def write_failure(base_name: str, model: Variant, err: QpipeError) -> EvalFailure:
    """Record that scoring ``model`` failed; compare and gate show it, the rest go on."""
    failure = EvalFailure(identity=model.identity, reason=str(err), stage=STAGE,
                          status=UNSUPPORTED if isinstance(err, NotDecompressible) else "failed",
                          hardware=hardware.profile().describe(),
                          when=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    failure.write(EvalFailure.path(base_name, model.name))
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


def log_mlflow(base: baselines.Baseline, model: Variant, backend: str, tasks: list[suites.Task],
               results: dict[str, TaskResult],
               recoveries: dict[str, dict[str, recovery.Recovery]] | None,
               figures: dict[str, SuiteFigure] | None,
               div: divergence.Divergence | None, summary: Path | None,
               settings: EvalSettings) -> str | None:
    """One run per model and backend; skipped when an identical run is recorded."""
    keys = sorted(Path(r.directory).name for r in results.values())
    run_key = content_key([model.identity, backend, keys, div and div.as_dict()])
    if tracking.find_run(base.name, STAGE, run_key):
        log.info(f"{model.name} ({backend}): already recorded in MLflow")
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
    name = f"eval:{model.name}" + (" (emulated)" if backend == EMULATED else "")
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
        run_id = tracking.log_run(base.name, STAGE, name, params, metrics, tags, artifacts,
                                  seconds=sum(r.seconds for r in results.values()),
                                  variant=model.name)
    log.info(f"{model.name} ({backend}): recorded in MLflow, run {run_id}")
    return run_id
