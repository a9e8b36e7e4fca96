"""Capacity at a latency target: the highest load at which a model still meets an objective.

An objective bounds latency percentiles of one client run (``ttft``, ``itl``, ``tpot``,
``e2el`` at a percentile; the terms of ``vllm bench serve --goodput`` where vLLM has them). A
load point meets it when most of its repeats do (each repeat its own cold prompts).

The search is over max concurrency: bracket (1, 2, 4, ... up to a ceiling), then bisect
between the last point that met the objective and the first that did not, until the two are
within ``precision`` of each other. It assumes latency grows with load, as it does for a
continuously batching engine once the machine is busy; every point visited is kept, so a
non-monotone curve is visible in the figures. vLLM's own ``vllm bench sweep serve_workload``
walks a fixed grid between serial and batch load with no objective, and starts its own server;
this search drives the same ``vllm bench serve`` runs against qpipe's servers, one run at a
time, so that several models' searches interleave run by run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

METRICS = ("ttft", "itl", "tpot", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # what `vllm bench serve --goodput` accepts


class Objective(BaseModel):
    """Latency bounds in ms at one percentile of the run's requests (tokens, for ITL)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    ttft_ms: float | None = Field(None, gt=0)
    itl_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)
    e2el_ms: float | None = Field(None, gt=0)
    percentile: int = Field(99, ge=1, le=100)

    @model_validator(mode="after")
    def _some_bound(self) -> Objective:
        if not self.bounds():
            raise ValueError(f"an objective bounds at least one of {', '.join(METRICS)} "
                             "(e.g. ttft_ms: 500)")
        return self

    def bounds(self) -> dict[str, float]:
        """metric -> bound in ms, for the metrics bounded."""
        return {m: v for m in METRICS if (v := getattr(self, f"{m}_ms")) is not None}

    def result_key(self, metric: str) -> str:
        """The key of ``vllm bench serve``'s saved result holding this metric's percentile."""
        return f"p{self.percentile}_{metric}_ms"

    def describe(self) -> str:
        return " and ".join(f"{m.upper()} p{self.percentile} <= {v:g} ms"
                            for m, v in self.bounds().items())

    def goodput_args(self) -> list[str]:
        """``--goodput`` for the bounds vLLM's client counts per request (not ITL)."""
        pairs = [f"{m}:{v:g}" for m, v in self.bounds().items() if m in GOODPUT_METRICS]
        return ["--goodput", *pairs] if pairs else []

    def misses(self, result: dict[str, Any]) -> list[str]:
        """The bounds one client run misses, as text (empty: it meets the objective)."""
        out = []
        for metric, bound in self.bounds().items():
            value = result.get(self.result_key(metric))
            if value is None:
                out.append(f"{metric.upper()} p{self.percentile} not reported")
            elif value > bound:
                out.append(f"{metric.upper()} p{self.percentile} {value:.0f} ms > {bound:g}")
        return out


@dataclass
class Point:
    """One load point of a search: the verdict of each repeat run so far."""

    concurrency: int
    meets: list[bool] = field(default_factory=list)

    def decided(self, repeats: int) -> bool | None:
        """True/False once a majority of ``repeats`` is reached either way; None before."""
        need = repeats // 2 + 1
        if sum(self.meets) >= need:
            return True
        if len(self.meets) - sum(self.meets) >= repeats - need + 1:
            return False
        return None


@dataclass
class CapacitySearch:
    """The search for one model, run by the caller one client run at a time:
    ``next_run()`` says which load point and repeat to run, ``record()`` takes its verdict."""

    ceiling: int
    repeats: int = 3
    precision: float = 0.25  # stop when the bracket is within this share of its low end
    start: int = 1
    points: dict[int, Point] = field(default_factory=dict)
    low: int = 0  # highest concurrency that met the objective (0: none yet)
    high: int | None = None  # lowest concurrency that did not

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.ceiling:
            raise ValueError(f"search from {self.start} to {self.ceiling}: start must be "
                             "between 1 and the ceiling")
        self._current = self.start

    @property
    def done(self) -> bool:
        return self._current == 0

    def next_run(self) -> tuple[int, int] | None:
        """(concurrency, repeat index) of the next run, or None when the search is over."""
        if self.done:
            return None
        point = self.points.setdefault(self._current, Point(self._current))
        return self._current, len(point.meets)

    def record(self, concurrency: int, meets: bool) -> None:
        point = self.points[concurrency]
        point.meets.append(meets)
        verdict = point.decided(self.repeats)
        if verdict is None:
            return
        if verdict:
            self.low = max(self.low, concurrency)
        else:
            self.high = concurrency if self.high is None else min(self.high, concurrency)
        self._current = self._next_concurrency()

    def _next_concurrency(self) -> int:
        """0 when the search is over."""
        if self.high is None:  # bracketing upwards
            if self.low >= self.ceiling:
                return 0
            return min(self.ceiling, max(self.low * 2, self.start))
        if self.low == 0:  # the start missed: bracket downwards
            down = self.high // 2
            return down if down >= 1 and down not in self.points else 0
        if self.high - self.low <= max(1, math.floor(self.low * self.precision)):
            return 0
        mid = (self.low + self.high) // 2
        return 0 if mid in self.points else mid

    def result(self) -> dict[str, Any]:
        """``max_concurrency`` (0: not even the first point), whether the ceiling bounded it
        (``censored``), the bracket, and every point's repeat verdicts."""
        return {"max_concurrency": self.low,
                "censored": self.high is None and self.low >= self.ceiling,
                "first_miss": self.high, "ceiling": self.ceiling,
                "points": {c: p.meets for c, p in sorted(self.points.items())}}
