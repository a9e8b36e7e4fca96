"""A campaign: every stage for every recipe, then one comparison logged as an MLflow parent run.

``qpipe campaign`` (``make all``) runs quantize -> bench -> eval as the Makefile would,
printing progress and elapsed time. Quantizing runs one process per recipe (peak memory is
measured per variant), several at once on a CPU host; bench and eval run in this process and,
on a CPU host, share the vLLM servers. Every stage reuses what it measured before, so a re-run
with nothing changed finishes in seconds. ``qpipe compare`` (``make compare``) is the last
step alone: it joins what is on disk (:mod:`pipeline.compare`), writes the report
(:mod:`pipeline.report`) and logs one parent run with a nested child run per variant.

What a campaign runs is a YAML file in ``configs/campaigns/`` (``default``; ``quick`` for a
first look); every field can be overridden on the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import yaml

from pipeline.core import hardware, jobs, paths, tracking
from pipeline.core.errors import ConfigError, QpipeError, TrackingError
from pipeline.quantize import baseline as baselines
from pipeline.report import compare
from pipeline.report import render as report
from pipeline.serve.server import ServerPool, serve_target

CAMPAIGNS_DIR = paths.CONFIGS_DIR / "campaigns"
STAGE = "campaign"
CHILD_STAGE = "campaign.variant"
TAG_PARENT = "mlflow.parentRunId"


class StageFailed(QpipeError):
    """A stage of the campaign exited non-zero; its own message says why."""


class CampaignIncomplete(QpipeError):
    """Every stage ran, but a variant failed for a reason other than a hardware limit."""

    exit_code = 1


# --- the campaign file -------------------------------------------------------------------------
@dataclass(frozen=True)
class Campaign:
    name: str
    path: Path
    description: str = ""
    recipes: tuple[str, ...] = ()  # empty: every recipe in recipes/
    workloads: tuple[str, ...] = ("chat", "prefix")
    repeats: int | None = None
    suites: tuple[str, ...] = ()  # empty: every suite in evals/
    limit: int | str | None = None  # items per task; "all"; None: each task's qpipe_limit
    backend: str = "auto"  # eval: auto (served where vLLM serves the format), served, hf
    divergence: bool = True
    objective: str = "speed"  # what the recommendation optimises: speed | memory | capacity
    plan: compare.PlanTarget = field(default_factory=compare.PlanTarget)


FIELDS = {"description": str, "recipes": list, "workloads": list, "repeats": int,
          "suites": list, "limit": (int, str), "backend": str, "divergence": bool, "plan": dict,
          "objective": str}
PLAN_FIELDS = {"gpu": str, "context": int, "max_context": int, "memory_gb": (int, float)}


def load(name_or_path: str) -> Campaign:
    """A campaign by name (``configs/campaigns/<name>.yaml``) or path."""
    path = paths.find_yaml(name_or_path, CAMPAIGNS_DIR)
    if path is None:
        raise ConfigError(f"no campaign {name_or_path!r}: the campaigns are "
                          f"{', '.join(paths.yaml_names(CAMPAIGNS_DIR))} (configs/campaigns/), "
                          "or give a path to a YAML file.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields ({', '.join(FIELDS)}).")
    values: dict[str, Any] = {}
    for key, value in data.items():
        _check(path, key, value, FIELDS)
        values[key] = tuple(str(v) for v in value) if isinstance(value, list) else value
    plan = values.pop("plan", {}) or {}
    for key, value in plan.items():
        _check(path, f"plan.{key}", value, PLAN_FIELDS)
    if isinstance(values.get("limit"), str) and values["limit"] != "all":
        raise ConfigError(f"{path}: limit is a number of items per task or `all`, not "
                          f"{values['limit']!r}.")
    if values.get("objective", "speed") not in compare.OBJECTIVES:
        raise ConfigError(f"{path}: objective {values['objective']!r} is not one of "
                          f"{', '.join(compare.OBJECTIVES)}.")
    return Campaign(name=path.stem, path=path, plan=compare.PlanTarget(**plan), **values)


def _check(path: Path, key: str, value: Any, fields: dict[str, Any]) -> None:
    short = key.rsplit(".", 1)[-1]
    if short not in fields:
        raise ConfigError(f"{path}: unknown field {key!r}; the fields are "
                          f"{', '.join(fields)}.")
    if value is not None and not isinstance(value, fields[short]):
        raise ConfigError(f"{path}: field {key!r} should be a "
                          f"{getattr(fields[short], '__name__', 'number')}, not {value!r}.")


# --- the stages --------------------------------------------------------------------------------
def _qpipe() -> list[str]:
    return [sys.executable, "-m", "pipeline.cli"]


def stage_commands(campaign: Campaign, baseline: str, force: bool = False,
                   engine_args: list[str] | None = None,
                   calibration_args: list[str] | None = None) -> list[tuple[str, list[str]]]:
    """(label, ``qpipe`` arguments) of every stage, in order. ``engine_args`` go to every stage
    that starts vLLM servers (bench and eval: one engine configuration for the campaign),
    ``calibration_args`` to every quantize stage."""
    recipes = list(campaign.recipes) or paths.yaml_names(paths.RECIPES_DIR)
    again = ["--force"] if force else []
    steps = [(f"quantize {r}", ["quantize", "--baseline", baseline, "--recipe", r, *again,
                                *(calibration_args or [])]) for r in recipes]
    variants = [a for r in recipes for a in ("--recipe", r)]
    bench = ["bench", "--baseline", baseline, *variants,
             *[a for w in campaign.workloads for a in ("--workload", w)], *again,
             *(engine_args or [])]
    if campaign.repeats:
        bench += ["--repeats", str(campaign.repeats)]
    evaluate = ["eval", "--baseline", baseline, *variants,
                *[a for s in campaign.suites for a in ("--suite", s)], *again,
                *(engine_args or [])]
    if campaign.limit:
        evaluate += ["--limit", str(campaign.limit)]
    if campaign.backend != "auto":
        evaluate += ["--backend", campaign.backend]
    if not campaign.divergence:
        evaluate.append("--no-divergence")
    # no workloads: no bench (e.g. a machine without the serving environment)
    return [*steps, *([("bench", bench)] if campaign.workloads else []), ("eval", evaluate)]


def _quantize_check(argv: list[str], base: baselines.Baseline) -> tuple[bool, bool]:
    """(has work to do, calibrates) of a quantize stage. Its work runs in a fresh process (which
    measures its own peak memory); recipes that calibrate take minutes, data-free ones seconds."""
    from pipeline.quantize import recipes
    from pipeline.quantize import run as quantize

    args = _parse(argv)
    recipe = recipes.load(args.recipe)
    manifest = quantize.read_json(paths.variant_dir(base.name, args.recipe) / quantize.MANIFEST)
    work = args.force or not quantize.is_current(manifest, quantize.cache_key(base, recipe))
    return work, recipe.calibration is not None


def _parse(argv: list[str]) -> argparse.Namespace:
    from pipeline import cli

    return cli.build_parser(argv[0]).parse_args(argv)


def quantize_slots(base: baselines.Baseline, target: str, jobs_wanted: int | None = None
                   ) -> int:
    """How many quantize processes run at once: one per core on a CPU host (each calibrates on
    one thread), as many as memory holds at ~3x the float32 weights plus 1.5 GB of runtime
    each; one on a GPU host (one device). ``--quantize-jobs`` (``QUANTIZE_JOBS=``) or
    ``QPIPE_QUANTIZE_JOBS`` overrides."""
    if jobs_wanted:
        return max(1, jobs_wanted)
    if os.environ.get("QPIPE_QUANTIZE_JOBS"):
        return max(1, int(os.environ["QPIPE_QUANTIZE_JOBS"]))
    if target != "cpu":
        return 1
    from pipeline.quantize import checkpoint

    fp32 = 2 * checkpoint.measure(base.path).weight_bytes
    fits = int(psutil.virtual_memory().available // (3 * fp32 + 1.5 * 2**30))
    return max(1, min(os.cpu_count() or 1, fits))


_LAYER = re.compile(r"\((\d+)/(\d+)\): (?:Calibrating|Propagating)")
_PASS = re.compile(r"Inferred `\w+` for `(\w+?)(?:Modifier)?`")


def _quantize_progress(job: jobs.Job) -> str:
    """E.g. "GPTQ layer 12/31": SmoothQuant + GPTQ walks the layers once per modifier."""
    log = job.tail(1 << 24)
    passes = list(_PASS.finditer(log))
    found = _LAYER.findall(log[passes[-1].end():] if passes else log)
    if not found:
        return ""
    name = f"{passes[-1].group(1)} " if passes else ""
    return f"{name}layer {found[-1][0]}/{found[-1][1]}"


def _quantize_done(job: jobs.Job) -> None:
    """One line per finished variant: its own summary line ("wrote ...: format, size")."""
    wrote = [line.removeprefix("[quantize] ") for line in job.tail(65536).splitlines()
             if line.startswith("[quantize] wrote")]
    took = jobs.clock(time.monotonic() - job.started)
    print(f"[all] {job.label}: done in {took}{' - ' + wrote[-1] if wrote else ''}", flush=True)


def _last_error(log: str) -> str:
    """The line of a stage's log that says why it failed (qpipe's own paragraph first)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for line in reversed(lines):
        if line.startswith("qpipe "):
            return line
    errors = [ln for ln in lines if re.search(r"(Error|Exception)\b", ln)]
    return (errors or lines or ["no output"])[-1][:500]


