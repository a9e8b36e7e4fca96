"""Workload files (``configs/workloads/*.yaml``) and the ``vllm bench serve`` command for each.

A workload names the context-length distribution, the load points (max concurrency), how
much work each gets, the repeats and the seed. qpipe does not generate load itself: each load
point is one run of vLLM's own benchmark client.

Speed is measured cold: a sweep runs on servers with prefix caching **off**, and every repeat
and load point draws its own prompts (seed + 1000 x repeat + concurrency; the same for every
model, so the comparison stays paired). Caching off rather than only fresh prompts because
the client's random prompts can still share whole blocks (a chat template, a BOS token) and a
warm cache from one run would leak into the next; with it off no request can be served from
another's work, and the engine's hit counters, logged for every run, prove it (a sweep with
hits is an error, not a figure). Prefix reuse is measured on purpose by the workloads that
compare caching on and off (``compare_prefix_caching``), whose prompts share a prefix and
nothing else: distinct suffixes, and a hit rate checked against the share the prefix can give.

A workload with an ``slo`` (a latency objective, :mod:`pipeline.bench.slo`) has no fixed load
points: each model's capacity at the objective is searched for (``search_ceiling`` bounds it).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipeline.bench import request_files
from pipeline.bench.slo import AUTO, MIN_RUNS, Objective
from pipeline.core import paths
from pipeline.core.artifacts import ESTIMATED
from pipeline.core.errors import ConfigError
from pipeline.core.speedup import Looks

WORKLOADS_DIR = paths.CONFIGS_DIR / "workloads"

AUTO_CEILING = 1024  # the most an ``auto`` ceiling searches, whatever the KV cache holds
DATASETS = ("random", "prefix_repetition", "custom", "timed_trace")
PERCENTILES = "50,99"
# part of every measurement's cache key: a change re-measures
WARM_UP = "one batch of the load before each load point's first run; none before a search's"


@dataclass(frozen=True)
class Workload:
    name: str
    path: Path
    sha256: str
    description: str
    dataset: str
    load_points: tuple[int, ...]
    headline: int
    repeats: int
    seed: int
    prompts_per_concurrency: int
    min_prompts: int
    output_len: int
    # work per load point and repeat, in output tokens: enough that repeats agree (a point of
    # 4 requests x 16 tokens swings 2-3x on a slow CPU); adds requests, not load points
    min_output_tokens: int = 0
    input_len: int = 0  # random
    range_ratio: float = 0.0  # random
    prefix_len: int = 0  # prefix_repetition
    suffix_len: int = 0
    num_prefixes: int = 1
    compare_prefix_caching: bool = False
    # which models run it: every one, or only the baseline (what prefix reuse buys is mostly
    # the engine's, not the precision's)
    models: str = "all"
    # with caching off, every model it runs on or only the baseline (a second server each)
    prefix_off_models: str = "all"
    prompts: str = ""  # custom: the prompt file (JSONL), resolved against the workload's folder
    trace: str = ""  # timed_trace: the trace file (JSONL), likewise
    trace_sec_multiplier: float = 1.0  # the trace's timestamps x this = seconds
    trace_chunk_size: int = 16  # prompt tokens per hash id
    file_sha256: str = ""  # the prompt or trace file's content: part of a measurement's identity
    slo: Objective | None = None  # a capacity search instead of fixed load points
    search_ceiling: int = 32  # 0 (``auto``): what each model's KV cache holds (up to AUTO_CEILING)
    search_pilot: int = 0  # requests the first run of a search counts (0: a full run)
    # what the search varies: max concurrency (closed loop: each user waits for its answer) or
    # the arrival rate (open loop: requests arrive at rate_start x 2^(k x rate_step) per second,
    # Poisson at burstiness 1, gamma otherwise; vllm bench serve --request-rate --burstiness)
    search_by: str = "concurrency"
    rate_start: float = 1.0  # requests/s at the first level (0, ``auto``: from the baseline)
    rate_ceiling: float = 64.0  # requests/s: the search stops here
    rate_step: float = 0.125  # levels 2^rate_step apart (0.125: ~9%)
    burstiness: float = 1.0
    run_seconds: float = 20.0  # a rate run sends rate x run_seconds requests (>= min_prompts)
    # a speed sweep's cap: its points are repeated past ``repeats`` while a variant's speedup
    # is undecided (interleaved on a CPU host; 0: exactly ``repeats``)
    max_repeats: int = 0
    # the load points other than the headline: this many repeats (0: ``repeats``); they
    # describe the curve, the decision is the headline's
    curve_repeats: int = 0

    def looks(self, target: str, concurrency: int | None = None) -> Looks:
        """When a speedup of this workload is looked at: at the headline load point (the one
        the decision is made at; ``None``: that one) sequentially up to max_repeats where the
        models are interleaved (CPU), else at ``repeats`` alone. The other load points describe
        the curve: repeating them would cost as much again for no decision."""
        if concurrency not in (None, self.headline):
            n = self.repeats_at(concurrency)
            return Looks.of(n, n)
        last = max(self.repeats, self.max_repeats) if target == "cpu" else self.repeats
        return Looks.of(self.repeats, last)

    def repeats_at(self, concurrency: int) -> int:
        """The first look's repeats at a load point: ``repeats`` at the headline, else
        ``curve_repeats`` where set (at most ``repeats``)."""
        if concurrency == self.headline or not self.curve_repeats:
            return self.repeats
        return min(self.curve_repeats, self.repeats)

    def runs_on(self, model_name: str) -> bool:
        return self.models == "all" or model_name == "baseline"

    def runs_off(self, model_name: str) -> bool:
        return self.runs_on(model_name) and (self.prefix_off_models == "all"
                                             or model_name == "baseline")

    @property
    def by_rate(self) -> bool:
        return self.search_by == "rate"

    @property
    def needs_probe(self) -> bool:
        """Whether the search first measures the baseline alone (an ``auto`` bound or rate)."""
        return bool(self.slo is not None and (self.slo.auto() or (
            self.by_rate and not self.rate_start)))

    def rate_of(self, level: float) -> float:
        """Requests/s at a rate search's level (1: ``rate_start``)."""
        return self.rate_start * 2 ** ((level - 1) * self.rate_step)

    def rate_levels(self, found: dict[str, Any]) -> tuple[float, float | None, float | None]:
        """A rate search's result (:meth:`CapacitySearch.result`) in levels, not whole: the
        fitted knee (rates are not whole; the level below it where none was fitted), and its
        interval, from the largest level shown to meet to the smallest shown to miss (the knee
        lies between; None: open), the knee kept within it. :meth:`rate` gives each in req/s."""
        fit = found.get("fit") or {}
        low, high = found["capacity_low"], found["capacity_high"]
        if found.get("outcome") == ESTIMATED and high is not None:
            high += 1  # the level shown to miss: a rate's knee lies below it, not a level below
        at = float(fit["knee"]) if fit.get("knee") is not None else float(found["capacity"])
        at = min(max(at, float(low or 0)), float(high) if high is not None else at)
        return at, low, high

    def rate(self, level: float | None) -> float | None:
        """Requests/s at a (fractional) level; 0 at level 0, None for None (an open end)."""
        return None if level is None else self.rate_of(level) if level else 0.0

    @property
    def levels(self) -> int:
        """A rate search's highest level: the one at ``rate_ceiling``."""
        return 1 + round(math.log2(self.rate_ceiling / self.rate_start) / self.rate_step)

    @property
    def doubling(self) -> int:
        """Levels per doubling of the rate: the rate search brackets by doubling the rate."""
        return max(1, round(1 / self.rate_step))

    def load_text(self, level: int) -> str:
        """``concurrency 12``, or ``3.36 req/s`` at a rate search's level."""
        if not self.by_rate:
            return f"concurrency {level}"
        return f"{self.rate_of(level):.3g} req/s" if level else "0 req/s"

    def num_prompts(self, concurrency: int) -> int:
        """Requests per run at a load point (a rate search: at its level ``concurrency``)."""
        if self.dataset == "timed_trace":  # the whole trace, at its own pace
            return request_files.trace_requests(Path(self.trace))
        if self.by_rate:
            return max(self.min_prompts, math.ceil(self.rate_of(concurrency) * self.run_seconds))
        by_work = (-(-self.min_output_tokens // self.output_len)
                   if self.min_output_tokens and self.output_len else 0)
        # a capacity search counts min_prompts past each run's start-up wave
        return max(self.min_prompts + self.wave(concurrency),
                   self.prompts_per_concurrency * concurrency, by_work)

    @property
    def counts_past_wave(self) -> bool:
        """A closed-loop capacity search: each run's start-up wave is sent, not counted."""
        return self.slo is not None and not self.by_rate

    def wave(self, concurrency: int) -> int:
        """The requests of a run's start-up wave a search leaves uncounted (its
        ``concurrency`` users' first, sent at once, :func:`slo.start_wave`); 0 elsewhere."""
        return concurrency if self.counts_past_wave else 0

    def counted(self, concurrency: int) -> int:
        """Requests per run a search counts: all but its start-up wave."""
        return self.num_prompts(concurrency) - self.wave(concurrency)

    def pilot_run(self) -> Workload:
        """The workload of a search's short first run: ``search_pilot`` requests counted
        (after the start-up wave, at a fixed concurrency)."""
        return replace(self, min_prompts=self.search_pilot, prompts_per_concurrency=1,
                       min_output_tokens=0, run_seconds=0.0)

    def seed_for(self, concurrency: int, repeat: int) -> int:
        """Distinct prompts for every repeat and load point; the same for every model."""
        return self.seed + 1000 * repeat + concurrency

    def expected_prefix_hit_rate(self, block_size: int, concurrency: int) -> float:
        """The hit rate an ideal prefix cache could reach on one run: every request after the
        first of its prefix reuses the prefix's whole blocks, and nothing else (suffixes are
        distinct). 0 for a workload without a shared prefix."""
        if self.dataset != "prefix_repetition" or block_size <= 0:
            return 0.0
        per_prefix = self.num_prompts(concurrency) // self.num_prefixes
        total = per_prefix * self.num_prefixes
        if total == 0:
            return 0.0
        cached = self.prefix_len // block_size * block_size
        return (total - self.num_prefixes) / total * cached / (self.prefix_len + self.suffix_len)

    @property
    def max_tokens_per_request(self) -> int:
        """Longest prompt + output this workload sends (the engine's max_model_len must fit);
        for a prompt file, its longest output (its prompts are counted by the client)."""
        if self.dataset == "custom":
            return self.output_len or request_files.longest_output(Path(self.prompts))
        if self.dataset == "timed_trace":
            return request_files.trace_longest(Path(self.trace))
        if self.dataset == "random":
            return int(self.input_len * (1 + self.range_ratio)) + int(
                self.output_len * (1 + self.range_ratio)) + 1
        return self.prefix_len + self.suffix_len + self.output_len

    def percentiles(self) -> str:
        extra = [str(self.slo.percentile)] if self.slo is not None else []
        return ",".join(sorted({*PERCENTILES.split(","), *extra}, key=int))

    def client_args(self, concurrency: int, repeat: int = 0) -> list[str]:
        """Arguments of ``vllm bench serve`` that describe this load point and repeat."""
        load = (["--request-rate", f"{self.rate_of(concurrency):.4g}", "--burstiness",
                 f"{self.burstiness:g}"] if self.by_rate else
                ["--max-concurrency", str(concurrency), "--request-rate", "inf"])
        args = ["--dataset-name", self.dataset, "--num-prompts", str(self.num_prompts(concurrency)),
                *load,
                "--seed", str(self.seed_for(concurrency, repeat)), "--ignore-eos",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
                self.percentiles()]
        if self.slo is not None:  # every request's figures: the attainment is counted from them
            args += [*self.slo.goodput_args(), "--save-detailed"]
        if repeat == 0 and not self.compare_prefix_caching and not self.counts_past_wave:
            # one batch of the first prompt before a load point's first run: kernels and batch
            # shapes are warm (the first repeat ran up to 1.5x slower without; the later ones
            # find that server warm at that load, as a warm-up would leave it). Not for prefix
            # comparisons: a warm-up would cache a whole prompt that the run then re-sends.
            # (a trace's cap is no load: a few warm-ups, not one per possible slot). A closed-
            # loop search needs none: its start-up wave, not counted, is that batch.
            warm = min(concurrency, 4) if self.dataset == "timed_trace" or self.by_rate \
                else concurrency
            args += ["--num-warmups", str(warm)]
        if self.dataset == "custom":
            # the prompts as the user sent them, through the model's chat template; their own
            # output_tokens unless output_len is set; every request's lengths kept (report)
            args += ["--dataset-path", self.prompts,
                     "--custom-output-len", str(self.output_len or -1), "--save-detailed"]
        elif self.dataset == "timed_trace":
            # replayed at the trace's own arrival times (vLLM's --self-timed default for it);
            # max concurrency still caps what is in flight
            args += ["--dataset-path", self.trace, "--timed-trace-sec-multiplier",
                     str(self.trace_sec_multiplier), "--timed-trace-chunk-hash-size",
                     str(self.trace_chunk_size), "--save-detailed"]
        elif self.dataset == "random":
            args += ["--random-input-len", str(self.input_len),
                     "--random-output-len", str(self.output_len),
                     "--random-range-ratio", str(self.range_ratio)]
        else:
            args += ["--prefix-repetition-prefix-len", str(self.prefix_len),
                     "--prefix-repetition-suffix-len", str(self.suffix_len),
                     "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                     "--prefix-repetition-output-len", str(self.output_len)]
        return args


FIELDS = {"description": str, "dataset": str, "load_points": list, "headline": int,
          "repeats": int, "seed": int, "prompts_per_concurrency": int, "min_prompts": int,
          "output_len": int, "input_len": int, "range_ratio": (int, float), "prefix_len": int,
          "suffix_len": int, "num_prefixes": int, "compare_prefix_caching": bool,
          "models": str, "prefix_off_models": str, "min_output_tokens": int, "slo": dict,
          "search_ceiling": (int, str), "search_pilot": int,
          "prompts": str, "trace": str, "trace_sec_multiplier": (int, float),
          "trace_chunk_size": int, "max_repeats": int, "curve_repeats": int, "search_by": str,
          "rate_start": (int, float, str), "rate_ceiling": (int, float),
          "rate_step": (int, float), "burstiness": (int, float), "run_seconds": (int, float)}
# the smallest value of each numeric field (and the largest, where there is one)
RANGES: dict[str, tuple[float, float | None]] = {
    "headline": (1, None), "repeats": (1, None), "seed": (0, None),
    "prompts_per_concurrency": (1, None), "min_prompts": (1, None), "output_len": (0, None),
    "input_len": (1, None), "range_ratio": (0, 0.999), "prefix_len": (1, None),
    "suffix_len": (1, None), "num_prefixes": (1, None), "min_output_tokens": (0, None),
    "search_ceiling": (1, None), "search_pilot": (0, None),
    "trace_sec_multiplier": (0.001, None), "trace_chunk_size": (1, None),
    "max_repeats": (0, None), "curve_repeats": (0, None), "rate_start": (0.001, None),
    "rate_ceiling": (0.001, None),
    "rate_step": (0.01, 1), "burstiness": (0.01, None), "run_seconds": (1, None)}
REQUIRED = {"random": ("input_len", "output_len"),
            "prefix_repetition": ("prefix_len", "suffix_len", "output_len"), "custom": (),
            "timed_trace": ()}


def find(name_or_path: str) -> Path:
    found = paths.find_yaml(name_or_path, WORKLOADS_DIR)
    if found:
        return found
    known = ", ".join(paths.yaml_names(WORKLOADS_DIR))
    raise ConfigError(f"unknown workload {name_or_path!r}: the workloads in {WORKLOADS_DIR} are "
                      f"{known}. Set WORKLOAD= to one of them or to a workload YAML file.")


def load(name_or_path: str) -> Workload:
    path = find(name_or_path)
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: malformed YAML ({getattr(err, 'problem', err)}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a workload is a YAML mapping of {', '.join(FIELDS)}.")
    for key, value in data.items():
        if key == "search_precision":
            raise ConfigError(
                f"{path}: field 'search_precision' is no longer read: a capacity search no "
                "longer bisects to a step; it fits the knee over a grid of 5 loads in its "
                "bracket and reports the capacity with a 90% interval (docs/bench.md). Remove "
                "the field; raise repeats (REPEATS=) for a narrower interval.")
        if key not in FIELDS:
            raise ConfigError(f"{path}: unknown field {key!r}; the fields are {', '.join(FIELDS)}.")
        expected = FIELDS[key]
        if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
            raise ConfigError(f"{path}: field {key!r} has the wrong type ({value!r}).")
        if key in ("search_ceiling", "rate_start") and isinstance(value, str):
            if value != AUTO:
                what = ("a number of concurrent requests or 'auto' (the KV cache's limit)"
                        if key == "search_ceiling" else "requests/s or 'auto' (from the "
                        "baseline's single-request latency)")
                raise ConfigError(f"{path}: field {key!r} is {what}, not {value!r}.")
            data = {**data, key: 0}
            continue
        if key in RANGES:
            low, high = RANGES[key]
            if value < low or (high is not None and value > high):
                allowed = f"between {low:g} and {high:g}" if high is not None else \
                    f"at least {low:g}"
                raise ConfigError(f"{path}: field {key!r} must be {allowed} (got {value!r}).")
    dataset = data.get("dataset", "random")
    if dataset not in DATASETS:
        raise ConfigError(f"{path}: dataset {dataset!r} is not one of {', '.join(DATASETS)}.")
    for key in REQUIRED[dataset]:
        if not isinstance(data.get(key), int) or data[key] <= 0:
            raise ConfigError(f"{path}: {dataset} needs a positive integer {key!r}.")
    if dataset == "custom":
        data = _request_file(path, data, "prompts", "a custom workload names its prompt file",
                             request_files.FORMAT, lambda p: request_files.check(
                                 p, needs_output=not data.get("output_len")))
    if dataset == "timed_trace":
        data = _request_file(path, data, "trace", "a timed_trace workload names its trace",
                             request_files.TRACE_FORMAT, lambda p: request_files.check_trace(
                                 p, int(data.get("trace_chunk_size", 16))))
    slo = _objective(path, data)
    if slo is not None and ("load_points" in data or "headline" in data):
        raise ConfigError(f"{path}: a workload with an slo searches for its load points: remove "
                          "load_points and headline (search_ceiling bounds the search).")
    points = data.get("load_points", [] if slo is not None else [1])
    if slo is None and (not points or not all(isinstance(p, int) and p > 0 for p in points)):
        raise ConfigError(f"{path}: load_points must be positive integers (max concurrency).")
    headline = data.get("headline", points[0] if points else 0)
    if points and headline not in points:
        raise ConfigError(f"{path}: headline {headline} is not one of the load_points {points}.")
    for key in ("models", "prefix_off_models"):
        if data.get(key, "all") not in ("all", "baseline"):
            raise ConfigError(f"{path}: {key} is 'all' or 'baseline', not {data[key]!r}.")
    values: dict[str, Any] = {k: v for k, v in data.items() if k not in ("load_points",)}
    values.setdefault("output_len", 0)  # custom: each prompt's own output_tokens
    values.update(load_points=tuple(points), headline=headline, dataset=dataset, slo=slo,
                  description=str(data.get("description", "")),
                  repeats=int(data.get("repeats", 3)), seed=int(data.get("seed", 0)),
                  prompts_per_concurrency=int(data.get("prompts_per_concurrency", 4)),
                  min_prompts=int(data.get("min_prompts", 8)),
                  min_output_tokens=int(data.get("min_output_tokens", 0)))
    if values.get("max_repeats") and values["max_repeats"] < values["repeats"]:
        raise ConfigError(f"{path}: max_repeats ({values['max_repeats']}) is below repeats "
                          f"({values['repeats']}): it caps the repeats a speed sweep adds while "
                          "a speedup is undecided.")
    if values.get("search_by", "concurrency") not in ("concurrency", "rate"):
        raise ConfigError(f"{path}: search_by is 'concurrency' (max concurrency, closed loop) or "
                          f"'rate' (arrival rate, open loop), not {values['search_by']!r}.")
    if values.get("search_by") == "rate" and slo is None:
        raise ConfigError(f"{path}: search_by: rate searches for the arrival rate at an "
                          "objective: add an slo block.")
    if values.get("rate_start", 1.0) and values.get("rate_ceiling", 64.0) <= values.get(
            "rate_start", 1.0):
        raise ConfigError(f"{path}: rate_ceiling ({values.get('rate_ceiling', 64.0):g}) must be "
                          f"above rate_start ({values.get('rate_start', 1.0):g}).")
    if slo is not None and values.get("compare_prefix_caching"):
        raise ConfigError(f"{path}: a capacity search (slo) runs cold; it cannot also compare "
                          "prefix caching (make it two workloads).")
    if dataset == "prefix_repetition" and not values.get("compare_prefix_caching"):
        raise ConfigError(f"{path}: a prefix_repetition workload measures prefix reuse: set "
                          "compare_prefix_caching: true (speed sweeps run with caching off).")
    workload = Workload(name=path.stem, path=path,
                        sha256=hashlib.sha256(text.encode()).hexdigest(), **values)
    check_search(workload)
    return workload


def check_search(workload: Workload) -> None:
    """A capacity search whose load points cannot send enough requests to show the
    attainment it asks for is refused before it starts (a p99 from 24 requests is a maximum,
    not a percentile)."""
    slo = workload.slo
    if slo is None:
        return
    if workload.repeats < MIN_RUNS:
        raise ConfigError(
            f"{workload.path}: repeats {workload.repeats}: a capacity search decides each load "
            f"point on at least {MIN_RUNS} runs (how runs vary is part of the verdict); set "
            f"repeats: 4 (REPEATS=).")
    need = slo.min_requests(workload.repeats)
    most = workload.min_prompts * workload.repeats  # each run counts at least min_prompts
    if most < need:
        raise ConfigError(
            f"{workload.path}: slo percentile {slo.percentile} asks that {slo.percentile}% of "
            f"requests meet the objective; showing it at one load point takes at least {need} "
            f"requests (none missing), but a point here may count only {most} "
            f"({workload.repeats} runs x {workload.min_prompts}, past each run's start-up "
            "wave). Raise min_prompts or repeats (REPEATS=), or lower the percentile.")


def _request_file(path: Path, data: dict[str, Any], key: str, what: str, shape: str,
                  check: Callable[[Path], Path]) -> dict[str, Any]:
    """``data`` with ``key``'s file resolved against the workload's folder, checked, and its
    content's hash (``file_sha256``)."""
    if not data.get(key):
        raise ConfigError(f"{path}: {what}: {key}: FILE.jsonl (one {shape} per line; "
                          "docs/workloads.md).")
    found = check((path.parent / data[key]).resolve())
    return {**data, key: str(found), "file_sha256": hashlib.sha256(found.read_bytes()).hexdigest()}


def _objective(path: Path, data: dict[str, Any]) -> Objective | None:
    if "slo" not in data:
        return None
    try:
        return Objective.model_validate(data["slo"])
    except ValidationError as err:
        first = err.errors()[0]
        # the union's member names ("constrained-float", "literal['auto']") are not fields
        where = ".".join(str(p) for p in ("slo", *first["loc"])
                         if not any(c in str(p) for c in "-["))
        raise ConfigError(f"{path}: field {where!r}: {first['msg']}. An slo is a mapping of "
                          f"{', '.join(Objective.model_fields)}.") from None


def with_objective(workload: Workload, **bounds: float | None) -> Workload:
    """The workload with its objective's bounds replaced where given (SLO_TTFT_MS= ...)."""
    given = {f"{k}_ms": v for k, v in bounds.items() if v is not None}
    if workload.slo is None or not given:
        return workload
    return replace(workload, slo=workload.slo.model_copy(update=given))
