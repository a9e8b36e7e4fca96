"""A campaign (``make all``): quantize -> bench -> eval -> compare for every recipe, one MLflow
parent run with a child per variant at the end.

The stages are called as functions, each with its settings object (the command that runs one
alone is printed from it). Quantizing runs one process per recipe (peak memory is measured per
variant), several at once on a CPU host; bench and eval run in this process and, on a CPU host,
share the vLLM servers. Every stage reuses what it measured before, so a re-run with nothing
changed finishes in seconds. One variant never sinks a campaign: a recipe that fails to quantize
is left out of bench and eval, bench and eval record a failing variant and go on, and a stage
that fails as a whole is recorded; the comparison shows every failure, and the campaign then
exits 1 naming them (a hardware limit, "unsupported", is not a failure).

What a campaign runs is a YAML file in ``configs/campaigns/`` (``default``; ``quick`` for a first
look; ``full`` for GPUs); every field can be overridden on the command line.
"""

from __future__ import annotations

import contextlib
import time
from typing import Literal

from pydantic import Field, PositiveInt

from pipeline import bench, report
from pipeline import eval as evaluation
from pipeline.bench import workloads as bench_loads
from pipeline.core import campaigns, jobs, paths, tracking
from pipeline.core import log as qlog
from pipeline.core.artifacts import Comparison, Manifest
from pipeline.core.campaigns import ObjectiveName
from pipeline.core.errors import ConfigError, QpipeError, TrackingError
from pipeline.core.hardware import serve_target
from pipeline.core.settings import StageSettings, baseline_field, force_field
from pipeline.quantize import baseline as baselines
from pipeline.quantize import parallel
from pipeline.quantize.settings import CalibrationOverrides, QuantizeSettings
from pipeline.quantize.stage import cache_key, is_current, recipe_for
from pipeline.report.settings import CostOverrides
from pipeline.serve import EngineSettings, ServerPool

log = qlog.get("all")


class CampaignIncomplete(QpipeError):
    """Every stage ran, but a variant failed for a reason other than a hardware limit."""

    exit_code = 1


class CampaignSettings(StageSettings):
    """``make all``: a campaign file and what the command line overrides in it."""

    baseline: str = baseline_field()
    campaign: str = Field("default", description="a campaign in configs/campaigns/ or a YAML "
                          "file", json_schema_extra={"make": "CAMPAIGN= or QUICK=1"})
    recipes: tuple[str, ...] = Field((), description="override the campaign's recipes",
                                     json_schema_extra={"flag": "--recipe", "make": "RECIPE"})
    workloads: tuple[str, ...] = Field((), description="override the campaign's workloads",
                                       json_schema_extra={"flag": "--workload",
                                                          "make": "WORKLOAD"})
    repeats: PositiveInt | None = Field(None, description="override the campaign's repeats",
                                        json_schema_extra={"make": "REPEATS"})
    suites: tuple[str, ...] = Field((), description="override the campaign's suites",
                                    json_schema_extra={"flag": "--suite", "make": "SUITE"})
    limit: PositiveInt | Literal["all"] | None = Field(
        None, description="override the campaign's items per task (a number or `all`)",
        json_schema_extra={"make": "LIMIT"})
    objective: ObjectiveName | None = Field(
        None, description="override the campaign's objective", json_schema_extra={
            "make": "OBJECTIVE"})
    slo_ttft_ms: float | None = Field(None, gt=0, description="override the capacity search's "
                                      "TTFT p99 bound (ms)", json_schema_extra={
                                          "make": "SLO_TTFT_MS"})
    slo_itl_ms: float | None = Field(None, gt=0, description="override the capacity search's "
                                     "ITL p99 bound (ms)", json_schema_extra={
                                         "make": "SLO_ITL_MS"})
    cost: CostOverrides = Field(default_factory=CostOverrides,
                                json_schema_extra={"nested": True})
    threshold: float | None = Field(None, gt=0, le=1000, description="override the campaign's "
                                    "gate threshold (percent; default: the campaign file's, else "
                                    "each recipe's)", json_schema_extra={"make": "THRESHOLD"})
    gpu: str | None = Field(None, description="accelerator preset the planner places each "
                            "variant on", json_schema_extra={"make": "PLAN_GPU"})
    context: int | None = Field(None, ge=1, description="tokens per request for planned "
                                "concurrency",
                                json_schema_extra={"make": "PLAN_CONTEXT"})
    force: bool = force_field("redo every stage")
    quantize_jobs: PositiveInt | None = Field(
        None, description="recipes quantized at once (default: one per core on a CPU host, as "
        "memory allows; one on a GPU host)", json_schema_extra={"make": "QUANTIZE_JOBS"})
    calibration: CalibrationOverrides = Field(default_factory=CalibrationOverrides,
                                              json_schema_extra={"nested": True})
    track: bool = Field(True, description="log to MLflow", json_schema_extra={
        "negative": "--no-track", "negative_help": "do not log the comparison to MLflow"})
    engine: EngineSettings = Field(default_factory=EngineSettings,
                                   json_schema_extra={"nested": True})
    executor: Literal["local", "ray"] = Field(
        "local", description="where the stages run: this machine, or the tasks of a Ray cluster "
        "(one per recipe to quantize, one per variant to measure)", json_schema_extra={
            "make": "EXECUTOR"})
    ray_address: str | None = Field(None, description="EXECUTOR=ray: the cluster (default: "
                                    "$RAY_ADDRESS, else a local Ray instance over this node)",
                                    json_schema_extra={"make": "RAY_ADDRESS"})
    ray_resources: str | None = Field(
        None, description="EXECUTOR=ray: custom resources every task asks for, as JSON, e.g. "
        "'{\"h100\": 1}' to pin a node type", json_schema_extra={"make": "RAY_RESOURCES"})

    def file(self) -> campaigns.CampaignFile:
        """The campaign file with this command line's overrides applied."""
        file = campaigns.load(self.campaign).for_target(serve_target())
        overrides = {k: v for k, v in (("recipes", self.recipes), ("workloads", self.workloads),
                                       ("suites", self.suites), ("repeats", self.repeats),
                                       ("limit", self.limit), ("objective", self.objective),
                                       ("threshold", self.threshold))
                     if v}
        plan = file.plan.model_copy(update={k: v for k, v in (("gpu", self.gpu),
                                                               ("context", self.context)) if v})
        return file.model_copy(update={**overrides, "plan": plan,
                                       "cost": self.cost.apply(file.cost)})


