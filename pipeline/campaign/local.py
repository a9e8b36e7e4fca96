"""Several recipes quantized at once, each in its own process (its peak memory is its own, and
llmcompressor's session state starts fresh), a few at a time, each with its own log; a progress
line every 30 s; a recipe that fails does not stop the others."""

from __future__ import annotations

import os
import re
import sys
import time

import psutil

from pipeline.core import jobs, paths
from pipeline.core import log as qlog
from pipeline.core.settings import to_argv
from pipeline.quantize import baseline as baselines
from pipeline.quantize import checkpoint
from pipeline.quantize.settings import QuantizeSettings

log = qlog.get("all")
_LAYER = re.compile(r"\((\d+)/(\d+)\): (?:Calibrating|Propagating)")
_PASS = re.compile(r"Inferred `\w+` for `(\w+?)(?:Modifier)?`")


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


def quantize_all(todo: list[QuantizeSettings], at_once: int) -> list[dict[str, str]]:
    """Run ``qpipe quantize`` for each, ``at_once`` at a time; returns the failures."""
    logs = paths.artifacts_dir() / "logs"
    by_label = {f"quantize {s.recipe}": s for s in todo}
    work = [jobs.Job(label, [sys.executable, "-m", "pipeline.cli", "quantize", *to_argv(s)],
                     logs / f"{label.replace(' ', '-')}.log", cwd=paths.PROJECT_ROOT)
            for label, s in by_label.items()]
    failed = jobs.run_all(work, at_once, on_done=_done, progress=progress, keep_going=True)
    out = []
    for err in failed:
        settings = by_label[err.job.label]
        reason = last_error(err.job.tail(65536))
        log.warning(f"{err.job.label}: FAILED (exit {err.code}): {reason}. Log: {err.job.log}. "
                    f"Re-run it alone: {settings.command('quantize')}")
        out.append({"variant": settings.recipe, "stage": "quantize", "reason": reason,
                    "log": str(err.job.log)})
    return out
