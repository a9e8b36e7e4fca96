"""Scenarios with a known truth, each run through the very functions that make qpipe's verdicts.

A scenario draws data the way a measurement would produce it (per-repeat throughputs of a
baseline and its variants; per-item 0/1 scores of a baseline and a variant; a load point's
runs meeting an objective or not), hands it to qpipe's own code (the bench summary that records
a speedup, the recommendation, the gate, the capacity search) and returns the verdict it
printed. Repeated many times with a seeded generator, the share of each verdict is its rate;
a scenario states which verdicts would be wrong there and the most often each may happen (its
nominal rate).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
from scipy import interpolate, optimize

from pipeline.bench import workloads
from pipeline.bench.knee import LEVEL
from pipeline.bench.measure import run_order, speed_ratios
from pipeline.bench.slo import CapacitySearch, Objective
from pipeline.bench.summary import capacity_figures, point_figures
from pipeline.core import tracking
from pipeline.core.artifacts import CostTarget, PointFigures, Price, Row, TaskEntry
from pipeline.core.speedup import (
    ALPHA,
    FASTER,
    INCONCLUSIVE,
    SLOWER,
    Looks,
    Speedup,
    decided,
    undecided,
)
from pipeline.core.variant import BASELINE
from pipeline.eval import gate, recovery
from pipeline.report import cost
from pipeline.report.recommend import recommend

# one draw's verdict, or (verdict, the point estimate's error) where a scenario has an estimate
Draw = Callable[[np.random.Generator], "str | tuple[str, float]"]
CAPACITY = workloads.load("capacity")  # the shipped search: its requests, runs and target


@dataclass(frozen=True)
class Scenario:
    """``draw`` gives one verdict; ``nominal``: verdict -> the highest rate it may have here
    (a wrong verdict's claimed error rate); verdicts not named are not errors here."""

    kind: str  # which verdict: speed, recommendation, gate-task, gate-suite, capacity, cost
    name: str
    truth: str
    draw: Draw
    nominal: dict[str, float] = field(default_factory=dict)
    fast: bool = True  # part of the fast subset (make test-fast)
    # where ``draw`` also gives the point estimate's error: the most its mean may be off by
    # (in the estimate's unit: loads), else the error is reported unjudged
    bias_bound: float | None = None


# --- speed -----------------------------------------------------------------------------------
# A host whose speed jumps: a matmul timed every 0.25 s for 200 s on the project's 2-core
# AVX-512 VM (nothing else running) ran x1.38 faster 27% of the time, in blocks of 0.25-6 s:
# a run lands in either speed, so two runs of one model can differ by 38% (the t interval's
# normal noise is then wrong; this model is how far that matters)
MODE_FACTOR, MODE_SHARE, MODE_JITTER = 1.38, 0.27, 0.03


def _run_speed(rng: np.random.Generator, sd: float, modes: bool) -> float:
    """One run's speed factor: log-normal with half the repeat's variance, or the two-speed
    host's (``modes``)."""
    if modes:
        jump = MODE_FACTOR if rng.random() < MODE_SHARE else 1.0
        return jump * math.exp(rng.normal(0, MODE_JITTER))
    return math.exp(rng.normal(0, sd / math.sqrt(2)))


def _throughputs(rng: np.random.Generator, true: float, sd: float,
                 modes: bool = False) -> tuple[float, float]:
    """One repeat: the baseline's and a variant's output tok/s, each with its own noise."""
    return 100 * _run_speed(rng, sd, modes), 100 * true * _run_speed(rng, sd, modes)


def speed_draw(true: float, sd: float, looks: Looks, modes: bool = False) -> Draw:
    """A variant measured as bench measures it: repeats until decided (``decided``), then the
    figure bench records (``point_figures``), its verdict as the report reads it."""
    def draw(rng: np.random.Generator) -> str:
        base, var = [], []
        while not decided(speed_ratios(var, base), looks):
            b, v = _throughputs(rng, true, sd, modes)
            base.append({"output_throughput": b})
            var.append({"output_throughput": v})
        found = point_figures(var, base, looks).speedup
        assert found is not None
        return found.verdict
    return draw


def _row(name: str, at: PointFigures, status: str = gate.PASS) -> Row:
    return Row(name=name, recipe=name, scheme="S", format="f", precision="p", weight_bytes=1,
               weight_ratio=0.5, serving="ok", gate_status=status, threshold=96.0,
               headline=at, comparable=True)


def recommend_draw(k: int, true: float, sd: float, looks: Looks, failing: int = 0,
                   modes: bool = False) -> Draw:
    """k variants, none faster than ``true``, paired with one baseline run per repeat (shared,
    as in an interleaved bench); each repeats while bench's rule (``undecided``) says so, the
    baseline while any does; ``failing`` of them fail their gate (on their scores: whichever,
    the speed does not choose). The verdict: whether the speed objective recommends any."""
    def draw(rng: np.random.Generator) -> str:
        base: list[dict] = []
        runs: list[list[dict]] = [[] for _ in range(k)]
        while True:  # as bench repeats a load point: the same undecided() rule
            open_ = [int(n) for n in undecided({str(i): speed_ratios(runs[i], base)
                                                 for i in range(k)}, looks)]
            if not open_:
                break
            base.append({"output_throughput": 100 * _run_speed(rng, sd, modes)})
            for i in open_:
                runs[i].append({"output_throughput": 100 * true * _run_speed(rng, sd, modes)})
        rows = [_row("baseline", {})] + [_row(f"v{i}", point_figures(runs[i], base, looks),
                                              gate.FAIL if i < failing else gate.PASS)
                                         for i in range(k)]
        best, _ = recommend(rows, "speed")
        return "recommends one" if best else "recommends none"
    return draw


# A host whose speed drifts: over the chat sweep's runs at concurrency 8 (~6.5 s apart) of three
# make all runs on the 2-core AVX-512 VM (2026-12-03, 43-66 runs each), a model's log
# throughput about its own mean correlated 0.66-0.68 with the next run's, 0.39-0.49 two runs on,
# ~0 at six, with a spread of 0.09-0.11: AR(1) from run to run, as simulated here
DRIFT_RHO, DRIFT_SD = 0.68, 0.11


def drift_draw(k: int, true: float, looks: Looks, report: str = "speed") -> Draw:
    """k variants at ``true`` and the baseline measured as bench measures them, run by run in
    bench's own order (:func:`~pipeline.bench.measure.run_order`) on a host whose speed
    drifts (``DRIFT_RHO``): all of them for the first look, then the baseline and the
    variants ``undecided`` leaves open. ``report``: "speed", the first variant's verdict;
    "recommendation", whether the speed objective picks one."""
    names = [f"v{i}" for i in range(k)]

    def draw(rng: np.random.Generator) -> str:
        level = rng.normal(0, DRIFT_SD)
        innovation = DRIFT_SD * math.sqrt(1 - DRIFT_RHO ** 2)
        runs: dict[str, list[dict]] = {name: [] for name in [BASELINE, *names]}
        open_, repeat = names, 0
        while open_:
            for name in run_order([BASELINE, *open_], repeat):
                level = DRIFT_RHO * level + rng.normal(0, innovation)
                speed = 100 * (1.0 if name == BASELINE else true) * math.exp(level)
                runs[name].append({"output_throughput": speed})
            repeat += 1
            if repeat >= looks.first:
                open_ = undecided({name: speed_ratios(runs[name], runs[BASELINE])
                                   for name in names}, looks)
        figures = {name: point_figures(runs[name], runs[BASELINE], looks) for name in names}
        if report == "speed":
            found = figures[names[0]].speedup
            assert found is not None
            return found.verdict
        rows = [_row(BASELINE, PointFigures())] + [_row(name, figures[name]) for name in names]
        best, _ = recommend(rows, "speed")
        return "recommends one" if best else "recommends none"
    return draw


# --- the gate --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskTruth:
    """A task's truth: items, the baseline's accuracy, the share of its right items the
    variant loses and of its wrong items it gains, and the chance level."""

    n: int
    base: float
    lose: float = 0.0
    gain: float = 0.0
    chance: float = 0.25

    @property
    def recovery_pct(self) -> float:
        return (self.base * (1 - self.lose) + (1 - self.base) * self.gain) / self.base * 100

    def draw(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        base = (rng.random(self.n) < self.base).astype(int)
        flip = rng.random(self.n)
        var = np.where(base == 1, (flip >= self.lose).astype(int), (flip < self.gain).astype(int))
        return base, var


def gate_draw(tasks: dict[str, TaskTruth], threshold: float, level: str) -> Draw:
    """Paired scores drawn per task, their recoveries (``recovery.recovery``) judged by the
    gate (``gate.judge``) as ``make gate`` judges an evaluation."""
    def draw(rng: np.random.Generator) -> str:
        entries = {}
        for name, truth in tasks.items():
            b, v = truth.draw(rng)
            r = recovery.recovery(b, v, truth.chance)
            entries[name] = TaskEntry(suite="app", backend="served", primary_metric="acc,none",
                                      recovery={"acc,none": r})
        return gate.judge(entries, "v", threshold, level).status
    return draw


# --- the capacity search and the cost --------------------------------------------------------
def attainment_curve(c1: int, a1: float, c2: int, a2: float) -> Callable[[int], float]:
    """The true share of requests meeting the objective at a load: logistic in the load,
    through ``a1`` at ``c1`` and ``a2`` at ``c2`` (a smooth knee)."""
    l1, l2 = math.log(a1 / (1 - a1)), math.log(a2 / (1 - a2))
    slope = (l2 - l1) / (c2 - c1)
    return lambda c: 1 / (1 + math.exp(-(l1 + slope * (c - c1))))


def over_runs(curve: Callable[[int], float], run_sd: float) -> Callable[[int], float]:
    """The attainment a load point's runs average to when each run's share varies about the
    curve by ``run_sd`` on the logit (Gauss-Hermite): the truth the search estimates."""
    if not run_sd:
        return curve
    nodes, weights = np.polynomial.hermite_e.hermegauss(40)
    weights = weights / weights.sum()

    def mean(c: int) -> float:
        logit = math.log(curve(c) / (1 - curve(c)))
        return float(np.sum(weights / (1 + np.exp(-(logit + run_sd * nodes)))))
    return mean


def under_runs(curve: Callable[[int], float], run_sd: float) -> Callable[[int], float]:
    """The curve one run follows when runs vary by ``run_sd`` on the logit and their average
    is ``curve`` (the inverse of :func:`over_runs`): a truth stated as the share a fleet sees."""
    if not run_sd:
        return curve
    nodes, weights = np.polynomial.hermite_e.hermegauss(40)
    weights = weights / weights.sum()

    @functools.lru_cache(maxsize=4096)
    def one_run(c: int) -> float:
        share = min(max(curve(c), 1e-9), 1 - 1e-9)
        logit = optimize.brentq(lambda e: float(
            np.sum(weights / (1 + np.exp(-(e + run_sd * nodes))))) - share, -60, 60)
        return 1 / (1 + math.exp(-logit))
    return one_run


def through(points: list[tuple[int, float]]) -> Callable[[int], float]:
    """A smooth falling curve through (load, share) points: monotone cubic (PCHIP) in the
    logit between them, straight beyond."""
    loads = [c for c, _ in points]
    logits = [math.log(a / (1 - a)) for _, a in points]
    inner = interpolate.PchipInterpolator(loads, logits)
    slope = inner.derivative()
    first, last = float(slope(loads[0])), float(slope(loads[-1]))

    def curve(c: int) -> float:
        if c < loads[0]:
            value = logits[0] + first * (c - loads[0])
        elif c > loads[-1]:
            value = logits[-1] + last * (c - loads[-1])
        else:
            value = float(inner(c))
        return 1 / (1 + math.exp(-value))
    return curve


def true_capacity(curve: Callable[[int], float], target: float, ceiling: int) -> int:
    """The largest load whose true attainment reaches the target (the curve falls; a share
    equal to the target, within rounding, reaches it)."""
    return max((c for c in range(1, ceiling + 1) if curve(c) >= target - 1e-9), default=0)


# the objective of a drawn run: each request's TTFT is 0.1 s (within) or 2 s (out)
WAVE_OBJECTIVE = Objective(ttft_ms=1000)


def client_run(ok: np.ndarray, concurrency: int) -> dict:
    """One client run as ``vllm bench serve --save-detailed`` keeps it, at a fixed
    concurrency: the first ``concurrency`` requests sent at once, the next as responses
    complete; request ``i`` within the objective where ``ok[i]``."""
    n = len(ok)
    starts = [0.0] * min(n, concurrency) + [1.0 + 0.01 * i for i in range(n - concurrency)]
    return {"ttfts": [0.1 if k else 2.0 for k in ok], "latencies": [0.5] * n,
            "itls": [[]] * n, "output_lens": [1] * n, "errors": [""] * n, "start_times": starts}


def searched(curve: Callable[[int], float], rng: np.random.Generator, ceiling: int,
             target: float, runs: int, requests: Callable[[int], int],
             run_sd: float, bracket_step: int = 0,
             wave: Callable[[int], float] | None = None, skip_start: bool = True,
             pilot: int = 0, shift: float = 0.0) -> CapacitySearch:
    """The search (``CapacitySearch``) on drawn requests: each run's attainment varies around
    the curve (``run_sd`` on the logit: runs of one point are not identical), each request
    within the objective at that run's rate. ``wave``: the chance at a load that a run's
    start-up wave (its first ``concurrency`` requests, sent at once) misses together; its
    runs are then counted by the search's own rule (``Objective.attainment``, which leaves the
    wave out unless not ``skip_start``); without one, ``requests`` is what a run counts.
    ``pilot``: the search's short first run counts that many. ``shift``: added to every run's
    logit (this session's state: the host, the server's launch)."""
    search = CapacitySearch(ceiling, target, runs, bracket_step=bracket_step, pilot=pilot)
    while (run := search.next_run()) is not None:
        c = run[0]
        p = curve(c)
        rate = p
        if run_sd or shift:  # a share of exactly 0 or 1 has no logit: only drawn when it moves
            logit = math.log(p / (1 - p)) + shift + (rng.normal(0, run_sd) if run_sd else 0.0)
            rate = 1 / (1 + math.exp(-logit))
        n = requests(c)
        if search.is_pilot(*run):
            n = pilot + (c if wave is not None else 0)
        if wave is None:
            search.record(c, int(rng.binomial(n, rate)), n)
            continue
        ok = rng.random(n) < rate
        if rng.random() < wave(c):
            ok[:c] = False
        search.record(c, *WAVE_OBJECTIVE.attainment(client_run(ok, c), skip_start))
    return search


HOLDS, MISSES_TRUTH = "interval holds the truth", "interval misses the truth"


def capacity_draw(curve: Callable[[int], float], ceiling: int, target: float, runs: int,
                  requests: Callable[[int], int], run_sd: float, bracket_step: int = 0,
                  wave: Callable[[int], float] | None = None, skip_start: bool = True,
                  pilot: int = 0, truth: int | None = None) -> Draw:
    """The verdict: whether the capacity's 90% interval (its whole loads; an unbounded end
    holds anything on its side) holds the true capacity, and the point estimate's error
    (capacity - truth, in loads: its bias over draws). The truth is the steady state's
    (``curve`` averaged over the runs' variation, unless given): a start-up ``wave`` is the
    client's, not the load's."""
    if truth is None:
        truth = true_capacity(over_runs(curve, run_sd), target, ceiling)

    def draw(rng: np.random.Generator) -> tuple[str, float]:
        found = searched(curve, rng, ceiling, target, runs, requests, run_sd,
                         bracket_step, wave, skip_start, pilot).result()
        low, high = found["capacity_low"], found["capacity_high"]
        held = (low is None or low <= truth) and (high is None or truth <= high)
        return (HOLDS if held else MISSES_TRUTH), float(found["capacity"] - truth)
    return draw


SESSION, FLEET, ANOTHER = "this session's knee", "the fleet's knee", "another session's point"


def session_draw(fleet: Callable[[int], float], ceiling: int, target: float, runs: int,
                 requests: Callable[[int], int], run_sd: float, session_sd: float,
                 pilot: int, truth: str) -> Draw:
    """Searches in sessions whose state shifts every run's logit by one draw of
    ``session_sd`` (runs within a session vary by ``run_sd`` about it); ``fleet`` is the share
    averaged over both. The verdict: whether the interval holds ``truth``, one of
    :data:`SESSION` (the knee of this session's share averaged over its runs: what the
    interval claims), :data:`FLEET` (the knee over sessions too) or :data:`ANOTHER` (the
    point of a second, independent search: the check of three runs side by side)."""
    one_run = under_runs(fleet, math.hypot(run_sd, session_sd))
    fleet_truth = true_capacity(fleet, target, ceiling)

    def session_truth(shift: float) -> int:
        def shifted(c: int) -> float:
            p = one_run(c)
            return 1 / (1 + math.exp(-(math.log(p / (1 - p)) + shift)))
        return true_capacity(over_runs(shifted, run_sd), target, ceiling)

    def search(rng: np.random.Generator) -> tuple[float, dict]:
        shift = float(rng.normal(0, session_sd)) if session_sd else 0.0
        return shift, searched(one_run, rng, ceiling, target, runs, requests, run_sd,
                               pilot=pilot, shift=shift).result()

    def draw(rng: np.random.Generator) -> tuple[str, float]:
        shift, found = search(rng)
        if truth == ANOTHER:
            at = search(rng)[1]["capacity"]
        else:
            at = session_truth(shift) if truth == SESSION else fleet_truth
        low, high = found["capacity_low"], found["capacity_high"]
        held = (low is None or low <= at) and (high is None or at <= high)
        return (HOLDS if held else MISSES_TRUTH), float(found["capacity"] - at)
    return draw


def _cost_row(name: str, search: CapacitySearch, tps: Callable[[int], float],
              rng: np.random.Generator, sd: float) -> Row:
    """A row as the comparison makes it: the search's capacity through the bench summary's
    own figures (``capacity_figures``: the throughput at the capacity and its interval's ends,
    interpolated over the loads run), each load's throughput over its runs with noise, priced
    at $1/h (``cost.figures``)."""
    points = {}
    for c, point in search.points.items():
        draws = [tps(c) * math.exp(rng.normal(0, sd)) for _ in range(max(1, point.runs))]
        points[c] = PointFigures(metrics={
            tracking.OUTPUT_TOKENS_PER_S: float(np.median(draws)),
            tracking.OUTPUT_TOKENS_PER_S + "_min": min(draws),
            tracking.OUTPUT_TOKENS_PER_S + "_max": max(draws),
            tracking.REQUESTS_PER_S: float(np.median(draws)) / 16})
    found = {**search.result(), "slo": CAPACITY.slo.model_dump() if CAPACITY.slo else {}}
    row = Row(name=name, recipe=name, scheme="S", format="f", precision="p", weight_bytes=1,
              weight_ratio=1.0, serving="ok")
    row.capacity = capacity_figures(found, points, CAPACITY, {})
    row.cost = cost.figures(row, CostTarget(), Price(price_per_hour=1.0))
    return row


def _tps(c: int) -> float:
    return 20.0 * c ** 0.8


def cost_draw(curve: Callable[[int], float], ceiling: int, target: float, runs: int,
              requests: Callable[[int], int], run_sd: float, tps_sd: float, k: int = 0) -> Draw:
    """A variant whose capacity curve and throughput are exactly the baseline's: the cost
    objective's verdict (``cost.cheaper``): "cheaper" is wrong here. ``k``: that many such
    variants, each passing its gate at the baseline's speed, and the verdict the cost
    objective's recommendation among them (``recommend``): recommending one is wrong."""
    def draw(rng: np.random.Generator) -> str:
        names = [BASELINE, *(f"v{i}" for i in range(max(k, 1)))]
        rows = [_cost_row(n, searched(curve, rng, ceiling, target, runs, requests, run_sd), _tps,
                          rng, tps_sd) for n in names]
        if k:
            for row in rows[1:]:
                row.gate_status, row.comparable = gate.PASS, True
                row.headline = PointFigures(speedup=Speedup(1.0, None, None, 0, 0.0,
                                                            INCONCLUSIVE, 1.0))
                row.threshold = 95.0
            return "recommends one" if recommend(rows, "cost")[0] else "recommends none"
        if any(r.cost is None or r.cost.usd_per_million_output_tokens is None for r in rows):
            return "no cost"
        shown, _ = cost.cheaper(rows[1].cost, rows[0].cost)
        return {True: "cheaper", False: "dearer", None: "not shown cheaper"}[shown]
    return draw


# --- the catalogue -----------------------------------------------------------------------------
def two_speed_host(looks: Looks) -> list[Scenario]:
    """The speed verdicts on a host that jumps between two speeds (``MODE_FACTOR``)."""
    label = f"a host at two speeds (x{MODE_FACTOR} in {MODE_SHARE:.0%} of runs)"
    return [
        Scenario("speed", f"true speedup 1.00, {label}", "not faster, not slower",
                 speed_draw(1.0, 0.0, looks, modes=True), {FASTER: ALPHA, SLOWER: ALPHA},
                 fast=False),
        Scenario("recommendation", f"4 variants, none faster (1.00), {label}",
                 "recommend none", recommend_draw(4, 1.0, 0.0, looks, modes=True),
                 {"recommends one": ALPHA}, fast=False),
    ]


def drifting_host(looks: Looks) -> list[Scenario]:
    """The speed verdicts on a host whose speed drifts from run to run (``DRIFT_RHO``)."""
    label = f"a drifting host (run-to-run correlation {DRIFT_RHO}, sd {DRIFT_SD})"
    return [
        Scenario("speed", f"true speedup 1.00, 4 variants interleaved, {label}",
                 "not faster, not slower", drift_draw(4, 1.0, looks),
                 {FASTER: ALPHA, SLOWER: ALPHA}, fast=False),
        Scenario("recommendation", f"4 variants, none faster (1.00), {label}",
                 "recommend none", drift_draw(4, 1.0, looks, "recommendation"),
                 {"recommends one": ALPHA}, fast=False),
    ]


def catalogue(sd_repeat: float, looks: Looks, sd_label: str) -> list[Scenario]:
    """Every scenario, at the per-repeat noise ``sd_repeat`` (the log ratio's spread)."""
    wrong_faster = {FASTER: ALPHA}
    out = [
        Scenario("speed", f"true speedup 1.00, {sd_label}", "not faster, not slower",
                 speed_draw(1.0, sd_repeat, looks), {FASTER: ALPHA, SLOWER: ALPHA}),
        Scenario("speed", f"true speedup 0.97, {sd_label}", "slower",
                 speed_draw(0.97, sd_repeat, looks), wrong_faster),
        Scenario("speed", f"true speedup 1.05, {sd_label}", "faster",
                 speed_draw(1.05, sd_repeat, looks), {SLOWER: ALPHA}),
        Scenario("speed", f"true speedup 0.09 (FP8 on vLLM CPU), {sd_label}", "slower",
                 speed_draw(0.09, sd_repeat, looks), wrong_faster, fast=True),
    ]
    for k in (1, 4, 8):
        out.append(Scenario("recommendation", f"{k} variant(s), none faster (1.00), {sd_label}",
                            "recommend none", recommend_draw(k, 1.0, sd_repeat, looks),
                            {"recommends one": ALPHA}, fast=k == 4))
    out.append(Scenario("recommendation", f"4 variants, none faster (1.00), 2 failing their "
                        f"gates, {sd_label}", "recommend none",
                        recommend_draw(4, 1.0, sd_repeat, looks, failing=2),
                        {"recommends one": ALPHA}, fast=False))
    at_threshold = TaskTruth(286, 0.8, lose=0.04)  # 96.0% exactly
    out += [
        Scenario("gate-task", "a true loss exactly at the threshold (96.0%), 286 items",
                 "not shown to clear 96%", gate_draw({"t": at_threshold}, 96, "task"),
                 {gate.PASS: 0.025}),
        Scenario("gate-suite", "three tasks each exactly at the threshold (96.0%)",
                 "not shown to clear 96%", gate_draw({f"t{i}": TaskTruth(100, 0.8, lose=0.04)
                                                      for i in range(3)}, 96, "suite"),
                 {gate.PASS: 0.025}),
        Scenario("gate-suite", "two tasks gain 3.75%, one (100 items) loses 7.5%: the worked "
                 "case", "a task truly below 96%", gate_draw({
                     "a": TaskTruth(300, 0.8, gain=0.15), "b": TaskTruth(300, 0.8, gain=0.15),
                     "c": TaskTruth(100, 0.8, lose=0.075)}, 96, "suite"), {}),
        Scenario("gate-suite", "three tasks at 100% with 1.5% of items flipping each way "
                 "(the app suite's sizes)", "keeps 100%: passes 96% where n can show it",
                 gate_draw({"facts": TaskTruth(95, 0.8, lose=0.015, gain=0.06),
                            "grammar": TaskTruth(131, 0.8, lose=0.015, gain=0.06),
                            "json": TaskTruth(60, 0.8, lose=0.015, gain=0.06)}, 96, "suite"),
                 {gate.FAIL: 0.025}),
        Scenario("gate-task", "a baseline near chance (0.27, chance 0.25), the variant at "
                 "chance", "nothing to judge", gate_draw({"t": TaskTruth(
                     286, 0.27, lose=0.074, chance=0.25)}, 96, "task"), {gate.PASS: 0.025}),
    ]
    for n in (40, 100, 286):
        out.append(Scenario("gate-task", f"zero flips, {n} items (baseline 0.8)",
                            "recovery 100%: passes 96% where n can show it",
                            gate_draw({"t": TaskTruth(n, 0.8)}, 96, "task"), {gate.FAIL: 0.025},
                            fast=n == 100))
    # the shipped capacity search's requests, runs and target
    shipped = CAPACITY
    assert shipped.slo is not None
    target, runs, ceiling = shipped.slo.target, shipped.repeats, shipped.search_ceiling or 32
    wrong_capacity = {MISSES_TRUTH: round(1 - LEVEL, 6)}
    # a server whose share of requests within the objective falls smoothly, as a fleet sees it
    # (averaged over runs): 97% at 10 users, 90% at 14, 80% at 18, 50% at 24; the capacity at
    # 90% is 14 users at every run-to-run spread (1.5 is what the 2-core CPU shows)
    fall = through([(10, 0.97), (14, 0.90), (18, 0.80), (24, 0.50)])
    for run_sd in (0.0, 1.0, 1.5, 2.0):
        out.append(Scenario(
            "capacity", f"a smooth fall: 97% at 10 users, 90% at 14, 80% at 18, 50% at 24 "
            f"(over runs); runs vary by logit sd {run_sd:g}", "14 users",
            capacity_draw(under_runs(fall, run_sd), ceiling, target, runs, shipped.counted,
                          run_sd, pilot=shipped.search_pilot, truth=14), wrong_capacity,
            fast=run_sd in (0.0, 1.5), bias_bound=1.0))
    # sessions differ: three searches on the AVX-512 EPYC at one objective put int8's knee at
    # 15.4, 16.7 and 16.7 users, its share at 16 users 81% in one (4 runs alike) and 96% in
    # the others, about 1.7 on the logit; so each search draws its own shift of every run's
    # logit. The interval claims this session's knee (judged); what it says of the fleet's knee,
    # and how often it holds another session's point, are shown, not claimed
    for session_sd, truth in ((1.0, SESSION), (1.0, FLEET), (0.0, ANOTHER), (1.0, ANOTHER)):
        out.append(Scenario(
            "capacity", f"the smooth fall (over runs and sessions); runs vary by logit sd 1.0, "
            f"sessions by {session_sd:g}: against {truth}",
            "14 users" if truth == FLEET else truth,
            session_draw(fall, ceiling, target, runs, shipped.counted, 1.0, session_sd,
                         shipped.search_pilot, truth),
            wrong_capacity if truth == SESSION else {}, fast=False,
            bias_bound=1.0 if truth == SESSION else None))
    # curves as the 2-core CPU drew them, not logistic over a doubling bracket: steep through
    # the knee, then a long flat tail near zero; the knee near a doubling load (16), so that
    # the two bracketing runs there land on either side of the target by chance and the knee
    # lies outside the bracket the search first finds (below its bottom, or above its top)
    shapes = [
        ("steep then flat: 99% at 8 users, 95% at 12, 90% at 15, 70% at 17, 30% at 20, 15% at "
         "24, 10% at 32", [(8, 0.99), (12, 0.95), (15, 0.90), (17, 0.70), (20, 0.30),
                           (24, 0.15), (32, 0.10)], 15),
        ("the knee just past a doubling load: 97% at 12 users, 92% at 16, 90% at 17, 60% at 22,"
         " 30% at 28", [(12, 0.97), (16, 0.92), (17, 0.90), (22, 0.60), (28, 0.30)], 17),
    ]
    for label, points, truth in shapes:
        assert true_capacity(through(points), target, ceiling) == truth, label
        for run_sd in (0.0, 1.5):
            out.append(Scenario(
                "capacity", f"{label} (over runs); runs vary by logit sd {run_sd:g}",
                f"{truth} users", capacity_draw(
                    under_runs(through(points), run_sd), ceiling, target, runs,
                    shipped.counted, run_sd, pilot=shipped.search_pilot, truth=truth),
                wrong_capacity, fast=False, bias_bound=1.0))
    # a steeper knee: 95% of requests within the objective at 12 users, 85% at 14 (one run)
    knee = attainment_curve(12, 0.95, 14, 0.85)
    for run_sd, label in ((0.0, "independent runs"), (1.5, "runs vary (logit sd 1.5)")):
        truth = true_capacity(over_runs(knee, run_sd), target, ceiling)
        out.append(Scenario(
            "capacity", f"a steep knee: 95% attain at 12 users, 85% at 14 (one run), target "
            f"{target:.0%}; {label}", f"{truth} users (the largest at >= {target:.0%} over runs)",
            capacity_draw(knee, ceiling, target, runs, shipped.counted, run_sd,
                          pilot=shipped.search_pilot), wrong_capacity, fast=False,
            bias_bound=1.0))

    # as measured on the 2-core CPU: from 6 users on, a run's start-up wave (its users' first
    # requests, sent at once and prefilled together) misses together in half the runs
    def wave(c: int) -> float:
        return 0.5 if c >= 6 else 0.0
    wave_truth = f"{true_capacity(over_runs(knee, 0.3), target, ceiling)} users in steady state"
    wave_name = ("the steep knee; from 6 users half the runs' start-up waves miss together, "
                 "runs vary (logit sd 0.3)")
    out.append(Scenario("capacity", wave_name, wave_truth, capacity_draw(
        knee, ceiling, target, runs, shipped.num_prompts, 0.3, wave=wave,
        pilot=shipped.search_pilot), wrong_capacity, fast=False, bias_bound=1.0))
    out.append(Scenario("capacity", f"{wave_name}; counting the waves (not qpipe's rule: why "
                        "they are left out)", wave_truth, capacity_draw(
                            knee, ceiling, target, runs, shipped.num_prompts, 0.3, wave=wave,
                            skip_start=False, pilot=shipped.search_pilot), {}, fast=False))
    rated = workloads.load("capacity-rate")
    assert rated.slo is not None
    at_rate = replace(rated, rate_start=1.0)  # levels 9% apart from 1 req/s: the knee at 4
    rate_knee = attainment_curve(16, 0.95, 18, 0.85)  # level 17 = 4 req/s
    level = true_capacity(over_runs(rate_knee, 0.3), rated.slo.target, at_rate.levels)
    out.append(Scenario("capacity", "arrival-rate levels 9% apart: 95% attain at 3.7 req/s, "
                        "85% at 4.4; runs vary (logit sd 0.3)",
                        f"level {level} ({at_rate.rate_of(level):.2f} req/s)",
                        capacity_draw(rate_knee, at_rate.levels, rated.slo.target,
                                      rated.repeats, at_rate.num_prompts, 0.3, at_rate.doubling),
                        wrong_capacity, fast=False, bias_bound=1.0))
    out.append(Scenario("cost", "a variant with exactly the baseline's capacity curve and "
                        "throughput (throughput noise 0.05)", "not cheaper",
                        cost_draw(knee, ceiling, target, runs, shipped.counted, 0.0, 0.05),
                        {"cheaper": ALPHA}))
    out.append(Scenario("cost", "4 variants with exactly the baseline's capacity curve and "
                        "throughput, each passing its gate: the cost ranking",
                        "none cheaper: recommends none",
                        cost_draw(knee, ceiling, target, runs, shipped.counted, 0.0, 0.05, k=4),
                        {"recommends one": ALPHA}, fast=False))
    return out