def quantize_stages(steps: list[tuple[str, list[str]]], slots: int) -> list[dict[str, str]]:
    """Quantize stages with work to do, ``slots`` at a time, each in its own process (its
    peak memory is its own) with its own log under artifacts/logs/. A recipe that fails does
    not stop the others: the failures are returned."""
    logs = paths.artifacts_dir() / "logs"
    todo = [jobs.Job(label, [*_qpipe(), *argv], logs / f"{label.replace(' ', '-')}.log",
                     cwd=paths.PROJECT_ROOT) for label, argv in steps]
    failed = jobs.run_all(todo, slots, on_done=_quantize_done, progress=_quantize_progress,
                          keep_going=True)
    out = []
    for err in failed:
        argv = dict(steps)[err.job.label]
        reason = _last_error(err.job.tail(65536))
        print(f"[all] {err.job.label}: FAILED (exit {err.code}): {reason}. Log: {err.job.log}. "
              f"Re-run it alone: qpipe {shlex.join(argv)}", flush=True)
        out.append({"variant": argv[argv.index("--recipe") + 1], "stage": "quantize",
                    "reason": reason, "log": str(err.job.log)})
    return out


def _without(argv: list[str], recipes: set[str]) -> list[str]:
    """A stage's argv without the ``--recipe X`` pairs of ``recipes``."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--recipe" and i + 1 < len(argv) and argv[i + 1] in recipes:
            skip = True
            continue
        out.append(arg)
    return out


def run_stages(steps: list[tuple[str, list[str]]], started: float, base: baselines.Baseline,
               quantize_jobs: int | None = None) -> list[dict[str, str]]:
    """Stage by stage; returns what failed. Quantize stages with work to do run as processes,
    several at once on a CPU host; the rest run in this process, so a campaign with nothing to
    redo takes seconds. On a CPU host bench leaves its servers up for eval (one ~40 s start
    per model, not two). One variant never sinks the campaign: a recipe that fails to quantize
    is left out of bench and eval, bench and eval record a failing variant and go on, and a
    stage that fails as a whole is recorded; the comparison shows every failure."""
    target = serve_target()
    total = len(steps) + 1
    numbered = list(enumerate(steps, start=1))
    checks = {n: _quantize_check(argv, base) for n, (_, argv) in numbered
              if argv[0] == "quantize"}
    redo = [(n, s) for n, s in numbered if n in checks and checks[n][0]]
    failures: list[dict[str, str]] = []
    if redo:
        slots = min(len(redo), quantize_slots(base, target, quantize_jobs))
        if slots > 1:
            tracking.prepare(base.name)
        first, last = redo[0][0], redo[-1][0]
        print(f"\n[all {first}{f'-{last}' if last != first else ''}/{total}] "
              f"{', '.join(label for _, (label, _) in redo)}: {slots} at a time "
              f"(elapsed {jobs.clock(time.monotonic() - started)})", flush=True)
        # those that calibrate start first: fewer idle slots at the end
        failures += quantize_stages(
            [s for n, s in sorted(redo, key=lambda r: not checks[r[0]][1])], slots)
    lost = {f["variant"] for f in failures}
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ServerPool()) if target == "cpu" else None
        done = {n for n, _ in redo}
        for number, (label, argv) in numbered:
            if number in done:
                continue
            argv = _without(argv, lost)
            if argv[0] != "quantize" and lost and "--recipe" not in argv:
                print(f"\n[all {number}/{total}] {label}: skipped, no recipe left to measure",
                      flush=True)
                continue
            print(f"\n[all {number}/{total}] {label} (elapsed "
                  f"{jobs.clock(time.monotonic() - started)})", flush=True)
            args = _parse(argv)
            args.servers = pool
            try:
                args._run(args)
            except QpipeError as err:
                if isinstance(err, (ConfigError, TrackingError)):
                    raise StageFailed(f"stage '{label}' failed: {err}\nRe-run it alone: "
                                      f"qpipe {shlex.join(argv)}") from err
                print(f"[all] stage '{label}' FAILED, going on to the comparison: {err}",
                      flush=True)
                failures.append({"variant": "all", "stage": label, "reason": str(err),
                                 "log": ""})
    return failures


# --- the comparison and its MLflow runs --------------------------------------------------------
def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=paths.PROJECT_ROOT, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=paths.PROJECT_ROOT, timeout=10)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") or "unknown"
    except OSError:
        return "unknown"


def _versions() -> dict[str, str]:
    out = {}
    for name in ("llmcompressor", "compressed-tensors", "transformers", "torch", "lm_eval",
                 "mlflow"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    from pipeline.serve.server import vllm_version

    out["vllm"] = vllm_version()
    return out


def run_meta(comparison: compare.Comparison, campaign: Campaign | None) -> dict[str, str]:
    """Tags of the parent run, also printed at the foot of the report."""
    meta = {"baseline": comparison.baseline, "git_commit": _git_commit(),
            "hardware": hardware.profile().describe(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "campaign": campaign.name if campaign else "compare"}
    meta.update({f"version.{k}": v for k, v in _versions().items()})
    return meta


def child_metrics(row: compare.Row) -> dict[str, float]:
    """The joined figures of one variant, under the stage runs' metric names."""
    m: dict[str, float] = {tracking.WEIGHT_BYTES: row.weight_bytes,
                           "weight_ratio": row.weight_ratio}
    for key in (tracking.KV_CACHE_TOKENS, tracking.MAX_CONCURRENCY,
                tracking.KV_CACHE_MEMORY_BYTES):
        if key in row.kv:
            m[key] = row.kv[key]
    if row.engine.get(tracking.ENGINE_WEIGHT_MEMORY_BYTES):
        m[tracking.ENGINE_WEIGHT_MEMORY_BYTES] = row.engine[tracking.ENGINE_WEIGHT_MEMORY_BYTES]
    m.update(row.plan)  # at the campaign's plan target (the parent's plan_* params)
    if row.serving == "ok":
        m.update({k: v for k, v in row.headline.items() if isinstance(v, (int, float))})
        if row.peak_memory_bytes:
            m[tracking.SERVER_PEAK_MEMORY_BYTES] = row.peak_memory_bytes
        m.update(row.prefix)
    for suite, fig in row.suites.items():
        if fig.get("recovery_pct") is not None:
            m[f"{tracking.SUITE_RECOVERY_PREFIX}{suite}"] = fig["recovery_pct"]
            if fig.get("ci_low") is not None:
                m[f"suite_recovery_pct_ci_low.{suite}"] = fig["ci_low"]
                m[f"suite_recovery_pct_ci_high.{suite}"] = fig["ci_high"]
    for key in (tracking.KL_DIV_MEAN, tracking.TOP1_AGREEMENT, tracking.PERPLEXITY):
        if key in row.divergence:
            m[key] = row.divergence[key]
    if row.quantize_seconds is not None:
        m[tracking.QUANTIZE_SECONDS] = row.quantize_seconds
    return m


