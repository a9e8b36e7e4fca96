"""A campaign (``make all``): quantize -> bench -> eval -> compare for every recipe, one MLflow
parent run with a child per variant at the end.

One runner, two executors: the runner decides what runs (each stage's settings, from the
campaign file and the command line) and in what order; the executor decides where
(``local``: this machine, pipeline/campaign/local.py; ``ray``: a Ray cluster,
pipeline/campaign/on_ray.py). Every stage reuses what it measured before, so a re-run with
nothing changed finishes in seconds. One variant never sinks a campaign: a recipe that fails to
quantize is left out of bench and eval, bench and eval record a failing variant and go on, and a
stage that fails as a whole is recorded; the comparison shows every failure, and the campaign
then exits 1 naming them (a hardware limit, "unsupported", is not a failure).
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol

from pipeline import bench, report
from pipeline import eval as evaluation
from pipeline.bench import workloads as bench_loads
from pipeline.campaign import files
from pipeline.campaign.jobs import Steps
from pipeline.campaign.local import Local
from pipeline.campaign.on_ray import Ray
from pipeline.campaign.settings import CampaignSettings
from pipeline.core import log as qlog
from pipeline.core import paths, tracking
from pipeline.core.artifacts import Comparison, Failure
from pipeline.core.errors import QpipeError
from pipeline.quantize import baseline as baselines
from pipeline.quantize import recipes
from pipeline.quantize.settings import QuantizeSettings

log = qlog.get("all")


class CampaignIncomplete(QpipeError):
    """Every stage ran, but a variant failed for a reason other than a hardware limit."""

    exit_code = 1


class Stages(NamedTuple):
    """The settings of every stage a campaign runs, in order."""

    quantize: list[QuantizeSettings]
    bench: bench.BenchSettings | None  # None: the campaign benches nothing
    eval: evaluation.EvalSettings


class Executor(Protocol):
    """Where a campaign's stages run."""

    def steps(self, recipes: int, benches: bool) -> int: ...

    def quantize(self, todo: list[QuantizeSettings], base: baselines.Baseline,
                 clock: Steps) -> list[Failure]: ...

    def measure(self, recipes: tuple[str, ...], bench_settings: bench.BenchSettings | None,
                eval_settings: evaluation.EvalSettings, clock: Steps) -> list[Failure]: ...


def stages(settings: CampaignSettings, file: files.CampaignFile,
           base: baselines.Baseline | None = None) -> Stages:
    """The settings of every stage. The engine settings go to every stage that starts vLLM
    servers (bench and eval: one configuration for the campaign). Without recipes named, every
    recipe in recipes/, but, given ``base``, not one searched for another model."""
    recipes = list(file.recipes) or [r for r in paths.yaml_names(paths.RECIPES_DIR)
                                      if base is None or _for_this_baseline(r, base)]
    quantize = [QuantizeSettings(baseline=settings.baseline, recipe=r, force=settings.force,
                                 calibration=settings.calibration) for r in recipes]
    bench_settings = bench.BenchSettings(
        baseline=settings.baseline, recipes=tuple(recipes),
        workloads=files.bench_workloads(file, _is_search), repeats=file.repeats,
        force=settings.force, engine=settings.engine, **settings.bench_only()) \
        if file.workloads else None  # no workloads: no bench (e.g. no serving environment)
    eval_settings = evaluation.EvalSettings(
        baseline=settings.baseline, recipes=tuple(recipes), suites=file.suites,
        limit=file.limit, backend=file.backend, divergence=file.divergence,
        force=settings.force, engine=settings.engine)
    return Stages(quantize, bench_settings, eval_settings)


def _is_search(workload: str) -> bool:
    return bench_loads.load(workload).slo is not None


def _for_this_baseline(recipe: str, base: baselines.Baseline) -> bool:
    searched_for = recipes.load(recipe, paths.RECIPES_DIR).searched_for
    if searched_for and searched_for != base.identity:
        log.info(f"recipe {recipe}: left out, searched for another baseline ({searched_for})")
        return False
    return True


def executor_for(settings: CampaignSettings) -> Executor:
    if settings.executor == "ray":
        return Ray(settings.ray_address, settings.ray_resources, settings.engine)
    return Local(settings.quantize_jobs)


def run(settings: CampaignSettings) -> Comparison:
    """``qpipe campaign`` / ``make all``: its stage runs are nested under its MLflow run."""
    with tracking.campaign_scope():
        return _run(settings)


def _run(settings: CampaignSettings) -> Comparison:
    file = settings.file()
    if settings.track:
        tracking.check_store()  # seconds now, not minutes after the work
    base = baselines.resolve(settings.baseline)
    todo = stages(settings, file, base)
    executor = executor_for(settings)
    clock = Steps(executor.steps(len(todo.quantize), todo.bench is not None) + 1)  # + compare
    log.info(f"campaign {file.name} ({file.path}): {file.description}")
    failures = executor.quantize(todo.quantize, base, clock)
    lost = {f.variant for f in failures}
    left = tuple(q.recipe for q in todo.quantize if q.recipe not in lost)
    if lost and not left:
        log.info("bench and eval: skipped, no recipe left to measure")
    else:
        failures += executor.measure(left, todo.bench, todo.eval, clock)
    clock.next("compare")
    comparison, _ = report.compare_and_log(base, list(left), file.plan, file.name,
                                           settings.track, failures, file.objective,
                                           file.cost, per_variant=settings.executor == "ray",
                                           threshold=file.threshold,
                                           seconds=time.monotonic() - clock.started)
    if comparison.failures:
        raise CampaignIncomplete(
            f"finished in {clock.elapsed()}, but {len(comparison.failures)} failure(s) not due "
            "to a hardware limit: " + "; ".join(
                f"{f.variant} in {f.stage}: {f.reason[:400]}"
                + (f" (log {f.log})" if f.log else "") + f" (re-run: {f.rerun()})"
                for f in comparison.failures)
            + ". The other variants were measured, compared and logged.")
    log.info(f"done in {clock.elapsed()}")
    return comparison
