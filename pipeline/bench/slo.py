"""Capacity at a latency target: the load at which a model's share of requests within an
objective falls to the share asked, estimated with an interval.

An objective bounds each request's latency (``ttft``, ``tpot``, ``e2el``, and ``itl`` as the
request's mean inter-token gap, the per-request terms of ``vllm bench serve --goodput``) and
asks that a share of requests meet every bound: its SLO attainment, the field's measure
(DistServe; GuideLLM's goodput). ``percentile: 90`` asks for 90% of requests within the bounds.

Each run's attainment is counted over its requests (vLLM's ``--save-detailed`` per-request
figures) in steady state: at a fixed concurrency the first requests of a run are sent all at
once and prefilled together, and that start-up wave is not counted (:func:`start_wave`; measured
on the 2-core CPU, it was nearly every miss below the knee). The search (:class:`CapacitySearch`)
brackets the knee by doubling the load while two runs' share reaches the target, lays a grid of
five loads over the bracket, runs each up to ``repeats`` times, extends the grid past an end
the knee turns out to lie beyond (two runs are few: a bracket's ends fall on the wrong side of
the target by chance), lays a finer grid between the two loads the curve crosses between, and
fits the knee over the two it then crosses between (:mod:`pipeline.bench.knee`): the
capacity is the largest whole load at or below it (kept between those two loads). Its 90%
interval is what every load's runs show, runs varying by a random run effect
(:mod:`pipeline.bench.run_effects`): from the largest load shown to meet the target to one below
the smallest shown to miss it, the search adding a load beyond an end none yet shows; its
coverage ``make calibrate`` measures. The ceiling alone decides "censored" (shown
to meet there) or "undecided at the ceiling"; the first load alone "misses at the first load".
It assumes attainment falls with load, as it does for a continuously batching engine once the
machine is busy; every load visited is kept, so a non-monotone curve is visible in the figures.
vLLM's own ``vllm bench sweep serve_workload`` walks a fixed grid with no objective and starts
its own server; this search drives the same ``vllm bench serve`` runs against qpipe's servers,
one run at a time, so that several models' searches interleave run by run.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.bench import knee, run_effects
from pipeline.bench.knee import LEVEL, KneeFit
from pipeline.core.artifacts import CENSORED, ESTIMATED, UNDECIDED_CEILING
from pipeline.core.shares import share_bounds, t_quantile

ALPHA = 0.05  # a point shown to meet (the ceiling) or miss (the first load): one side's error
# each end of the capacity interval: a load shown to meet (or miss) by the random-run-effect
# test at this one-sided level. Not (1 - LEVEL) / 2: the likelihood-ratio test on a search's
# 30-40 runs is liberal, and an end is the most extreme of several loads' tests; at 5% a side
# the interval missed the truth in up to 15% of simulated searches against 10% (make calibrate)
END_ALPHA = 0.025
MIN_RUNS = 2  # full runs per load while bracketing (and the pilot runs)
GRID = 4  # the grid divides the bracket into this many steps (5 loads)
SHARP = 6.0  # a fitted fall of this many log-odds between neighbouring loads: a sharp knee
PILOT = "qpipe_pilot"  # marks a search's short first run: its throughput is no point's figure
# what a search counts; part of a bench run's cache key, so a change re-measures
COUNTED = "requests past each closed-loop run's start-up wave"
# how a point is judged; in a capacity search's cache key likewise
RULE = ("bracket by doubling on each load's share, a grid of 5 loads in the bracket extended "
        "past an end the knee lies beyond, a finer grid where the falling share crosses, the "
        "knee of a quasi-binomial logistic fit over the two loads it crosses between; the "
        "interval from the loads a random-run-effect test shows to meet or miss at 2.5% a "
        "side, loads added beyond an end none shows")

METRICS = ("ttft", "itl", "tpot", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # what `vllm bench serve --goodput` accepts


AUTO = "auto"
Bound = Annotated[float, Field(gt=0)] | Literal["auto"] | None


class Objective(BaseModel):
    """Latency bounds in ms per request, and the share of requests (``percentile``) that must
    meet all of them. A bound ``auto`` is ``factor`` x the baseline's own single-request
    figure, measured in the same bench run before the search (:meth:`derived`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    ttft_ms: Bound = None
    itl_ms: Bound = None
    tpot_ms: Bound = None
    e2el_ms: Bound = None
    percentile: int = Field(90, ge=1, le=99)
    factor: float = Field(4.0, gt=1, le=100)  # an ``auto`` bound: x the single-request figure
    basis: str = ""  # where derived bounds come from, in words

    @model_validator(mode="after")
    def _some_bound(self) -> Objective:
        if not self.bounds() and not self.auto():
            raise ValueError(f"an objective bounds at least one of {', '.join(METRICS)} "
                             "(e.g. ttft_ms: 500, or ttft_ms: auto)")
        return self

    def bounds(self) -> dict[str, float]:
        """metric -> bound in ms, for the metrics bounded by a number."""
        return {m: float(v) for m in METRICS
                if (v := getattr(self, f"{m}_ms")) is not None and v != AUTO}

    def auto(self) -> list[str]:
        """The metrics whose bound is derived from the baseline (``auto``)."""
        return [m for m in METRICS if getattr(self, f"{m}_ms") == AUTO]

    def derived(self, result: dict[str, Any], who: str) -> Objective:
        """The objective with each ``auto`` bound set to ``factor`` x the median (TTFT, TPOT,
        E2EL) or mean (ITL) of one single-request run's requests (``result``: ``who``'s, saved
        with ``--save-detailed``), rounded up to two significant figures; ``basis`` says so."""
        if not self.auto():
            return self
        figures = single_request_figures(result)
        bounds = {f"{m}_ms": _round_up(self.factor * figures[m]) for m in self.auto()}
        measured = ", ".join(f"{m.upper()} {figures[m]:.0f} ms" for m in self.auto())
        return self.model_copy(update={**bounds, "basis": (
            f"{self.factor:g} x {who}'s single-request {measured} (measured in this run, at "
            "concurrency 1)")})

    def result_key(self, metric: str) -> str:
        """The key of ``vllm bench serve``'s saved result holding this metric's percentile."""
        return f"p{self.percentile}_{metric}_ms"

    @property
    def target(self) -> float:
        """The SLO attainment asked: the share of requests within every bound."""
        return self.percentile / 100

    def describe(self) -> str:
        """``90% of requests within TTFT 500 ms and ITL 250 ms``."""
        parts = [f"{m.upper()} {v:g} ms" for m, v in self.bounds().items()]
        parts += [f"{m.upper()} {self.factor:g}x the baseline's" for m in self.auto()]
        return f"{self.percentile}% of requests within " + " and ".join(parts)

    def request_meets(self, ttft_s: float, latency_s: float, itls_s: list[float],
                      output_len: int) -> bool:
        """Whether one request is within every bound (vLLM's per-request goodput terms:
        TPOT is (latency - TTFT) / (output - 1); ITL is the request's mean gap)."""
        tpot = (latency_s - ttft_s) / (output_len - 1) if output_len > 1 else 0.0
        mean_itl = sum(itls_s) / len(itls_s) if itls_s else 0.0
        values = {"ttft": ttft_s, "tpot": tpot, "itl": mean_itl, "e2el": latency_s}
        return all(values[m] * 1000 <= bound for m, bound in self.bounds().items())

    def attainment(self, result: dict[str, Any], skip_start: bool = False) -> tuple[int, int]:
        """(requests within every bound, requests counted) of one client run, from its saved
        per-request figures (``--save-detailed``); a failed request is one that missed.
        ``skip_start``: the run's start-up wave (:func:`start_wave`) is not counted."""
        ttfts = result.get("ttfts")
        if ttfts is None:
            raise ValueError("the client run kept no per-request figures (--save-detailed)")
        errors = result.get("errors") or [""] * len(ttfts)
        skipped = start_wave(result) if skip_start else set()
        rows = [row for i, row in enumerate(zip(ttfts, result["latencies"], result["itls"],
                                                result["output_lens"], errors, strict=True))
                if i not in skipped]
        good = sum(1 for ttft, latency, itls, out, err in rows
                   if not err and out and self.request_meets(ttft, latency, itls or [], out))
        return good, len(rows)

    def min_requests(self, looks: int, alpha: float = ALPHA) -> int:
        """The fewest requests at one load point that can show it meets the target, all of
        them within the bounds, at the point's per-look level (a p99 needs ~300)."""
        return math.ceil(math.log(alpha / looks) / math.log(self.target))

    def goodput_args(self) -> list[str]:
        """``--goodput`` for the bounds vLLM's client counts per request (not ITL)."""
        pairs = [f"{m}:{v:g}" for m, v in self.bounds().items() if m in GOODPUT_METRICS]
        return ["--goodput", *pairs] if pairs else []

    def misses(self, result: dict[str, Any]) -> list[str]:
        """The bounds one client run's percentile misses, as text (the log's summary of a
        run; the verdict is the attainment's)."""
        out = []
        for metric, bound in self.bounds().items():
            value = result.get(self.result_key(metric))
            if value is None:
                out.append(f"{metric.upper()} p{self.percentile} not reported")
            elif value > bound:
                out.append(f"{metric.upper()} p{self.percentile} {value:.0f} ms > {bound:g}")
        return out


def start_wave(result: dict[str, Any]) -> set[int]:
    """The requests of one client run sent before any response was complete: at a fixed
    concurrency the client's users all send at once when the run starts, and that wave is
    prefilled together (on the 2-core CPU its requests shared one TTFT, 2-3x the steady
    state's). It is the load generator's start, not the load a server sees from that many
    users, so the search does not count it (GuideLLM's ``--warmup`` likewise). Where the run
    kept no send times, the first ``max_concurrency`` requests."""
    starts, latencies = result.get("start_times"), result["latencies"]
    errors = result.get("errors") or [""] * len(latencies)
    if not starts:
        return set(range(min(len(latencies), int(result.get("max_concurrency") or 0))))
    ends = [s + lat for s, lat, err in zip(starts, latencies, errors, strict=True) if not err]
    if not ends:
        return set()
    first_end = min(ends)
    return {i for i, s in enumerate(starts) if s < first_end}


def _round_up(value: float) -> float:
    """Up to two significant figures: 349.2 -> 350, 31.04 -> 32."""
    if value <= 0:
        return 1.0
    step = 10 ** (math.floor(math.log10(value)) - 1)
    return float(math.ceil(value / step - 1e-9) * step)


def single_request_figures(result: dict[str, Any]) -> dict[str, float]:
    """Median TTFT, TPOT and E2EL, and the mean ITL, in ms, of one client run's requests."""
    ttfts, latencies = result["ttfts"], result["latencies"]
    outs, itls = result["output_lens"], result["itls"]
    tpots = [(lat - t) / (n - 1) for t, lat, n in zip(ttfts, latencies, outs, strict=True)
             if n and n > 1]
    gaps = [g for row in itls for g in row or []]
    return {"ttft": 1000 * statistics.median(ttfts), "e2el": 1000 * statistics.median(latencies),
            "tpot": 1000 * statistics.median(tpots) if tpots else 0.0,
            "itl": 1000 * statistics.fmean(gaps) if gaps else 0.0}


@dataclass
class Point:
    """One load a search visited: its pilot runs (short, apart) and its full runs' requests
    (within the objective, counted)."""

    concurrency: int
    per_run: list[tuple[int, int]] = field(default_factory=list)
    pilots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def good(self) -> int:
        return sum(g for g, _ in self.per_run)

    @property
    def counted(self) -> int:
        """Requests counted over the full runs (sent, less each run's start-up wave)."""
        return sum(n for _, n in self.per_run)

    @property
    def runs(self) -> int:
        return len(self.per_run)

    @property
    def attainment(self) -> float:
        """The share of the full runs' requests within the objective (each run weighs by its
        requests)."""
        return self.good / self.counted if self.counted else 0.0

    def bounds(self, level: float) -> tuple[float, float]:
        """One-sided bounds of its attainment, each at ``level``: the exact (Clopper-Pearson)
        bounds of its requests, widened, from two runs on, to a t bound on the runs' shares
        with k - 1 degrees of freedom (a run is the unit: its requests share the machine's
        state). Used where one load decides alone: the ceiling, the first load."""
        low, high = share_bounds(self.good, self.counted, level)
        k = self.runs
        if k < 2 or not self.counted:
            return low, high
        share = self.attainment
        # the runs' shares about the pooled one (a ratio estimator's cluster-robust variance)
        own = sum(n * n * (g / n - share) ** 2 for g, n in self.per_run) / self.counted ** 2
        margin = t_quantile(1 - level, k - 1) * math.sqrt(own * k / (k - 1))
        return max(0.0, min(low, share - margin)), min(1.0, max(high, share + margin))


@dataclass
class CapacitySearch:
    """The search for one model, run by the caller one client run at a time:
    ``next_run()`` says which load and run to do, ``record()`` takes its requests.

    Bracket: from ``start``, each load gets ``MIN_RUNS`` full runs; while their share of
    requests within the objective reaches the target the load doubles (or rises by
    ``bracket_step`` levels), up to ``ceiling``. Grid: the last load that reached it and the
    first that did not, and ``grid - 1`` loads evenly between them, each run up to ``max_runs``
    times, one run per load in turn; then more loads (:meth:`_advance`) past an end the knee
    lies beyond and between the two loads it crosses between, and beyond an end of the interval
    that no load yet shows (:meth:`_close`). Estimate: the knee fitted over the two loads it
    then crosses between (:meth:`_window`, :mod:`pipeline.bench.knee`); interval:
    :meth:`_shown`.
    ``pilot``: the first load's first two runs count only this many requests each, so that a
    model that misses everything even there is known in seconds; they are never pooled with
    full runs."""

    ceiling: int
    target: float = 0.9  # the attainment asked (the objective's percentile / 100)
    max_runs: int = 4  # per grid load
    start: int = 1
    level: float = LEVEL  # the knee's interval
    bracket_step: int = 0  # bracketing adds this many levels (0: doubles the load)
    pilot: int = 0
    grid: int = GRID
    points: dict[int, Point] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.ceiling:
            raise ValueError(f"search from {self.start} to {self.ceiling}: start must be "
                             "between 1 and the ceiling")
        self._current = self.start
        self._met = 0  # the highest load whose runs reached the target while bracketing
        self._grid: list[int] = []
        self._step = 1  # how far the grid is extended beyond its ends (doubles each time)
        self._local = False  # whether the grid between the two loads crossed has been run
        self._bracket: tuple[int, int] | None = None
        self._verdicts: dict[tuple, dict[int, int]] = {}  # run_effects.shown, per runs seen
        self._phase = "bracket"  # bracket | ceiling | first | grid | done
        self.outcome = ""  # how it ended, in words (result()["outcome"])

    @property
    def done(self) -> bool:
        return self._phase == "done"

    def is_pilot(self, concurrency: int, run: int) -> bool:
        """Whether this run is one of the short first ones (``pilot`` requests counted)."""
        return bool(self.pilot) and concurrency == self.start and run < MIN_RUNS

    def _point(self, load: int) -> Point:
        return self.points.setdefault(load, Point(load))

    def next_run(self) -> tuple[int, int] | None:
        """(load, run index) of the next run, or None when the search is over; a load's
        pilot runs are its runs 0 and 1."""
        if self._phase == "done":
            return None
        if self._phase == "grid":
            load = min(self._grid, key=lambda c: (self.points[c].runs, c))
            if self.points[load].runs >= self.max_runs:
                if not self._advance():
                    self._phase = "done"
                    return None
                load = min(self._grid, key=lambda c: (self.points[c].runs, c))
        else:
            load = self._current
        point = self._point(load)
        return load, len(point.pilots) + point.runs

    def record(self, concurrency: int, good: int, counted: int) -> None:
        point = self._point(concurrency)
        if self.is_pilot(concurrency, len(point.pilots) + point.runs):
            point.pilots.append((good, counted))
            if len(point.pilots) == MIN_RUNS and not any(g for g, _ in point.pilots):
                self._finish("misses at the first load: no request of the pilot runs met it")
            return
        point.per_run.append((good, counted))
        if self._phase == "grid" or point.runs < MIN_RUNS:
            return
        if self._phase == "bracket":
            self._climb(concurrency, point)
        if self._phase in ("ceiling", "first") and point.runs >= self.max_runs:
            self._judge(concurrency, point)

    def _climb(self, load: int, point: Point) -> None:
        """Up while the load's runs reach the target; the grid once one does not."""
        if point.attainment < self.target:
            if self._met == 0 and load == 1:
                self._phase = "first"  # below the target at one user: is that shown?
            else:
                self._start_grid(self._met, load)
        elif load >= self.ceiling:
            self._phase = "ceiling"  # shown to meet there, or only not shown to miss?
        else:
            self._met = load
            up = load + self.bracket_step if self.bracket_step else load * 2
            self._current = min(self.ceiling, up)

    def _judge(self, load: int, point: Point) -> None:
        """The ceiling or the first load alone, on all its runs: shown to meet or miss there
        at one side's level, or undecided."""
        low, high = point.bounds((1 - self.level) / 2)
        if self._phase == "ceiling":
            self._finish(CENSORED if low >= self.target else UNDECIDED_CEILING)
        elif point.attainment >= self.target:  # one user reached it after all: go on up
            self._phase = "bracket"
            self._climb(load, point)
        else:
            self._finish("misses at the first load" if high < self.target
                         else "undecided at the first load")

    def _finish(self, outcome: str) -> None:
        self.outcome, self._phase = outcome, "done"

    def _start_grid(self, met: int, missed: int) -> None:
        self._bracket = (met, missed)
        self._step = max(1, (missed - met) // self.grid)
        self._add({missed, *([met] if met else []), *self._between(met, missed)})
        self._phase, self.outcome = "grid", ESTIMATED

    def _add(self, loads: set[int]) -> None:
        """Loads to run up to ``max_runs`` times each, with the grid's."""
        self._grid = sorted(set(self._grid) | loads)
        for load in loads:
            self._point(load)

    def _between(self, low: int, high: int) -> set[int]:
        """``grid - 1`` whole loads evenly between ``low`` and ``high`` (fewer where close)."""
        inside = {round(low + j * (high - low) / self.grid) for j in range(1, self.grid)}
        return {c for c in inside if max(low, 0) < c < high}

    def _falling(self) -> dict[int, float]:
        """The grid loads' shares made to fall with load (pool-adjacent-violators, each load
        weighted by its requests): where the curve crosses the target, read past the noise of
        one load's runs (12: 88%, 14: 93% is one load's worth of 90.5% crossing neither)."""
        blocks: list[list[float]] = []  # [good, counted, loads in the block]
        for c in (c for c in self._grid if self.points[c].counted):
            point = self.points[c]
            blocks.append([point.good, point.counted, 1])
            while len(blocks) > 1 and (blocks[-2][0] / blocks[-2][1]
                                       < blocks[-1][0] / blocks[-1][1]):
                good, counted, size = blocks.pop()
                blocks[-1] = [blocks[-1][0] + good, blocks[-1][1] + counted,
                              blocks[-1][2] + size]
        shares = [g / n for g, n, size in blocks for _ in range(int(size))]
        return dict(zip((c for c in self._grid if self.points[c].counted), shares, strict=True))

    def _crossing(self) -> tuple[int, int]:
        """(the highest grid load whose falling share reaches the target, or the bracket's
        bottom; the first that does not, or the top): where the curve crosses."""
        falling = self._falling()
        loads = sorted(falling)
        if not loads:
            return self._bracket or (0, self.start)
        below = next((c for c in loads if falling[c] < self.target), loads[-1])
        above = max((c for c in loads if c < below), default=0)
        return above, below

    def _window(self) -> list[int]:
        """The loads the knee is fitted over: the two the share crosses between. A logistic
        is a local shape: over a whole doubling bracket it misfits a real curve (steep through
        the knee, then flat near zero) and the loads away from the knee pull the crossing
        (``make calibrate`` on such a curve: the interval missed the truth in 29-39% of 200
        searches over the whole grid, in 14.9% of 1,000 with one load either side, against
        10%). The interval is not the fit's: over two loads the slope is often not resolved
        at 90% (:meth:`_shown`)."""
        above, below = self._crossing()
        return [c for c in sorted(self._falling()) if c in (above, below)]

    def _sharp(self, fitted: KneeFit | None) -> bool:
        """Whether the knee is sharper than the loads run can resolve: no fall fitted, or the
        fitted share crossing from above 95% to below 5% between two neighbouring loads."""
        if fitted is None:
            return True
        above, below = self._crossing()
        return abs(fitted.slope) * (below - above) >= SHARP

    def _advance(self) -> bool:
        """Once every grid load has its runs: more loads where the grid has not yet caught
        the knee (True), else the search is over. Above the top while its share still reaches
        the target (the bracketing runs fell below by chance), below the bottom while its share
        is below; then once a grid between the two loads the curve crosses between, and again
        while the knee is sharper than that grid resolves."""
        falling = self._falling()
        top, bottom = max(falling), min(falling)
        if falling[top] >= self.target and top >= self.ceiling:
            low, _ = self.points[top].bounds((1 - self.level) / 2)
            self.outcome = CENSORED if low >= self.target else UNDECIDED_CEILING
            return False
        if falling[top] >= self.target:
            self._add({min(self.ceiling, top + self._step)})
            self._step *= 2
            return True
        if falling[bottom] < self.target and bottom > 1:
            self._add({max(1, bottom - self._step)})
            self._step *= 2
            return True
        above, below = self._crossing()
        if below - above > 1 and (not self._local or self._sharp(self.estimate())):
            self._local = True
            self._add(self._between(above, below))
            return True
        return self._close()

    def _close(self) -> bool:
        """More loads while an end of the interval is open (no load past the crossing shown
        to miss, or none before it shown to meet): one grid step beyond that end of the grid,
        doubling each time, up to the ceiling or down to one user."""
        low, high = self._shown()
        top, bottom = max(self._grid), min(self._grid)
        if high is None and top < self.ceiling:
            self._add({min(self.ceiling, top + self._step)})
        elif low == 0 and bottom > 1:
            self._add({max(1, bottom - self._step)})
        else:
            return False
        self._step *= 2
        return True

    @property
    def bracket(self) -> tuple[int, int] | None:
        """(the last load whose bracketing runs reached the target, the first that did not)."""
        return self._bracket

    def estimate(self) -> KneeFit | None:
        """The knee fitted over the loads about the crossing (:meth:`_window`): None before
        the grid, or where the share does not fall there."""
        if not self._grid:
            return None
        runs = [(c, g, n) for c in self._window() for g, n in self.points[c].per_run]
        if not runs:
            return None
        loads, good, counted = zip(*runs, strict=True)
        return knee.fit(loads, good, counted, self.target, self.level)

    def result(self) -> dict[str, Any]:
        """The capacity: ``capacity`` (the largest whole load at or below the knee; 0: none),
        its interval (``capacity_low``/``capacity_high``; None: unbounded that side),
        ``knee`` (the fitted load, a fraction), how the search ended (``outcome``: estimated,
        censored, undecided at the ceiling, misses at the first load, ...), the bracket the
        grid spanned, the fit, and every load's runs, attainment and fitted share."""
        fitted = self.estimate() if self.outcome == ESTIMATED else None
        sharp = self.outcome == ESTIMATED and self._sharp(fitted)
        if sharp:  # the fit does not resolve it: each load's own bounds do
            fitted = None
            capacity, low, high, knee_at = self._sharp_capacity()
        else:
            capacity, low, high, knee_at = self._capacity(fitted)
        points = {}
        for c, p in sorted(self.points.items()):
            if not p.runs and not p.pilots:
                continue
            lo, hi = p.bounds((1 - self.level) / 2)
            points[c] = {"good": p.good, "counted": p.counted, "runs": p.runs,
                         "pilots": len(p.pilots), "attainment": p.attainment,
                         "low": lo, "high": hi, "grid": c in self._grid,
                         **({"fitted": fitted.attainment(c)} if fitted is not None else {})}
        return {"capacity": capacity, "capacity_low": low, "capacity_high": high,
                "knee": knee_at, "level": self.level, "outcome": self.outcome or "unfinished",
                "censored": self.outcome == CENSORED,
                "bracket": list(self.bracket) if self.bracket else None,
                "first_below": self._crossing()[1] if self._grid else None,
                "fitted_over": self._window() if self._grid else None,
                "fit": fitted.as_dict() if fitted is not None else None,
                "ceiling": self.ceiling, "target": self.target, "points": points}

    def _sharp_capacity(self) -> tuple[int, int | None, int | None, None]:
        """A knee sharper than the loads run: the capacity is the load before the first whose
        share is below the target, its interval each load's own (:meth:`_shown`)."""
        above, _ = self._crossing()
        low, high = self._shown()
        return above, low, high, None

    def _shown(self) -> tuple[int, int | None]:
        """The interval each load's runs show, the curve falling: from the largest grid load
        at or below the crossing shown to meet the target to the one below the smallest at or
        past it shown to miss (None: none shown to miss; 0: none shown to meet), each by the
        random-run-effect test (:mod:`pipeline.bench.run_effects`) at ``END_ALPHA``."""
        above, below = self._crossing()
        run = sorted(c for c in self._grid if self.points[c].runs)
        key = tuple((c, tuple(self.points[c].per_run)) for c in sorted(self.points))
        if key not in self._verdicts:
            runs = {c: p.per_run for c, p in self.points.items() if p.runs}
            self._verdicts[key] = run_effects.shown(runs, self.target, END_ALPHA)[0]
        verdicts = self._verdicts[key]
        met = [c for c in run if c <= above and verdicts.get(c, 0) > 0]
        missed = [c for c in run if c >= below and verdicts.get(c, 0) < 0]
        return max(met, default=0), min(missed) - 1 if missed else None

    def _capacity(self, fitted: KneeFit | None
                  ) -> tuple[int, int | None, int | None, float | None]:
        """(capacity, interval low, interval high, knee) in whole loads, within [0, ceiling]."""
        def whole(x: float) -> int:
            return min(self.ceiling, max(0, math.floor(x + 1e-9)))
        if self.outcome.startswith("misses at the first load"):
            return 0, 0, 0, None
        if self.outcome == "undecided at the first load":
            return 0, 0, self.start, None
        if self.outcome == CENSORED:
            return self.ceiling, self.ceiling, None, None
        if self.outcome == UNDECIDED_CEILING:
            return self.ceiling, None, None, None
        if fitted is None:  # still bracketing (a search cut short): what it reached so far
            return self._met, None, None, None
        above, below = self._crossing()
        low, high = self._shown()
        return min(max(whole(fitted.knee), above), below - 1), low, high, fitted.knee