def stages(settings: CampaignSettings, file: campaigns.CampaignFile,
           base: baselines.Baseline | None = None
           ) -> tuple[list[QuantizeSettings], bench.BenchSettings | None,
                      evaluation.EvalSettings]:
    """The settings of every stage, in order. The engine settings go to every stage that starts
    vLLM servers (bench and eval: one configuration for the campaign). Without recipes named,
    every recipe in recipes/, but, given ``base``, not one searched for another model."""
    recipes = list(file.recipes) or [r for r in paths.yaml_names(paths.RECIPES_DIR)
                                      if base is None or _for_this_baseline(r, base)]
    quantize = [QuantizeSettings(baseline=settings.baseline, recipe=r, force=settings.force,
                                 calibration=settings.calibration) for r in recipes]
    bench_settings = bench.BenchSettings(
        baseline=settings.baseline, recipes=tuple(recipes),
        workloads=campaigns.bench_workloads(file, _is_search),
        repeats=file.repeats, force=settings.force, engine=settings.engine,
        slo_ttft_ms=settings.slo_ttft_ms, slo_itl_ms=settings.slo_itl_ms) \
        if file.workloads else None  # no workloads: no bench (e.g. no serving environment)
    eval_settings = evaluation.EvalSettings(
        baseline=settings.baseline, recipes=tuple(recipes), suites=file.suites,
        limit=file.limit, backend=file.backend, divergence=file.divergence,
        force=settings.force, engine=settings.engine)
    return quantize, bench_settings, eval_settings


def _is_search(workload: str) -> bool:
    return bench_loads.load(workload).slo is not None


def _for_this_baseline(recipe: str, base: baselines.Baseline) -> bool:
    from pipeline.quantize import recipes

    searched_for = recipes.load(recipe, paths.RECIPES_DIR).searched_for
    if searched_for and searched_for != base.identity:
        log.info(f"recipe {recipe}: left out, searched for another baseline ({searched_for})")
        return False
    return True


def _needs_work(q: QuantizeSettings, base: baselines.Baseline) -> tuple[bool, bool]:
    """(has work to do, calibrates): recipes that calibrate take minutes, data-free seconds."""
    recipe = recipe_for(q)
    current = is_current(Manifest.load(base.name, recipe.name), cache_key(base, recipe))
    return q.force or not current, recipe.calibration is not None


