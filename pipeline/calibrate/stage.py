"""``qpipe calibrate`` / ``make calibrate``: how often each of qpipe's verdicts is wrong, measured.

Every scenario of :mod:`pipeline.calibrate.scenarios` is drawn ``runs`` times with one seeded
generator; each verdict's share is its rate, with its Monte-Carlo error (two standard errors of
a binomial share). A wrong verdict whose rate exceeds its nominal level by more than that error
fails the command (exit 1) and the tests. The table goes to the terminal and, one row per
scenario and verdict, to ``artifacts/calibration/calibration.json``.

The per-repeat noise of the speed scenarios is this machine's own where a bench run measured
it (the spread of its log speedup ratios), else the two levels seen on the project's machines.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np
from pydantic import Field

from pipeline.bench import workloads
from pipeline.calibrate.scenarios import Scenario, catalogue, drifting_host, two_speed_host
from pipeline.core import log as qlog
from pipeline.core import paths
from pipeline.core.artifacts import BenchSummary
from pipeline.core.errors import QpipeError
from pipeline.core.fsutil import write_json_atomic
from pipeline.core.settings import StageSettings

log = qlog.get("calibrate")
# the per-repeat spread (sd) of log speedup ratios in the project's make all on its 2-core
# AVX-512 machine: 0.07 at concurrency 1 and 0.15 at 4 (int8 and int8-fp8kv, 6 repeats each),
# used when this machine has measured none
DEFAULT_NOISE = (0.07, 0.15)


class CalibrationFailed(QpipeError):
    """A verdict is wrong more often than it claims."""

    exit_code = 1


class CalibrateSettings(StageSettings):
    runs: int = Field(2000, ge=50, description="draws per scenario (the Monte-Carlo error "
                      "shrinks as 1/sqrt(runs))", json_schema_extra={"make": "RUNS"})
    seed: int = Field(2026, ge=0, description="the generator's seed: the table is reproducible")
    fast: bool = Field(False, description="the fast subset (one scenario per verdict kind)",
                       json_schema_extra={"make": "FAST=1"})
    noise: float | None = Field(None, gt=0, description="per-repeat spread of the log speedup "
                                "ratio (default: measured by this machine's newest bench run, "
                                "else 0.07 and 0.15)")


def measured_noise() -> tuple[float, str] | None:
    """The median spread of per-repeat log speedup ratios over the speed sweeps' load points of
    the newest bench run on this machine's artifacts that has any, and which run it was."""
    runs = sorted((p for p in (paths.artifacts_dir() / BenchSummary.DIR).glob(
        f"*/*/{BenchSummary.FILE}") if not p.parent.name.startswith(".")),
        key=lambda p: p.stat().st_mtime, reverse=True)
    for path in runs:
        summary = BenchSummary.read(path)
        if summary is None:
            continue
        spreads = [at.speedup_log_sd for entry in summary.models.values()
                   for figures in entry.workloads.values() if figures.capacity is None
                   for at in figures.points.values() if at.speedup_log_sd]
        if spreads:
            return statistics.median(spreads), f"bench run {path.parent.name}"
    return None


def noise_levels(settings: CalibrateSettings) -> list[tuple[float, str]]:
    if settings.noise is not None:
        return [(settings.noise, f"per-repeat noise {settings.noise:g} (given)")]
    found = measured_noise()
    if found is not None:
        return [(found[0], f"per-repeat noise {found[0]:.3f} (measured: {found[1]})")]
    return [(sd, f"per-repeat noise {sd:g}") for sd in DEFAULT_NOISE]


def simulate(scenario: Scenario, runs: int, rng: np.random.Generator
             ) -> tuple[dict[str, float], list[float]]:
    """verdict -> its share over ``runs`` draws, and the point estimate's error in each draw
    (where the scenario has an estimate)."""
    counts: dict[str, int] = {}
    errors: list[float] = []
    for _ in range(runs):
        found = scenario.draw(rng)
        if isinstance(found, tuple):
            found, error = found
            errors.append(error)
        counts[found] = counts.get(found, 0) + 1
    return {v: c / runs for v, c in sorted(counts.items())}, errors


def mc_error(rate: float, runs: int) -> float:
    """Two standard errors of a share (at least that of one draw in ``runs``)."""
    p = min(max(rate, 1 / runs), 1 - 1 / runs)
    return 2 * math.sqrt(p * (1 - p) / runs)


