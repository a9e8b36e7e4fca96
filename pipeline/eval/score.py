"""Scoring with a cache: every task on one model through one backend, reused when unchanged.

Results are cached per (model identity, task file + data, backend, settings and, served, the
engine and hardware) under ``artifacts/evals/<baseline>/cache/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core import hardware
from pipeline.core import log as qlog
from pipeline.core.artifacts import RecoverySummary
from pipeline.core.provenance import content_key
from pipeline.core.variant import Variant
from pipeline.eval import divergence, suites
from pipeline.eval.lm import (
    EMULATED,
    SERVED,
    EvalError,
    TaskResult,
    engine_for,
    not_decompressible,
    open_lm,
    primary_key,
    quiet_libraries,
    run_task,
    served_failure,
)
from pipeline.eval.settings import EvalSettings
from pipeline.serve import UnsupportedFormat, known_refusal, remember_refusal

if TYPE_CHECKING:
    from pipeline.serve import ServerPool

log = qlog.get("eval")


def cache_root(base_name: str) -> Path:
    return RecoverySummary.root(base_name)


def task_key(model: Variant, task: suites.Task, backend: str, settings: EvalSettings) -> str:
    payload = {"model": model.identity, "task": task.name, "task_sha": task.sha256,
               "backend": backend, "settings": settings.for_task(task),
               "batch_size": settings.batch_size,
               "engine": _engine_settings(settings, model) if backend == SERVED else None,
               # served numerics follow the kernels this hardware runs
               "hardware": hardware.profile().key() if backend == SERVED else None,
               "hf_dtype": divergence.hf_dtype() if backend == EMULATED else None}
    return content_key(payload)


def task_dir(base_name: str, model: Variant, task: suites.Task, backend: str,
             settings: EvalSettings) -> Path:
    key = task_key(model, task, backend, settings)
    return cache_root(base_name) / "cache" / model.identity / f"{backend}-{task.name}-{key}"


def _engine_settings(settings: EvalSettings, model: Variant) -> dict[str, Any]:
    engine = engine_for(model, settings).as_params()
    engine.pop("engine.enable_prefix_caching", None)  # scores do not depend on it
    return {**engine, "num_concurrent": settings.num_concurrent}


def score(base_name: str, model: Variant, tasks: list[suites.Task], backend: str,
          settings: EvalSettings, force: bool = False, pool: ServerPool | None = None
          ) -> dict[str, TaskResult]:
    """Every task on one model through one backend; cached results are reused."""
    quiet_libraries()
    results: dict[str, TaskResult] = {}
    todo = []
    for task in tasks:
        target = task_dir(base_name, model, task, backend, settings)
        cached = None if force else TaskResult.load(target)
        if cached:
            results[task.name] = cached
        else:
            todo.append(task)
    tag = f"{model.name} ({backend})"
    if not todo:
        log.info(f"{tag}: all {len(tasks)} task(s) up to date (cached; FORCE=1 redoes them)")
        return results
    if results:
        log.info(f"{tag}: {len(results)} task(s) cached, {len(todo)} to score")
    with open_lm(model, backend, settings, cache_root(base_name) / "logs", pool) as (
            lm, model_args, server):
        for number, task in enumerate(todo, start=1):
            limit = settings.for_task(task)["limit"]
            log.info(f"{tag}: task {number}/{len(todo)} {task.name}"
                     f"{f' (limit {limit})' if limit else ''} ...")
            target = task_dir(base_name, model, task, backend, settings)
            try:
                result = run_task(lm, model_args, model, task, backend, settings, target)
            except EvalError as err:
                lost = served_failure(server, task, err) if server is not None else None
                if lost is not None:
                    raise lost from err
                if backend == EMULATED and (unscoreable := not_decompressible(model, err)):
                    raise unscoreable from err
                raise
            key = primary_key(task, result)
            log.info(f"{tag}: {task.name} {key} = {result.metrics.get(key, float('nan')):.4f} "
                     f"({result.seconds:.0f} s)")
            results[task.name] = result
    return {t.name: results[t.name] for t in tasks}


def score_variant(base_name: str, model: Variant, tasks: list[suites.Task], settings: EvalSettings,
                  force: bool = False, pool: ServerPool | None = None, emulate: bool = True
                  ) -> tuple[str, dict[str, TaskResult]] | None:
    """Served when vLLM serves this format here (or ``--backend``), else emulated.
    ``emulate=False``: None where it is to be emulated, for the caller to score after every
    served model (a model loaded in this process holds GPU memory a vLLM server then needs)."""
    if settings.backend == "hf":
        return score_emulated(base_name, model, tasks, settings, force) if emulate else None
    known = known_refusal(model.identity)
    if settings.backend == "auto" and known and not force:
        log.info(f"{model.name}: vLLM cannot serve it here ({known}); scoring "
                 "with lm-eval's hf backend on de-compressed weights (emulated)")
        return score_emulated(base_name, model, tasks, settings, force) if emulate else None
    try:
        return SERVED, score(base_name, model, tasks, SERVED, settings, force, pool)
    except UnsupportedFormat as err:
        if settings.backend == "served":
            raise
        reason = err.reason
        remember_refusal(model.identity, reason)
        log.info(f"{model.name}: vLLM cannot serve it here ({reason}); scoring with "
                 "lm-eval's hf backend on de-compressed weights (emulated)")
        return score_emulated(base_name, model, tasks, settings, force) if emulate else None


def score_emulated(base_name: str, model: Variant, tasks: list[suites.Task],
                   settings: EvalSettings, force: bool = False
                   ) -> tuple[str, dict[str, TaskResult]]:
    return EMULATED, score(base_name, model, tasks, EMULATED, settings, force)