class _Clock:
    def __init__(self, total: int) -> None:
        self.started, self.total, self.step = time.monotonic(), total, 0

    def elapsed(self) -> str:
        return jobs.clock(time.monotonic() - self.started)

    def next(self, label: str, count: int = 1) -> None:
        first, self.step = self.step + 1, self.step + count
        steps = f"{first}-{self.step}" if count > 1 else f"{first}"
        print(f"\n[all {steps}/{self.total}] {label} (elapsed {self.elapsed()})", flush=True)


def _quantize(todo: list[QuantizeSettings], base: baselines.Baseline, wanted: int | None,
              clock: _Clock) -> list[dict[str, str]]:
    checks = {q.recipe: _needs_work(q, base) for q in todo}
    redo = [q for q in todo if checks[q.recipe][0]]
    for q in todo:
        if q not in redo:
            clock.next(f"quantize {q.recipe}")
            log.info(f"quantize {q.recipe}: up to date")
            quantize_run_in_process(q)  # records it in MLflow if a store was down before
    if not redo:
        return []
    at_once = min(len(redo), parallel.slots(base, serve_target(), wanted))
    if at_once > 1:
        tracking.prepare(base.name)  # processes that log at once must not race on a new store
    clock.next(f"{', '.join(f'quantize {q.recipe}' for q in redo)}: {at_once} at a time",
               len(redo))
    # those that calibrate start first: fewer idle slots at the end
    return parallel.quantize_all(sorted(redo, key=lambda q: not checks[q.recipe][1]), at_once)


def quantize_run_in_process(q: QuantizeSettings) -> None:
    from pipeline.quantize import stage as quantize

    quantize.run(q)


def _stage(label: str, command: str, failures: list[dict[str, str]], call: object) -> None:
    """Run one in-process stage; a failure of the whole stage is recorded, not raised (a bad
    setting or an unreachable store is: nothing after it could work)."""
    try:
        call()  # type: ignore[operator]
    except (ConfigError, TrackingError) as err:
        raise QpipeError(f"stage '{label}' failed: {err}\nRe-run it alone: {command}") from err
    except QpipeError as err:
        log.warning(f"stage '{label}' FAILED, going on to the comparison: {err}")
        failures.append({"variant": "all", "stage": label, "reason": str(err), "log": ""})


def run(settings: CampaignSettings) -> Comparison:
    """``qpipe campaign`` / ``make all``: its stage runs are nested under its MLflow run."""
    with tracking.campaign_scope():
        return _run(settings)


def _run(settings: CampaignSettings) -> Comparison:
    file = settings.file()
    if settings.track:
        tracking.check_store()  # seconds now, not minutes after the work
    base = baselines.resolve(settings.baseline)
    quantize, bench_settings, eval_settings = stages(settings, file, base)
    clock = _Clock(2 * len(quantize) + 2 if settings.executor == "ray"  # quantize, baseline
                   else len(quantize) + (bench_settings is not None) + 2)  # scores, measure
    log.info(f"campaign {file.name} ({file.path}): {file.description}")
    if settings.executor == "ray":
        failures, left = _on_ray(settings, base, quantize, bench_settings, eval_settings, clock)
    else:
        failures, left = _locally(settings, base, quantize, bench_settings, eval_settings, clock)
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
                f"{f['variant']} in {f['stage']}: {f['reason'][:400]}"
                + (f" (log {f['log']})" if f.get("log") else "") + f" (re-run: {_rerun(f)})"
                for f in comparison.failures)
            + ". The other variants were measured, compared and logged.")
    log.info(f"done in {clock.elapsed()}")
    return comparison


def _rerun(failure: dict[str, str]) -> str:
    """The command that runs a failed stage again for that variant alone."""
    def one(stage: str) -> str:
        variant = failure["variant"]
        if variant == "all" or (variant == "baseline" and stage != "eval"):
            return f"make {stage}"  # bench always serves the baseline
        return f"make {stage} RECIPE={'none' if variant == 'baseline' else variant}"
    return " and ".join(one(stage) for stage in failure["stage"].split("/"))  # Ray: bench/eval