def log_campaign(comparison: compare.Comparison, files: list[Path], meta: dict[str, str]) -> str:
    """One parent run with the report as artifacts; one nested child run per variant."""
    mlflow = tracking.mlflow_module()
    mlflow.set_experiment(tracking.experiment_name(comparison.baseline))
    tags = {tracking.TAG_STAGE: STAGE, "qpipe.host": platform.node(),
            **{f"qpipe.{k}": v for k, v in meta.items()},
            "recommendation": comparison.recommendation or "none",
            "failures": "; ".join(f"{f['variant']} ({f['stage']})"
                                  for f in comparison.failures)[:5000] or "none",
            "mlflow.note.content": report.recommendation_line(comparison)}
    name = f"campaign:{meta['campaign']}"  # the start time is the run's own
    with mlflow.start_run(run_name=name, tags=tags) as parent:
        mlflow.log_params({tracking.PARAM_BASELINE: comparison.baseline,
                           "variants": ",".join(r.name for r in comparison.rows),
                           "workload": comparison.workload or "-",
                           "load_point": comparison.load_point or "-",
                           "plan_target": comparison.plan_target.gpu,
                           "plan_context": comparison.plan_target.context,
                           "plan_max_context": comparison.plan_target.max_context,
                           "objective": comparison.objective,
                           "measurement": comparison.measurement.get("run", "-"),
                           "speedup_pairing": comparison.measurement.get("pairing", "-")[:500]})
        for path in files:
            mlflow.log_artifact(str(path))
        for row in comparison.rows:
            child_tags = {tracking.TAG_STAGE: CHILD_STAGE, "serving_status": row.serving,
                          "gate": row.gate_status if row.name != compare.BASELINE else "-"}
            if row.eval_backend:
                child_tags[tracking.TAG_EVAL_BACKEND] = row.eval_backend
            with mlflow.start_run(run_name=f"variant:{row.name}", nested=True, tags=child_tags):
                params = {tracking.PARAM_BASELINE: comparison.baseline,
                          tracking.PARAM_RECIPE: row.recipe, tracking.PARAM_SCHEME: row.scheme,
                          "format": row.format, "precision": row.precision,
                          "figures_from": row.figures_from}
                if row.threshold is not None:
                    params["recovery_threshold_pct"] = row.threshold
                if row.serving_reason:
                    params["serving_reason"] = row.serving_reason[:500]
                if row.measurement:
                    params["measurement"] = row.measurement
                    params["comparable"] = row.comparable
                if row.engine.get("scheme"):
                    params["engine_scheme"] = row.engine["scheme"][:500]
                mlflow.log_params(params)
                mlflow.log_metrics(child_metrics(row))
        return parent.info.run_id


