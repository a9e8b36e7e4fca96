"""Capacity at a latency target: the highest load at which a model is shown to meet an objective.

An objective bounds each request's latency (``ttft``, ``tpot``, ``e2el``, and ``itl`` as the
request's mean inter-token gap, the per-request terms of ``vllm bench serve --goodput``) and
asks that a share of requests meet every bound: its SLO attainment, the field's measure
(DistServe; GuideLLM's goodput). ``percentile: 90`` asks for 90% of requests within the bounds.

Each load point's attainment is counted over its runs' requests (vLLM's ``--save-detailed`` per-
request figures) in steady state: at a fixed concurrency the first requests of a run are sent all
at once and prefilled together, and that start-up wave is not counted (:func:`start_wave`; measured
on the 2-core CPU, it was nearly every miss below the knee, and whether a wave crossed the bound
decided a whole run). The point is decided sequentially: "meets" once the exact (Clopper-Pearson)
lower bound clears the target, "misses" once the upper bound is below it, each look at ALPHA split
evenly over the point's allowed runs; a point still straddling the target after them is
"undecided". The search is over max concurrency: bracket (1, 2, 4, ... up to a ceiling), then
bisect to one user between the largest load shown to meet and the smallest shown to miss, probing
around undecided points from both sides. The capacity is the largest load shown to meet (a
conservative figure), with its range up to the load below the smallest shown to miss. It assumes
attainment falls with load, as it does for a continuously batching engine once the machine is busy;
every point visited is kept, so a non-monotone curve is visible in the figures. vLLM's own ``vllm
bench sweep serve_workload`` walks a fixed grid with no objective and starts its own server; this
search drives the same ``vllm bench serve`` runs against qpipe's servers, one run at a time, so
that several models' searches interleave run by run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.core.shares import logit, logit_normal_mean, share_bounds, t_quantile

ALPHA = 0.05  # each load point's verdict: the chance it says "meets" where the truth misses
MEETS, MISSES, UNDECIDED = "meets", "misses", "undecided"
MIN_RUNS = 2  # a load point's verdict rests on at least this many runs
PILOT = "qpipe_pilot"  # marks a search's short first run: its throughput is no point's figure
# what a search counts; part of a bench run's cache key, so a change re-measures
COUNTED = "requests past each closed-loop run's start-up wave"
# how a point is judged; in a capacity search's cache key likewise
RULE = "exact and runs' t bounds, widened by the runs' log-odds spread over the search's points"

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
    """One load point of a search: each run's requests (within the objective, counted) and
    the point's verdict."""

    concurrency: int
    looks: int  # the most runs it may have; ALPHA is split evenly over them
    per_run: list[tuple[int, int]] = field(default_factory=list)
    verdict: str | None = None  # meets | misses | undecided; None while it runs
    decided_by: tuple[float, float] | None = None  # the bounds at its last look

    @property
    def good(self) -> int:
        return sum(g for g, _ in self.per_run)

    @property
    def counted(self) -> int:
        """Requests counted (sent, less each run's start-up wave)."""
        return sum(n for _, n in self.per_run)

    @property
    def runs(self) -> int:
        return len(self.per_run)

    @property
    def logits(self) -> list[float]:
        return [logit(g, n) for g, n in self.per_run]

    def bounds(self, alpha: float, spread: RunSpread | None = None) -> tuple[float, float]:
        """One-sided bounds of its attainment (the mean over runs), each at ``alpha`` / its
        looks: the exact (Clopper-Pearson) bounds of its requests, widened, from two runs on,
        to a t bound on the runs' shares with k - 1 degrees of freedom (a run is the unit: its
        requests share the machine's state, and on the 2-core CPU one run at a load kept 100%
        while the next kept 50%), and to the bound ``spread`` gives (how much runs vary at
        the search's other points too: two lucky runs at a point are judged with the spread
        its neighbours showed). Runs that agree, where no point's runs have differed yet,
        leave the exact bounds as they are."""
        level = alpha / self.looks
        low, high = share_bounds(self.good, self.counted, level)
        k = len(self.per_run)
        if k < 2 or not self.counted:
            return low, high
        total = self.counted
        share = self.good / total
        # the spread of the runs' shares about the pooled one (a ratio estimator's
        # cluster-robust variance)
        own = sum(n * n * (g / n - share) ** 2 for g, n in self.per_run) / total ** 2
        margin = t_quantile(1 - level, k - 1) * math.sqrt(own * k / (k - 1))
        low, high = max(0.0, min(low, share - margin)), min(1.0, max(high, share + margin))
        if spread is None:
            return low, high
        # the runs' mean log-odds, with the spread pooled over the search's points; its
        # bounds as mean shares over runs (logit-normal), each end with the spread that is
        # conservative there: the whole for the lower end, the between-run part for the upper
        mean = statistics.fmean(self.logits)
        margin = t_quantile(1 - level, spread.df) * math.sqrt(spread.variance / k)
        return (min(low, logit_normal_mean(mean - margin, math.sqrt(spread.variance))),
                max(high, logit_normal_mean(mean + margin, math.sqrt(spread.between))))

    def look(self, target: float, alpha: float, spread: RunSpread | None = None) -> str | None:
        """The verdict, from two runs on (one run cannot show how runs vary)."""
        low, high = self.bounds(alpha, spread)
        self.decided_by = (low, high)
        if self.runs >= MIN_RUNS and low >= target:
            return MEETS
        if self.runs >= MIN_RUNS and high < target:
            return MISSES
        return UNDECIDED if self.runs >= self.looks else None