def _locally(settings: CampaignSettings, base: baselines.Baseline,
             quantize: list[QuantizeSettings], bench_settings: bench.BenchSettings | None,
             eval_settings: evaluation.EvalSettings, clock: _Clock
             ) -> tuple[list[dict[str, str]], tuple[str, ...]]:
    """This machine: quantize a few recipes at once, then bench and eval in this process (on
    a CPU host sharing the servers)."""
    failures = _quantize(quantize, base, settings.quantize_jobs, clock)
    lost = {f["variant"] for f in failures}
    left = tuple(q.recipe for q in quantize if q.recipe not in lost)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ServerPool()) if serve_target() == "cpu" else None
        for label, stage_settings, call in (("bench", bench_settings, bench.run),
                                            ("eval", eval_settings, evaluation.run)):
            if stage_settings is None:
                continue
            clock.next(label)
            if lost and not left:
                log.info(f"{label}: skipped, no recipe left to measure")
                continue
            stage_settings = stage_settings.model_copy(update={"recipes": left})
            _stage(label, stage_settings.command(label), failures,
                   lambda c=call, s=stage_settings: c(s, pool))
    return failures, left


def _on_ray(settings: CampaignSettings, base: baselines.Baseline,
            quantize: list[QuantizeSettings],
            bench_settings: bench.BenchSettings | None, eval_settings: evaluation.EvalSettings,
            clock: _Clock) -> tuple[list[dict[str, str]], tuple[str, ...]]:
    """A Ray cluster: one task per recipe to quantize, then the baseline's scores, then one
    task per variant that benches it beside its own baseline server (the speedup is paired on
    one node) and scores it. Every task's commands are the stage commands a user can run alone;
    the artifacts directory is shared by every node (docs/scale-out.md)."""
    from pipeline.core import executor
    from pipeline.core.settings import to_argv

    extra = _ray_resources(settings.ray_resources)
    logs = paths.artifacts_dir() / "logs"
    servers = settings.engine.tensor_parallel_size * settings.engine.pipeline_parallel_size

    def run(label: str, tasks: list[executor.Task]) -> list[executor.Outcome]:
        clock.next(f"{label} on Ray: {len(tasks)} task(s)", max(1, len(tasks)))
        return executor.run(tasks, settings.ray_address)

    tracking.prepare(base.name)  # tasks that log at once must not race on a new store
    outcomes = run("quantize", [executor.Task(
        f"quantize {q.recipe}", (executor.qpipe("quantize", *to_argv(q)),),
        logs / f"quantize-{q.recipe}.log", gpus_if_any=1, resources=extra) for q in quantize])
    failures = [{"variant": o.label.split(" ", 1)[1], "stage": "quantize", "reason": o.reason,
                 "log": o.log} for o in outcomes if not o.ok]
    lost = {f["variant"] for f in failures}
    left = tuple(q.recipe for q in quantize if q.recipe not in lost)
    if not left:
        return failures, left
    first = eval_settings.model_copy(update={"recipes": ("none",)})
    failures += [{"variant": "baseline", "stage": "eval", "reason": o.reason, "log": o.log}
                 for o in run("baseline scores", [executor.Task(
                     "eval baseline", (executor.qpipe("eval", *to_argv(first)),),
                     logs / "eval-baseline.log", gpus_if_any=servers, resources=extra)])
                 if not o.ok]
    measure = []
    for recipe in left:
        commands = []
        if bench_settings is not None:
            one = bench_settings.model_copy(update={"recipes": (recipe,)})
            commands.append(executor.qpipe("bench", *to_argv(one)))
        one_eval = eval_settings.model_copy(update={"recipes": (recipe,)})
        commands.append(executor.qpipe("eval", *to_argv(one_eval)))
        measure.append(executor.Task(f"measure {recipe}", tuple(commands),
                                     logs / f"measure-{recipe}.log", gpus_if_any=servers,
                                     resources=extra))
    for o in run("bench + eval per variant", measure):
        if not o.ok:
            failures.append({"variant": o.label.split(" ", 1)[1], "stage": "bench/eval",
                             "reason": f"{o.reason} (node {o.node})", "log": o.log})
    return failures, left


def _ray_resources(text: str | None) -> dict[str, float]:
    import json

    if not text:
        return {}
    try:
        found = json.loads(text)
        if isinstance(found, dict) and all(isinstance(v, (int, float)) for v in found.values()):
            return {str(k): float(v) for k, v in found.items()}
    except ValueError:
        pass
    raise ConfigError(f"RAY_RESOURCES={text}: a JSON object of resource -> amount, e.g. "
                      "'{\"h100\": 1}'.")
