"""The local executor: a campaign's stages on this machine. Several recipes are quantized at
once, each in its own process (its peak memory is its own, and llmcompressor's session state
starts fresh), each with its own log, a progress line every 30 s, a recipe that fails not
stopping the others; then bench and eval run in this process, on a CPU host sharing the vLLM
servers (one start per model for both)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable

import psutil

from pipeline import bench
from pipeline import eval as evaluation
from pipeline.campaign import jobs
from pipeline.core import log as qlog
from pipeline.core import paths, tracking
from pipeline.core.artifacts import Failure, Manifest
from pipeline.core.errors import ConfigError, QpipeError, TrackingError
from pipeline.core.hardware import serve_target
from pipeline.core.settings import to_argv
from pipeline.quantize import baseline as baselines
from pipeline.quantize import checkpoint
from pipeline.quantize import stage as quantize_stage
from pipeline.quantize.settings import QuantizeSettings
from pipeline.quantize.stage import cache_key, is_current, recipe_for
from pipeline.serve import ServerPool

log = qlog.get("all")
_LAYER = re.compile(r"\((\d+)/(\d+)\): (?:Calibrating|Propagating)")
_PASS = re.compile(r"Inferred `\w+` for `(\w+?)(?:Modifier)?`")


class Local:
    """This machine: quantize a few recipes at once, then bench and eval in this process."""

    def __init__(self, quantize_jobs: int | None = None) -> None:
        self.quantize_jobs = quantize_jobs

    def steps(self, recipes: int, benches: bool) -> int:
        return recipes + benches + 1  # each recipe, bench, eval

    def quantize(self, todo: list[QuantizeSettings], base: baselines.Baseline,
                 clock: jobs.Steps) -> list[Failure]:
        checks = {q.recipe: _needs_work(q, base) for q in todo}
        redo = [q for q in todo if checks[q.recipe][0]]
        for q in todo:
            if q not in redo:
                clock.next(f"quantize {q.recipe}")
                log.info(f"quantize {q.recipe}: up to date")
                quantize_stage.run(q)  # records it in MLflow if a store was down before
        if not redo:
            return []
        at_once = min(len(redo), slots(base, serve_target(), self.quantize_jobs))
        if at_once > 1:
            tracking.prepare(base.name)  # processes that log at once must not race on a store
        clock.next(f"{', '.join(f'quantize {q.recipe}' for q in redo)}: {at_once} at a time",
                   len(redo))
        # those that calibrate start first: fewer idle slots at the end
        return quantize_all(sorted(redo, key=lambda q: not checks[q.recipe][1]), at_once)

    def measure(self, recipes: tuple[str, ...], bench_settings: bench.BenchSettings | None,
                eval_settings: evaluation.EvalSettings, clock: jobs.Steps) -> list[Failure]:
        failures: list[Failure] = []
        with contextlib.ExitStack() as stack:
            pool = stack.enter_context(ServerPool()) if serve_target() == "cpu" else None
            for label, stage_settings, call in (("bench", bench_settings, bench.run),
                                                ("eval", eval_settings, evaluation.run)):
                if stage_settings is None:
                    continue
                clock.next(label)
                stage_settings = stage_settings.model_copy(update={"recipes": recipes})
                failures += in_process(label, stage_settings.command(label),
                                       lambda c=call, s=stage_settings: c(s, pool))
        return failures


def in_process(label: str, command: str, call: Callable[[], object]) -> list[Failure]:
    """Run one stage in this process; a failure of the whole stage is recorded, not raised (a
    bad setting or an unreachable store is: nothing after it could work)."""
    try:
        call()
    except (ConfigError, TrackingError) as err:
        raise QpipeError(f"stage '{label}' failed: {err}\nRe-run it alone: {command}") from err
    except QpipeError as err:
        log.warning(f"stage '{label}' FAILED, going on to the comparison: {err}")
        return [Failure(variant="all", stage=label, reason=str(err))]
    return []


def _needs_work(q: QuantizeSettings, base: baselines.Baseline) -> tuple[bool, bool]:
    """(has work to do, calibrates): recipes that calibrate take minutes, data-free seconds."""
    recipe = recipe_for(q)
    current = is_current(Manifest.load(base.name, recipe.name), cache_key(base, recipe))
    return q.force or not current, recipe.calibration is not None


def slots(base: baselines.Baseline, target: str, wanted: int | None = None) -> int:
    """How many quantize processes run at once: on a CPU host as many as memory holds at ~3x
    the float32 weights plus 1.5 GB of runtime each, whatever the core count (each calibrates
    on one thread; the OS shares the cores, so none idles while one long GPTQ recipe is left
    on its own, as with one per core); one on a GPU host (one device).
    ``--quantize-jobs`` (``QUANTIZE_JOBS=``) or ``QPIPE_QUANTIZE_JOBS`` overrides."""
    if wanted:
        return max(1, wanted)
    if os.environ.get("QPIPE_QUANTIZE_JOBS"):
        return max(1, int(os.environ["QPIPE_QUANTIZE_JOBS"]))
    if target != "cpu":
        return 1
    fp32 = 2 * checkpoint.measure(base.path).weight_bytes
    return max(1, int(psutil.virtual_memory().available // (3 * fp32 + 1.5 * 2**30)))


def progress(job: jobs.Job) -> str:
    """E.g. "GPTQ layer 12/31": SmoothQuant + GPTQ walks the layers once per modifier."""
    text = job.tail(1 << 24)
    last = text.rstrip().rpartition("\n")[2]
    if last.startswith("[quantize] waiting for "):  # for the recipe it starts from
        return last.removeprefix("[quantize] ").partition(":")[0]
    passes = list(_PASS.finditer(text))
    found = _LAYER.findall(text[passes[-1].end():] if passes else text)
    if not found:
        return ""
    name = f"{passes[-1].group(1)} " if passes else ""
    return f"{name}layer {found[-1][0]}/{found[-1][1]}"


def _done(job: jobs.Job) -> None:
    """One line per finished variant: its own summary line ("wrote ...: format, size")."""
    wrote = [line.removeprefix("[quantize] ") for line in job.tail(65536).splitlines()
             if line.startswith("[quantize] wrote")]
    took = jobs.clock(time.monotonic() - job.started)
    log.info(f"{job.label}: done in {took}{' - ' + wrote[-1] if wrote else ''}")


def last_error(text: str) -> str:
    """The line of a stage's log that says why it failed (qpipe's own paragraph first)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if line.startswith("qpipe "):
            return line
    errors = [ln for ln in lines if re.search(r"(Error|Exception)\b", ln)]
    return (errors or lines or ["no output"])[-1][:500]


def quantize_all(todo: list[QuantizeSettings], at_once: int) -> list[Failure]:
    """Run ``qpipe quantize`` for each, ``at_once`` at a time; returns the failures."""
    logs = paths.artifacts_dir() / "logs"
    by_label = {f"quantize {s.recipe}": s for s in todo}
    work = [jobs.Job(label, list(jobs.qpipe("quantize", *to_argv(s))),
                     logs / f"{label.replace(' ', '-')}.log", cwd=paths.PROJECT_ROOT)
            for label, s in by_label.items()]
    failed = jobs.run_all(work, at_once, on_done=_done, progress=progress, keep_going=True)
    out = []
    for err in failed:
        settings = by_label[err.job.label]
        reason = last_error(err.job.tail(65536))
        log.warning(f"{err.job.label}: FAILED (exit {err.code}): {reason}. Log: {err.job.log}. "
                    f"Re-run it alone: {settings.command('quantize')}")
        out.append(Failure(variant=settings.recipe, stage="quantize", reason=reason,
                           log=str(err.job.log)))
    return out