def compare_and_log(base: baselines.Baseline, recipes: list[str] | None,
                    target: compare.PlanTarget, campaign: Campaign | None = None,
                    track: bool = True, failures: list[dict[str, str]] | None = None,
                    objective: str = "speed") -> tuple[compare.Comparison, list[Path]]:
    comparison = compare.collect(base, recipes, target, failures, objective)
    meta = run_meta(comparison, campaign)
    out = paths.artifacts_dir() / "reports" / base.name
    files = report.write(comparison, out, meta)
    print(report.terminal(comparison))
    print(f"\nreport: {out / 'report.html'} (also comparison.md, .csv, .json)")
    if track:
        run_id = log_campaign(comparison, files, meta)
        print(f"[compare] recorded in MLflow ({paths.default_tracking_uri()}): parent run "
              f"{run_id} with {len(comparison.rows)} child runs; `make ui` to review")
    return comparison, files


# --- the commands ------------------------------------------------------------------------------
def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    baselines.add_baseline_argument(parser)
    parser.add_argument("--recipe", action="append",
                        help="a variant to include (repeatable; default: every variant on disk)")
    parser.add_argument("--campaign", default="default",
                        help="campaign file whose plan target is used (%(default)s)")
    parser.add_argument("--gpu", help="accelerator preset the planner places each variant on")
    parser.add_argument("--context", type=int, help="tokens per request for planned concurrency")
    parser.add_argument("--max-context", type=int, help="tokens reserved per request, worst case")
    parser.add_argument("--memory-gb", type=float, help="accelerator memory instead of --gpu")
    parser.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    parser.add_argument("--objective", choices=compare.OBJECTIVES,
                        help="what the recommendation optimises (default: the campaign's, "
                             "speed): the fastest passing variant faster than the baseline, "
                             "the smallest, or the one holding the most requests at the plan "
                             "target")


