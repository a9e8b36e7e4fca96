"""Score the baseline and its variants with lm-eval, and report percent recovery.

Each variant is scored through vLLM (lm-eval ``local-completions`` against a ``VllmServer``)
when vLLM serves its format here; otherwise with lm-eval's ``hf`` backend on de-compressed
weights, and every figure of it is marked ``emulated``. The baseline is scored through the same
backend as each variant it is compared with. Seeds, limits and few-shot settings are the same
for both and recorded. One variant's failure is recorded and the others are scored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core import heldout, paths, tracking
from pipeline.core import log as qlog
from pipeline.core.artifacts import EvalFailure, RecoverySummary, SuiteFigure
from pipeline.core.variant import Variant, baseline_variant, variants_of
from pipeline.eval import divergence, recovery, suites
from pipeline.eval.lm import (
    EMULATED,
    SERVED,
    EvalError,
    NotDecompressible,
    TaskResult,
    serve_command,
)
from pipeline.eval.prepare import prepare_for
from pipeline.eval.score import cache_root, score, score_emulated, score_variant
from pipeline.eval.settings import EvalSettings
from pipeline.eval.summary import (
    compare,
    log_mlflow,
    print_report,
    run_suite_figures,
    write_failure,
    write_summary,
)
from pipeline.quantize import baseline as baselines
from pipeline.serve import ServeError, UnsupportedFormat

if TYPE_CHECKING:
    from pipeline.serve import ServerPool

log = qlog.get("eval")


@dataclass
class Scored:
    """One model's outcome: its scores and, for a variant, recovery against the baseline scored
    through the same backend; or why it failed."""

    backend: str = ""
    results: dict[str, TaskResult] = field(default_factory=dict)
    recoveries: dict[str, dict[str, recovery.Recovery]] | None = None
    figures: dict[str, SuiteFigure] | None = None
    divergence: divergence.Divergence | None = None
    summary: RecoverySummary | None = None
    failed: EvalFailure | None = None


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


def _score_baseline(base: baselines.Baseline, model: Variant, tasks: list[suites.Task],
                    backend: str, settings: EvalSettings, pool: ServerPool | None
                    ) -> dict[str, TaskResult]:
    try:
        return score(base.name, model, tasks, backend, settings, settings.force, pool)
    except UnsupportedFormat as err:
        raise EvalError(f"the baseline {base.name} cannot be served by vLLM here, so the served "
                        f"variants have nothing to be compared with: {err} Fix: score everything "
                        "with BACKEND=hf (qpipe eval --backend hf).") from None


def _divergences(base: baselines.Baseline, variants: list[Variant]
                 ) -> dict[Path, divergence.Divergence]:
    """Held-out divergence of each variant (and the baseline's own perplexity), cached per
    model identity, held-out text and dtype."""
    div_dir = cache_root(base.name) / "divergence"
    # the figures depend on the text and on the dtype the models ran in
    text = (f"{heldout.text_hash(heldout.heldout_text())}-{divergence.hf_dtype()}-"
            f"{divergence.device()}-after{heldout.SCAN_SPAN}")
    caches = {base.path: div_dir / f"{base.identity}-self-{text}.json",
              **{m.path: div_dir / f"{m.identity}-vs-{base.identity}-{text}.json"
                 for m in variants}}
    todo = sum(not cache.is_file() for cache in caches.values())
    if todo:
        log.info(f"divergence on held-out text ({paths.shown(heldout.HELDOUT)}, on "
                 f"{divergence.device()}): {todo} model(s) against the baseline ...")
    return divergence.measure_all(base.path, caches)


@contextlib.contextmanager
def _one_of_many(base: baselines.Baseline, model: Variant, report: dict[str, Scored]
                 ) -> Iterator[None]:
    """One variant's failure is recorded in ``report``; the others go on."""
    try:
        yield
    except (EvalError, ServeError) as err:
        how = "unsupported here" if isinstance(err, NotDecompressible) else "FAILED"
        log.warning(f"{model.name}: {how}, the other variants go on: {err}")
        report[model.name] = Scored(failed=write_failure(base.name, model, err))


def evaluate(base: baselines.Baseline, variants: list[Variant], tasks: list[suites.Task],
             settings: EvalSettings, pool: ServerPool | None = None, track: bool = True
             ) -> dict[str, Scored]:
    """Score, compare and record; one :class:`Scored` per variant, and ``baseline (<backend>)``
    per backend the baseline was scored on.

    A ``pool`` (a campaign's) lends servers its bench stage left running.
    """
    tasks = prepare_for(tasks)
    base_model = baseline_variant(base)
    scored: dict[str, tuple[str, dict[str, TaskResult]]] = {}
    report: dict[str, Scored] = {}
    # every served score first, then the emulated ones: a model loaded in this process (on a
    # GPU) holds memory that a vLLM server started after it would need
    emulate: list[Variant] = []
    for number, model in enumerate(variants, start=1):
        log.info(f"variant {number}/{len(variants)}: {model.name} ({len(tasks)} task(s))")
        with _one_of_many(base, model, report):
            found = score_variant(base.name, model, tasks, settings, settings.force, pool,
                                  emulate=False)
            if found is None:
                emulate.append(model)
            else:
                scored[model.name] = found
    backends = [*([SERVED] if scored or (settings.backend != "hf" and not emulate) else []),
                *([EMULATED] if emulate or settings.backend == "hf" else [])]
    base_results = {}
    if SERVED in backends:
        base_results[SERVED] = _score_baseline(base, base_model, tasks, SERVED, settings, pool)
    for model in emulate:
        with _one_of_many(base, model, report):
            scored[model.name] = score_emulated(base.name, model, tasks, settings,
                                                settings.force)
    if EMULATED in backends:
        base_results[EMULATED] = _score_baseline(base, base_model, tasks, EMULATED, settings,
                                                 pool)
    variants = [m for m in variants if m.name in scored]
    divs = _divergences(base, variants) if settings.divergence else {}
    base_div = divs.get(base.path)
    for backend, results in base_results.items():
        if track:
            log_mlflow(base, base_model, backend, tasks, results, None, None, base_div, None,
                       settings)
        report[f"baseline ({backend})"] = Scored(backend, results)
    for model in variants:
        backend, results = scored[model.name]
        recoveries = compare(tasks, base_results[backend], results)
        figures = run_suite_figures(tasks, recoveries)
        div = divs.get(model.path)
        print_report(model, backend, tasks, recoveries, figures, div)
        summary = write_summary(base, model, backend, tasks, recoveries, results, div)
        if track:
            log_mlflow(base, model, backend, tasks, results, recoveries, figures, div, summary,
                       settings)
        report[model.name] = Scored(backend, results, recoveries, figures, div, summary)
    print("\nreproduce a score by hand (from the project root; docs/evals.md):")
    for backend, results in base_results.items():
        if backend == SERVED:
            print(f"  {serve_command(base_model, settings)} &")
        print(f"  {results[tasks[0].name].command}")
    return report


def run(settings: EvalSettings, pool: ServerPool | None = None) -> dict[str, Scored]:
    """``qpipe eval`` / ``make eval``; a campaign passes its pool."""
    tracking.check_store()  # seconds, before the work: not minutes after it
    base = baselines.resolve(settings.baseline)
    recipes = [r for r in settings.recipes if r != "none"]
    variants = [] if list(settings.recipes) == ["none"] else variants_of(base, recipes or None)
    tasks = resolve_tasks(list(settings.suites) or None, list(settings.tasks) or None)
    if not variants:
        log.info(f"no variant of {base.name} on disk: scoring the baseline only (make quantize "
                 "makes the variants)")
    return evaluate(base, variants, tasks, settings, pool)