@dataclass(frozen=True)
class RunSpread:
    """How much the runs of one load point differ, on the log-odds scale, pooled over a
    search's points: ``variance`` (every run's about its point's mean, with ``df`` degrees of
    freedom) and ``between``, less the requests' own binomial noise."""

    variance: float
    between: float
    df: int


def run_spread(points: Iterable[Point]) -> RunSpread | None:
    """The runs' spread over the points of two runs or more whose runs are not all perfect
    (or all missed): a point at the ceiling of the log-odds shows no spread however much its
    runs vary. None before any such point."""
    squares, df, noise, runs = 0.0, 0, 0.0, 0
    for point in points:
        if point.runs < MIN_RUNS or all(g == n for g, n in point.per_run) or \
                all(g == 0 for g, _ in point.per_run):
            continue
        ys = point.logits
        mean = statistics.fmean(ys)
        squares += sum((y - mean) ** 2 for y in ys)
        df += len(ys) - 1
        for g, n in point.per_run:
            s = (g + 0.5) / (n + 1)
            noise += 1 / ((n + 1) * s * (1 - s))
            runs += 1
    if not df:
        return None
    return RunSpread(squares / df, max(0.0, squares / df - noise / runs), df)


@dataclass
class CapacitySearch:
    """The search for one model, run by the caller one client run at a time:
    ``next_run()`` says which load point and run to do, ``record()`` takes its requests.
    ``pilot``: the first point's first two runs count only this many requests each (0: full
    runs), so that a model missing the objective even there is known in seconds (they are two
    more looks at that point)."""

    ceiling: int
    target: float = 0.9  # the attainment asked (the objective's percentile / 100)
    max_runs: int = 4  # per load point; ALPHA is split evenly over them
    precision: float = 0.0  # stop when the bracket is within this share of its low end (0: 1)
    start: int = 1
    alpha: float = ALPHA
    bracket_step: int = 0  # bracketing adds this many levels (0: doubles the load)
    pilot: int = 0
    points: dict[int, Point] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.ceiling:
            raise ValueError(f"search from {self.start} to {self.ceiling}: start must be "
                             "between 1 and the ceiling")
        self._current = self.start

    @property
    def alpha_look(self) -> float:
        """Each look's level at a point of ``max_runs`` runs."""
        return self.alpha / self.max_runs

    @property
    def done(self) -> bool:
        return self._current == 0

    def is_pilot(self, concurrency: int, run: int) -> bool:
        """Whether this run is one of the short first ones (``pilot`` requests counted)."""
        return bool(self.pilot) and concurrency == self.start and run < MIN_RUNS

    def _with(self, verdict: str) -> list[int]:
        return sorted(c for c, p in self.points.items() if p.verdict == verdict)

    @property
    def low(self) -> int:
        """The largest load shown to meet the objective (0: none)."""
        return max(self._with(MEETS), default=0)

    @property
    def high(self) -> int | None:
        """The smallest load shown to miss it (None: none)."""
        return min(self._with(MISSES), default=None)

    def next_run(self) -> tuple[int, int] | None:
        """(concurrency, run index) of the next run, or None when the search is over."""
        if self.done:
            return None
        looks = self.max_runs + (MIN_RUNS if self.pilot and self._current == self.start else 0)
        point = self.points.setdefault(self._current, Point(self._current, looks))
        return self._current, point.runs

    def record(self, concurrency: int, good: int, counted: int) -> None:
        point = self.points[concurrency]
        point.per_run.append((good, counted))
        point.verdict = point.look(self.target, self.alpha, run_spread(self.points.values()))
        if point.verdict is not None:
            self._current = self._next_concurrency()

    def _next_concurrency(self) -> int:
        """0 when the search is over."""
        low, high = self.low, self.high
        if high is None:  # bracketing upwards from the highest load visited
            top = max(self.points)
            up = top + self.bracket_step if self.bracket_step else top * 2
            return 0 if top >= self.ceiling else min(self.ceiling, max(up, self.start))
        step = max(1, math.floor(low * self.precision))
        unsure = [c for c in self._with(UNDECIDED) if low < c < high]
        below = min(unsure, default=high)  # the first load not shown to meet above low
        if below - low > step:
            return self._unvisited((low + below) // 2)
        above = max(unsure, default=low)  # the last load not shown to miss below high
        if high - above > step:
            return self._unvisited((above + high) // 2)
        return 0

    def _unvisited(self, concurrency: int) -> int:
        return 0 if concurrency < 1 or concurrency in self.points else concurrency

    def result(self) -> dict[str, Any]:
        """``max_concurrency`` (the largest load shown to meet; 0: none), the capacity's range
        (up to the load below the smallest shown to miss; ``censored`` when none missed), and
        every point's attainment, bounds and verdict."""
        low, high = self.low, self.high
        points = {}
        for c, p in sorted(self.points.items()):
            lo, hi = p.decided_by or p.bounds(self.alpha)
            points[c] = {"good": p.good, "counted": p.counted, "runs": p.runs, "looks": p.looks,
                         "attainment": p.good / p.counted if p.counted else 0.0,
                         "low": lo, "high": hi, "verdict": p.verdict or UNDECIDED}
        return {"max_concurrency": low, "capacity_high": high - 1 if high is not None else None,
                "censored": high is None, "first_miss": high, "ceiling": self.ceiling,
                "target": self.target, "alpha_look": self.alpha_look,
                "undecided": self._with(UNDECIDED), "points": points}