BIAS = "point estimate's bias"


def rows_for(scenario: Scenario, rates: dict[str, float], errors: list[float] | None = None,
             *, runs: int) -> list[dict[str, Any]]:
    """One row per verdict seen (and per wrong verdict with a nominal, seen or not), and one
    for the point estimate's mean error where the scenario has one (``unit``: loads)."""
    out = []
    for verdict in sorted(set(rates) | set(scenario.nominal)):
        rate = rates.get(verdict, 0.0)
        nominal = scenario.nominal.get(verdict)
        error = mc_error(rate, runs)
        out.append({"kind": scenario.kind, "scenario": scenario.name, "truth": scenario.truth,
                    "verdict": verdict, "rate": rate, "nominal": nominal, "mc_error": error,
                    "runs": runs, "within": nominal is None or rate <= nominal + error,
                    "unit": "share"})
    if errors:
        bias = statistics.fmean(errors)
        error = 2 * statistics.pstdev(errors) / math.sqrt(len(errors))
        bound = scenario.bias_bound
        out.append({"kind": scenario.kind, "scenario": scenario.name, "truth": scenario.truth,
                    "verdict": BIAS, "rate": bias, "nominal": bound, "mc_error": error,
                    "runs": len(errors), "unit": "loads",
                    "within": bound is None or abs(bias) <= bound + error})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'verdict kind':15s} {'scenario':62s} {'verdict':24s} {'rate':>8s} "
             f"{'nominal':>9s} {'+-MC':>6s}"]
    for r in rows:
        flag = "" if r["within"] else "  ABOVE NOMINAL"
        if r.get("unit") == "loads":  # a mean error, in loads (users or rate levels)
            nominal = f"|.|<= {r['nominal']:g}" if r["nominal"] is not None else ""
            rate, mc = f"{r['rate']:+8.2f}", f"{r['mc_error']:6.2f}"
        else:
            nominal = f"<= {r['nominal']:.1%}" if r["nominal"] is not None else ""
            rate, mc = f"{r['rate']:8.1%}", f"{r['mc_error']:6.1%}"
        lines.append(f"{r['kind']:15s} {r['scenario'][:62]:62s} {r['verdict'][:24]:24s} "
                     f"{rate} {nominal:>9s} {mc}{flag}")
    return "\n".join(lines)


def calibrate(settings: CalibrateSettings) -> list[dict[str, Any]]:
    """Every scenario's verdict rates (the fast subset with ``fast``)."""
    rng = np.random.default_rng(settings.seed)
    looks = workloads.load("chat").looks("cpu")  # the default speed sweep's looks
    rows: list[dict[str, Any]] = []
    for sd, label in noise_levels(settings):
        for scenario in catalogue(sd, looks, label):
            if settings.fast and not scenario.fast:
                continue
            if rows and scenario.kind not in ("speed", "recommendation") and any(
                    r["scenario"] == scenario.name for r in rows):
                continue  # the noise level only changes the speed scenarios
            rows += rows_for(scenario, *simulate(scenario, settings.runs, rng), runs=settings.runs)
    for scenario in [*two_speed_host(looks), *drifting_host(looks)]:
        if not settings.fast or scenario.fast:
            rows += rows_for(scenario, *simulate(scenario, settings.runs, rng), runs=settings.runs)
    return rows


def run(settings: CalibrateSettings) -> list[dict[str, Any]]:
    rows = calibrate(settings)
    print(table(rows))
    out = paths.artifacts_dir() / "calibration" / "calibration.json"
    write_json_atomic(out, {"seed": settings.seed, "runs": settings.runs, "rows": rows})
    log.info(f"written: {paths.shown(out)}")
    above = [r for r in rows if not r["within"]]
    if above:
        raise CalibrationFailed("a verdict is wrong more often than it claims: " + "; ".join(
            f"{r['scenario']}: '{r['verdict']}' {r['rate']:.1%} > {r['nominal']:.1%} + "
            f"{r['mc_error']:.1%}" if r.get("unit") != "loads" else
            f"{r['scenario']}: {r['verdict']} {r['rate']:+.2f} loads, beyond +-{r['nominal']:g}"
            f" + {r['mc_error']:.2f}" for r in above))
    return rows