def _target(args: argparse.Namespace, campaign: Campaign) -> compare.PlanTarget:
    t = campaign.plan
    return compare.PlanTarget(gpu=args.gpu or t.gpu, context=args.context or t.context,
                              max_context=args.max_context or t.max_context,
                              memory_gb=args.memory_gb if args.memory_gb else t.memory_gb)


def run_compare(args: argparse.Namespace) -> int:
    campaign = load(args.campaign)
    if not args.no_track:
        tracking.check_store()
    base = baselines.resolve(args.baseline)
    compare_and_log(base, args.recipe, _target(args, campaign), None, not args.no_track,
                    objective=args.objective or campaign.objective)
    return 0


def evaluate_limit(value: str) -> int | str:
    from pipeline.eval.run import parse_limit

    return parse_limit(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_compare_arguments(parser)
    parser.add_argument("--workload", action="append", help="override the campaign's workloads")
    parser.add_argument("--repeats", type=int, help="override the campaign's repeats")
    parser.add_argument("--suite", action="append", help="override the campaign's suites")
    parser.add_argument("--limit", type=evaluate_limit,
                        help="override the campaign's items per task (a number or `all`)")
    parser.add_argument("--force", action="store_true", help="redo every stage")
    parser.add_argument("--quantize-jobs", type=int,
                        help="recipes quantized at once (default: one per core on a CPU host, "
                             "as memory allows; one on a GPU host)")
    parser.add_argument("--engine-arg", action="append", default=[],
                        help="an engine option for every vLLM server of the campaign, passed to "
                             "`qpipe bench` and `qpipe eval` (e.g. --engine-arg=--kv-cache-gib=2,"
                             " --engine-arg=--vllm-arg=--tensor-parallel-size=2)")
    parser.add_argument("--calib-samples", type=int, help="every recipe's calibration samples")
    parser.add_argument("--calib-seq-len", type=int, help="every recipe's calibration length")
    parser.add_argument("--calib-data", help="every recipe's calibration data (file or hub id)")


def run(args: argparse.Namespace) -> int:
    campaign = load(args.campaign)
    overrides: dict[str, Any] = {}
    for key in ("workload", "suite", "recipe"):
        if getattr(args, key):
            overrides[f"{key}s"] = tuple(getattr(args, key))
    for key in ("repeats", "limit"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    campaign = replace(campaign, **overrides, plan=_target(args, campaign))
    if not args.no_track:
        tracking.check_store()  # seconds now, not minutes after the work
    base = baselines.resolve(args.baseline)
    started = time.monotonic()
    print(f"[all] campaign {campaign.name} ({campaign.path}): {campaign.description}")
    calibration = [a for flag, value in (("--calib-samples", args.calib_samples),
                                         ("--calib-seq-len", args.calib_seq_len),
                                         ("--calib-data", args.calib_data))
                   if value is not None for a in (flag, str(value))]
    steps = stage_commands(campaign, args.baseline, args.force, args.engine_arg, calibration)
    failures = run_stages(steps, started, base, args.quantize_jobs)
    total = len(steps) + 1
    print(f"\n[all {total}/{total}] compare (elapsed {jobs.clock(time.monotonic() - started)})")
    lost = {f["variant"] for f in failures}
    recipes = [r for r in list(campaign.recipes) or paths.yaml_names(paths.RECIPES_DIR)
               if r not in lost]
    comparison, _ = compare_and_log(base, recipes, campaign.plan, campaign, not args.no_track,
                                    failures, args.objective or campaign.objective)
    took = jobs.clock(time.monotonic() - started)
    if comparison.failures:
        raise CampaignIncomplete(
            f"finished in {took}, but {len(comparison.failures)} failure(s) not due to a "
            "hardware limit: " + "; ".join(
                f"{f['variant']} in {f['stage']}: {f['reason'][:200]}"
                + (f" (log {f['log']})" if f.get("log") else "") for f in comparison.failures)
            + ". The other variants were measured, compared and logged.")
    print(f"[all] done in {took}")
    return 0
