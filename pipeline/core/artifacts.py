"""Every file one stage leaves for another, typed: where it lives, how it is read and written.

recipe -> :class:`Manifest` (quantize) -> :class:`BenchSummary` (bench) and
:class:`RecoverySummary` / :class:`EvalFailure` (eval) -> ``Comparison`` (report). A reader
never parses another stage's dict by key: it loads the model, which checks the file.
Writes go to a temp file and are renamed into place.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline.core import formats, paths, tracking
from pipeline.core.errors import ConfigError
from pipeline.core.formats import Identified
from pipeline.core.fsutil import write_json_atomic
from pipeline.core.speedup import Speedup, verdict_of

A = TypeVar("A", bound="Artifact")


class Artifact(BaseModel):
    """A JSON artifact at ``artifacts/<DIR>/<baseline>/<name>/<FILE>``; ``load`` returns None
    when the file is missing."""

    model_config = ConfigDict(extra="ignore")
    FILE: ClassVar[str] = ""
    DIR: ClassVar[str] = ""

    @classmethod
    def root(cls, baseline: str) -> Path:
        return paths.artifacts_dir() / cls.DIR / baseline

    @classmethod
    def path(cls, baseline: str, name: str) -> Path:
        """The file of ``name`` (a recipe, a variant, a bench run's key)."""
        return cls.root(baseline) / name / cls.FILE

    @classmethod
    def load(cls: type[A], baseline: str, name: str) -> A | None:
        return cls.read(cls.path(baseline, name))

    @classmethod
    def read(cls: type[A], path: Path) -> A | None:
        try:
            text = path.read_text()
        except OSError:
            return None
        try:
            return cls.model_validate_json(text)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"{path}: not a {cls.__name__} qpipe can read (field {field!r}: "
                              f"{first['msg']}); it was written by another version of qpipe. "
                              "Fix: run the stage that writes it again (FORCE=1).") from None

    def write(self, path: Path) -> Path:
        write_json_atomic(path, json.loads(self.model_dump_json()))
        return path

    def as_read(self: A) -> A:
        """This artifact as a reader of its file gets it (tuples in free-form fields become
        lists): what a stage returns equals what a later run reads back."""
        return type(self).model_validate_json(self.model_dump_json())


# --- quantize -----------------------------------------------------------------------------------
class RecipeInfo(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    path: str = ""
    sha256: str = ""
    scheme: str = "?"
    description: str = ""
    calibration: dict[str, Any] | None = None
    recovery_threshold_pct: float | None = None  # the gate the recipe asks for
    search: dict[str, Any] = Field(default_factory=dict)  # a searched recipe's qpipe.search


class Manifest(Artifact):
    """``artifacts/variants/<baseline>/<recipe>/qpipe_manifest.json``: one quantized variant."""

    FILE: ClassVar[str] = "qpipe_manifest.json"
    DIR: ClassVar[str] = "variants"  # beside the checkpoint: paths.variant_dir
    cache_key: str  # hash of every input: the variant's identity
    baseline: dict[str, str]
    recipe: RecipeInfo
    libraries: dict[str, str] = Field(default_factory=dict)
    hardware: dict[str, str] = Field(default_factory=dict)
    calibration_dtype: str = ""
    quantize_seconds: float = 0.0
    peak_rss_bytes: int = 0
    format: str
    checkpoint_bytes: int
    weight_bytes: int
    baseline_weight_bytes: int = 0
    compression_ratio: float = 0.0
    quantized_layers: int = 0
    quantized_layer_bytes: int = 0
    quantized_layer_bf16_bytes: int = 0
    quantized_layer_bytes_ratio: float | None = None
    # the KV cache the checkpoint asks vLLM for (its kv_cache_scheme); None: a manifest written
    # before it was recorded (`make quantize` records it, reusing the checkpoint)
    kv_dtype: str | None = None
    # its weight format, identified from its config.json (pipeline.core.formats); None: a
    # manifest written before it was recorded (`make quantize` records it, as kv_dtype)
    weights: Identified | None = None

    def recorded(self, baseline: str, name: str) -> Manifest:
        """This manifest, refused if it predates a field the report reads."""
        missing = [f for f in ("kv_dtype", "weights") if getattr(self, f) is None]
        if missing:
            raise ConfigError(
                f"{paths.variant_dir(baseline, name) / self.FILE}: written by an older qpipe "
                f"(no {' or '.join(missing)}). Fix: `make quantize RECIPE={name}` records it, "
                "reusing the checkpoint.")
        return self

    @property
    def precision(self) -> str:
        """The planner's weight precision of this variant (``mixed`` for a searched mix)."""
        return self.weights.precision if self.weights else formats.MIXED


@dataclass(frozen=True)
class Baseline:
    """The baseline model every stage works from: a directory transformers and vLLM load
    (resolved by ``make baseline``, pipeline/quantize/baseline.py; its record on disk is
    :class:`BaselineRecord`)."""

    name: str  # short name used in directory and experiment names
    path: Path  # a local HF model directory (config.json + weights + tokenizer)
    source: str  # what the user asked for: an alias, a directory or a hub id
    identity: str  # sha256 over config.json and the weight files' contents

    def as_dict(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}


class BaselineRecord(Artifact):
    """``artifacts/variants/<baseline>/qpipe_baseline.json``: the baseline as resolved, with
    what the report needs of it (its weight bytes, its ``config.json``), so that nothing
    downstream reads the model directory again."""

    FILE: ClassVar[str] = "qpipe_baseline.json"
    DIR: ClassVar[str] = "variants"
    name: str
    directory: str  # the model directory vLLM and transformers load
    identity: str
    specs: list[str] = Field(default_factory=list)  # every BASELINE= that resolved to it
    weight_bytes: int
    config: dict[str, Any]  # the model's config.json: the capacity planner's input

    def baseline(self) -> Baseline:
        """The baseline this record was written for (its first spec as its source)."""
        return Baseline(self.name, Path(self.directory), (self.specs or [self.name])[0],
                        self.identity)

    @classmethod
    def path_of(cls, baseline: str) -> Path:
        return cls.root(baseline) / cls.FILE

    @classmethod
    def of(cls, baseline: str) -> BaselineRecord | None:
        return cls.read(cls.path_of(baseline))

    @classmethod
    def find(cls, spec: str) -> BaselineRecord:
        """The record a ``BASELINE=`` resolved to before (its name, a spec or its path)."""
        local = str(Path(spec).expanduser().resolve()) if Path(spec).expanduser().exists() \
            else None
        for path in sorted(paths.variants_dir().glob(f"*/{cls.FILE}")):
            record = cls.read(path)
            if record is not None and ({spec, spec.lower()} & {record.name, *record.specs}
                                       or local == record.directory):
                return record
        raise ConfigError(
            f"no baseline {spec!r} in {paths.variants_dir()} (no {cls.FILE}): nothing was "
            "quantized, benched or scored for it here. Fix: `make all BASELINE=...`, or the "
            "stages one by one (`make quantize`, `make bench`, `make eval`) first.")



def manifests(baseline: str, recipes: list[str] | None = None) -> dict[str, Manifest]:
    """Recipe -> manifest of the named variants (default: every one on disk)."""
    root = paths.variants_dir() / baseline
    if recipes is None:
        recipes = sorted(p.name for p in root.glob("*") if (p / Manifest.FILE).is_file())
    found = {}
    for name in recipes:
        manifest = Manifest.load(baseline, name)
        if manifest is None:
            raise ConfigError(
                f"no variant {name!r} of {baseline} in {paths.variant_dir(baseline, name)} (no "
                f"readable {Manifest.FILE}). Fix: run `make quantize RECIPE={name}` first, or "
                "leave RECIPE= empty for every variant on disk.")
        found[name] = manifest
    return found


# --- sensitivity (precision search) -------------------------------------------------------------
class UnitDamage(BaseModel):
    """One unit quantized alone in one format: its bytes and the damage on held-out text."""

    unit: str
    format: str
    bytes: int
    kl_div_mean: float  # nats per token, KL(baseline || this unit quantized)
    top1_agreement: float


class SensitivityTable(Artifact):
    """``artifacts/sensitivity/<baseline>/<menu>/sensitivity.json``: every unit in every format
    of the menu (``qpipe sensitivity``), what ``qpipe search`` chooses from."""

    FILE: ClassVar[str] = "sensitivity.json"
    DIR: ClassVar[str] = "sensitivity"
    cache_key: str  # baseline identity, menu, text, tokens, fusions, libraries, method
    baseline: dict[str, str]
    architecture: str
    fusions: dict[str, list[str]]  # vLLM's packed_modules_mapping for the architecture
    fusion_source: str
    formats: list[str]
    units: dict[str, list[str]]  # unit -> its layers (one GEMM in vLLM)
    damages: list[UnitDamage]
    fixed_bytes: int  # weights outside every unit (embeddings, norms): the same in any choice
    baseline_weight_bytes: int
    text: str
    text_sha256: str
    tokens: int
    method: str
    device: str
    dtype: str
    seconds: float
    libraries: dict[str, str] = Field(default_factory=dict)

    @staticmethod
    def menu_name(formats: list[str]) -> str:
        return "+".join(formats)

    def damage(self, unit: str, fmt: str) -> UnitDamage:
        for entry in self.damages:
            if entry.unit == unit and entry.format == fmt:
                return entry
        raise KeyError((unit, fmt))

    def predicted(self, choice: dict[str, str]) -> tuple[int, float]:
        """(total weight bytes, summed damage) of unit -> format ``choice``."""
        picked = [self.damage(unit, choice[unit]) for unit in self.units]
        return (self.fixed_bytes + sum(d.bytes for d in picked),
                sum(d.kl_div_mean for d in picked))

    def uniform(self, fmt: str) -> tuple[int, float]:
        """(bytes, summed damage) with every unit in ``fmt``."""
        return self.predicted(dict.fromkeys(self.units, fmt))


# --- bench --------------------------------------------------------------------------------------
class AttainmentPoint(BaseModel):
    """One load a capacity search visited: requests within the objective over those counted
    in its full runs, its runs and pilot runs, the attainment's one-sided bounds, whether it
    was on the grid the knee was fitted over, and the fitted share there."""

    model_config = ConfigDict(extra="ignore")
    good: int
    counted: int
    runs: int = 0
    pilots: int = 0
    attainment: float
    low: float
    high: float
    grid: bool = False
    fitted: float | None = None
    rate: float | None = None  # a rate search: the level's arrival rate (requests/s)


# how a capacity search ended (Capacity.outcome)
ESTIMATED, CENSORED, UNDECIDED_CEILING = "estimated", "censored", "undecided at the ceiling"


class Capacity(BaseModel):
    """A capacity search at a latency objective, as the bench recorded it: the capacity (the
    largest whole load at or below the fitted knee of the attainment curve) with its interval,
    how the search ended, every load visited, and the throughput at the capacity and at the
    interval's ends (figures under their MLflow metric names; a bound is exported under a name
    that says so: :meth:`metrics`)."""

    model_config = ConfigDict(extra="ignore")
    workload: str
    objective: str
    objective_basis: str = ""
    search_by: Literal["concurrency", "rate"] = "concurrency"
    traffic: str = ""  # the traffic model the capacity assumes, in words
    capacity: int = 0  # in whole loads (a rate search: its level); 0: none
    capacity_low: int | None = None  # the interval's ends (None: unbounded on that side)
    capacity_high: int | None = None
    knee: float | None = None  # the fitted load (a fraction; None: none fitted)
    level: float = 0.9  # the interval's confidence
    outcome: str = ""  # estimated | censored | undecided at the ceiling | misses at ...
    censored: bool = False  # the ceiling was shown to meet the objective: capacity >= it
    bracket: list[int] | None = None  # the grid's ends: last load reached, first not
    fit: dict[str, float | int | None] | None = None
    ceiling: int | None = None
    ceiling_from: str = ""
    target: float = 0.9  # the attainment the objective asks for
    rate_start: float | None = None
    rate_ceiling: float | None = None
    points: dict[str, AttainmentPoint] = Field(default_factory=dict)
    bounds: dict[str, float] = Field(default_factory=dict)  # the latency bounds, by figure
    limited_by: str = ""
    slo_max_concurrency: int | None = None  # the capacity in users
    slo_capacity_low: int | None = None
    slo_capacity_high: int | None = None
    slo_max_request_rate: float | None = None  # a rate search's: requests/s at the knee
    slo_request_rate_low: float | None = None
    slo_request_rate_high: float | None = None
    slo_attainment: float | None = None  # the fitted share at the capacity
    slo_requests_per_s: float | None = None
    slo_requests_per_s_min: float | None = None
    slo_requests_per_s_max: float | None = None
    slo_requests_per_s_at_low: float | None = None  # at the interval's low end
    slo_requests_per_s_at_high: float | None = None
    slo_output_tokens_per_s: float | None = None
    slo_output_tokens_per_s_min: float | None = None
    slo_output_tokens_per_s_max: float | None = None
    slo_output_tokens_per_s_at_low: float | None = None
    slo_output_tokens_per_s_at_high: float | None = None
    slo_goodput_requests_per_s: float | None = None
    slo_goodput_requests_per_s_min: float | None = None
    slo_goodput_requests_per_s_max: float | None = None
    # in a comparison row: the bounded latencies at each point, the run it comes from, and
    # whether it was searched at another objective than the comparison's (shown, not ranked)
    curve: dict[int, dict[str, float]] = Field(default_factory=dict)
    measurement: str = ""
    other_objective: bool = False
    price: Price | None = None  # the devices of the run that measured it, priced (compare)

    @property
    def by_rate(self) -> bool:
        return self.search_by == "rate"

    @property
    def best(self) -> float | None:
        """The capacity: concurrent users, or requests/s for a rate search."""
        return self.slo_max_request_rate if self.by_rate else self.slo_max_concurrency

    @property
    def interval(self) -> tuple[float | None, float | None]:
        """The capacity's interval in its unit (users or requests/s); None: unbounded."""
        if self.by_rate:
            return self.slo_request_rate_low, self.slo_request_rate_high
        return self.slo_capacity_low, self.slo_capacity_high

    @property
    def undecided(self) -> bool:
        """The search ended without a capacity to stand on (undecided at the ceiling or at
        the first load)."""
        return self.outcome.startswith("undecided")

    def text(self, users: str = "") -> str:
        """``14 [11-17]`` (the capacity and its interval), ``14 [11-?]`` (unbounded above),
        ``10 [10-10]`` (10 shown to meet, 11 to miss), ``>= 32 (censored)``, ``32? (undecided
        at the ceiling)``; a rate search's in req/s, a concurrency search's followed by
        ``users`` (its unit in words)."""
        def unit(v: float | None) -> str:
            if v is None:
                return "?"
            return f"{v:.3g}" if self.by_rate else f"{v:.0f}"
        best = self.best or 0
        suffix = " req/s" if self.by_rate else users
        if self.censored:
            return f">= {unit(best)}{suffix} (censored)"
        if self.undecided:
            return f"{unit(best)}?{suffix} ({self.outcome})"
        low, high = self.interval
        if not self.outcome:  # recorded before intervals
            return f"{unit(best)}{suffix}"
        return f"{unit(best)} [{unit(low)}-{unit(high)}]{suffix}"

    def metrics(self) -> dict[str, float]:
        """Its figures under their MLflow metric names (``slo_*``); a censored capacity, which
        is only a lower bound, as ``<name>_lower_bound``, never as a plain figure."""
        out = {k: float(v) for k, v in self.model_dump().items()
               if k.startswith("slo_") and v is not None}
        if self.censored or self.undecided:
            for key in ("slo_max_concurrency", "slo_max_request_rate"):
                if key in out:
                    out[key + ("_lower_bound" if self.censored else "_undecided")] = out.pop(key)
        return out


class EngineUse(BaseModel):
    """What a served model's engine chose and used, from its log and metrics."""

    model_config = ConfigDict(extra="ignore")
    scheme: str = ""
    kernels: list[str] = Field(default_factory=list)
    fp8_weight_only: bool = False
    enforce_eager: bool | None = None
    devices: int = 1  # TP x PP
    engine_weight_memory_bytes: int | None = None  # one worker's "Model loading took" x devices
    engine_weight_memory_bytes_per_device: int | None = None
    kv_cache_dtype: str = ""
    kv_budget_source: str = ""
    kernels_by_layer: dict[str, str] = Field(default_factory=dict)  # W4A16 on a GPU
    kernels_by_layer_text: str = ""
    plan_note: str = ""  # the planner refused the model: why (the engine's figures still hold)
    plan_check: str = ""  # the planner's KV figures off the engine's by more than 10%: which


# a speedup's fields as MLflow metrics (and as bench summaries before it was typed held them)
_SPEEDUP_METRICS = {"point": tracking.SPEEDUP, "low": tracking.SPEEDUP_CI_LOW,
                    "high": tracking.SPEEDUP_CI_HIGH, "n": tracking.SPEEDUP_N,
                    "level": tracking.SPEEDUP_LEVEL, "p_faster": tracking.SPEEDUP_P_FASTER}


class PointFigures(BaseModel):
    """One model's figures at one load point: the client's measurements (medians and spread,
    under their MLflow metric names) and, for a variant, its speedup against the baseline run
    on the same prompts, a typed verdict. Flattened to metric names only for MLflow
    (:meth:`flat`). Falsy when nothing was measured."""

    model_config = ConfigDict(extra="forbid")
    metrics: dict[str, float] = Field(default_factory=dict)
    speedup: Speedup | None = None  # None: the baseline, or no paired runs
    speedup_log_sd: float | None = None  # the spread of the per-repeat log ratios

    @model_validator(mode="before")
    @classmethod
    def _from_flat(cls, value: Any) -> Any:
        """A bench summary written before the speedup was typed: one flat metric dict."""
        if not isinstance(value, dict) or "metrics" in value or not value or \
                not all(isinstance(v, int | float) for v in value.values()):
            return value
        flat = dict(value)
        out: dict[str, Any] = {"speedup_log_sd": flat.pop(tracking.SPEEDUP_LOG_SD, None)}
        taken = {f: flat.pop(m, None) for f, m in _SPEEDUP_METRICS.items()}
        if taken["point"] is not None:
            out["speedup"] = Speedup(
                taken["point"], taken["low"], taken["high"], int(taken["n"] or 0),
                taken["level"] or 0.0, verdict_of(taken["low"], taken["high"]),
                1.0 if taken["p_faster"] is None else taken["p_faster"])
        return {**out, "metrics": flat}

    def __bool__(self) -> bool:
        return bool(self.metrics) or self.speedup is not None

    def get(self, metric: str, default: float | None = None) -> float | None:
        """A measurement by its metric name (``output_tokens_per_s``, ``ttft_ms_p50``)."""
        return self.metrics.get(metric, default)

    def flat(self) -> dict[str, float]:
        """Every figure under its MLflow metric name (where MLflow is written, only)."""
        out = dict(self.metrics)
        if self.speedup is not None:
            out.update({m: float(v) for f, m in _SPEEDUP_METRICS.items()
                        if (v := getattr(self.speedup, f)) is not None})
        if self.speedup_log_sd is not None:
            out[tracking.SPEEDUP_LOG_SD] = self.speedup_log_sd
        return out


class WorkloadFigures(BaseModel):
    """One model's figures for one workload: per load point, and the cache counters."""

    model_config = ConfigDict(extra="ignore")
    points: dict[int, PointFigures] = Field(default_factory=dict)
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_hit_tokens: float = 0.0
    prefix_cache_query_tokens: float = 0.0
    prefix_cache_expected_hit_rate: float | None = None
    prefix_cache_ttft_speedup: float | None = None
    # a capacity search (workload with an slo): its objective, result and the figures at it
    capacity: Capacity | None = None
    # a prompt file's requests as sent: their count and token lengths (p50, p90, max)
    lengths: dict[str, float] | None = None

    def counters(self) -> dict[str, float]:
        """The cache figures, under their metric names."""
        return {k: v for k, v in self.model_dump(exclude={"points", "capacity", "lengths"}
                                                 ).items() if v is not None}


class ModelBench(BaseModel):
    """Everything bench measured for one model."""

    model_config = ConfigDict(extra="ignore")
    recipe: str
    status: str  # ok | unsupported (a hardware limit) | failed (anything else)
    identity: str
    format: str
    serve_command: str = ""
    reason: str = ""
    log: str = ""
    kv: dict[str, float] = Field(default_factory=dict)
    engine: EngineUse = Field(default_factory=EngineUse)
    peak_memory_bytes: int = 0
    workloads: dict[str, WorkloadFigures] = Field(default_factory=dict)


class BenchSummary(Artifact):
    """``artifacts/bench/<baseline>/<key>/summary.json``: one bench run, every model."""

    FILE: ClassVar[str] = "summary.json"
    DIR: ClassVar[str] = "bench"
    baseline: str
    target: str
    key: str = ""
    measured: str = ""
    seconds: float = 0.0  # the bench run's wall time: servers, every run, the reference probe
    engine: dict[str, Any] = Field(default_factory=dict)
    hardware: dict[str, Any] = Field(default_factory=dict)
    # what each server used (hardware.serving_devices): the devices its figures are priced on
    devices: dict[str, Any] = Field(default_factory=dict)
    speedup_pairing: str = ""
    # the reference of every speedup: the baseline's dtype, why, and the probe that chose it
    reference: dict[str, Any] = Field(default_factory=dict)
    workloads: list[str] = Field(default_factory=list)
    headline: dict[str, int] = Field(default_factory=dict)
    models: dict[str, ModelBench] = Field(default_factory=dict)

    @classmethod
    def all(cls, baseline: str) -> list[tuple[Path, BenchSummary]]:
        """Every finished bench run of this baseline, newest first."""
        found = [p for p in cls.root(baseline).glob(f"*/{cls.FILE}")
                 if not p.parent.name.startswith(".")]
        found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        out = []
        for path in found:
            summary = cls.read(path)
            if summary is not None:
                out.append((path, summary))
        return out


# --- eval ---------------------------------------------------------------------------------------
SERVED = "served"  # lm-eval local-completions against vLLM: the serving numerics
EMULATED = "emulated"  # lm-eval hf on de-compressed weights


# how a task's recovery interval was computed
EXACT, BOOTSTRAP = "exact (Clopper-Pearson on the losses)", "bootstrap"


@dataclass(frozen=True)
class Recovery:
    """Recovery of one task and metric (computed by pipeline/eval/recovery.py), as eval writes
    it and the gate and the report read it; percentages, None where undefined."""

    n: int
    baseline_score: float
    variant_score: float
    chance: float
    meaningful: bool
    recovery_pct: float | None  # None: not meaningful, or a zero baseline
    ci_low: float | None
    ci_high: float | None
    flips: int
    flip_rate: float
    gained: int  # wrong (lower) under the baseline, right (higher) under the variant
    lost: int
    certifiable_pct: float | None = None  # the lower end with zero flips: the best n can show
    method: str = EXACT
    above_chance_pct: float | None = None  # (variant - chance) / (baseline - chance), where
    # the task has a chance level


class TaskEntry(BaseModel):
    """One task scored on one variant, with what it was scored on."""

    model_config = ConfigDict(extra="ignore")
    suite: str
    backend: str
    primary_metric: str
    recovery: dict[str, Recovery]  # metric key -> its recovery
    identity: str = ""  # the variant's checkpoint
    baseline_identity: str = ""
    task_sha: str = ""  # the task file and its data
    settings: dict[str, Any] = Field(default_factory=dict)
    command: str = ""
    updated: str = ""

    def primary(self) -> Recovery | None:
        return self.recovery.get(self.primary_metric)


class RecoverySummary(Artifact):
    """``artifacts/evals/<baseline>/<recipe>/recovery.json``: a variant's scored tasks."""

    FILE: ClassVar[str] = "recovery.json"
    DIR: ClassVar[str] = "evals"
    baseline: str
    recipe: str | None = None
    identity: str = ""
    tasks: dict[str, TaskEntry] = Field(default_factory=dict)
    hardware: dict[str, Any] = Field(default_factory=dict)
    divergence: dict[str, Any] | None = None



class EvalFailure(Artifact):
    """Beside recovery.json while a variant's last scoring failed, or no backend here can
    score it (``unsupported``: vLLM refused it and it cannot be de-compressed)."""

    FILE: ClassVar[str] = "eval_failure.json"
    DIR: ClassVar[str] = "evals"  # beside recovery.json
    identity: str
    reason: str
    stage: str = "eval"
    status: str = "failed"  # failed | UNSUPPORTED (a limit of the format here, not a failure)
    hardware: str = ""
    when: str = ""



# --- report -------------------------------------------------------------------------------------
NOT_EVALUATED = "not evaluated"
UNSUPPORTED = "unsupported"  # a limit of the format here (serving, or scoring: EvalFailure.status)


class PlanTarget(BaseModel):
    """Where the planner places each variant: an accelerator preset (or memory) and contexts.
    ``gpu: auto`` is the card this machine has (its preset, else its memory), or h100-80gb on
    a host without a GPU (decided by :func:`pipeline.report.placement.resolve_plan_target`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    gpu: str = "auto"
    context: int = Field(2048, ge=1)
    max_context: int = Field(8192, ge=1)
    memory_gb: float | None = Field(None, gt=0)


class CostTarget(BaseModel):
    """What cost figures are computed for: the price of one device-hour of the machine a
    capacity was measured on, multiplied by the devices that run's server used (TP x PP GPUs,
    or one host), and a target load. ``price_per_device_hour: null`` takes that machine's
    accelerator preset's price (``configs/accelerators``), or ``host_price_per_device_hour`` on
    a host without a GPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    price_per_device_hour: float | None = Field(None, gt=0)
    host_price_per_device_hour: float = Field(0.10, gt=0)
    target_users: int | None = Field(None, gt=0)  # concurrent users to serve
    target_rps: float | None = Field(None, gt=0)  # requests per second to serve

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for old, new in RENAMED_PRICES.items():
                if old in value:
                    raise ValueError(f"{old} is now {new}: USD per device-hour, multiplied by "
                                     "the devices of the run that measured each capacity")
        return value


# a price's old names, refused with the new one named (one unit: USD per device-hour)
RENAMED_PRICES = {"price_per_hour": "price_per_device_hour",
                  "host_price_per_hour": "host_price_per_device_hour"}


class Price(BaseModel):
    """The hourly price of what one server used (``devices`` x ``price_per_device_hour``),
    where it comes from, and whether it is an example figure (every price the user did not
    set)."""

    price_per_hour: float  # per server: devices x price_per_device_hour
    price_per_device_hour: float | None = None
    devices: int = 1
    example: bool = True
    source: str = ""

    @property
    def basis(self) -> str:
        """``example`` (a price the user did not set) or ``set``."""
        return "example" if self.example else "set"


class SuiteFigure(BaseModel):
    """A suite's recovery on one variant: the mean of its meaningful tasks' recoveries with its
    interval (None: no task above chance), and the backend its tasks were scored on."""

    recovery_pct: float | None
    ci_low: float | None
    ci_high: float | None
    tasks: list[str] = Field(default_factory=list)  # the tasks that entered the mean
    skipped: list[str] = Field(default_factory=list)  # not meaningful (or a zero baseline)
    items: int = 0  # items of the tasks that entered the mean
    certifiable_pct: float | None = None  # the best lower end these tasks could give together
    backend: str = SERVED  # emulated where any of its tasks was

    @property
    def meaningful(self) -> bool:
        return self.recovery_pct is not None


class PlanFigures(BaseModel):
    """The capacity planner's figures for one row at the comparison's plan target, under the
    planner's own names (``qpipe plan --json``, the variant runs' MLflow metrics)."""

    planned_kv_bytes_per_token: float
    planned_kv_bytes_per_request: float
    planned_weight_bytes: int
    planned_kv_budget_bytes: int
    planned_kv_cache_tokens: int
    planned_max_concurrency_worst_case: int
    planned_max_concurrency_paged: int
    planned_max_concurrency_paged_shared_prefix: int
    planned_vllm_max_concurrency: float


class Prediction(BaseModel):
    """What the precision search's sensitivity model predicted for a variant: its held-out
    KL and weight bytes, and from what (its searched recipe, or the table with every unit in
    one format)."""

    predicted_kl: float
    predicted_weight_bytes: int = 0
    basis: str
    predicted_speedup: float | None = None  # a speed budget's: from the uniform speedups
    # and at the ends of their intervals (the budget holds at the low end)
    predicted_speedup_low: float | None = None
    predicted_speedup_high: float | None = None
    uniform: bool = False  # a shipped uniform recipe's (the table's sum), not a searched one's

    HELD: ClassVar[tuple[float, float]] = (0.75, 1.33)  # measured/predicted: the prediction held
    # A difference this small is the check's, not the prediction's: the check runs in bf16,
    # the scan in float32, and on the embedded model the baseline alone is 0.001 nats/token
    # apart between the two (a searched mix predicted 0.0037 measured 0.0055 in bf16, 0.0037
    # in float32).
    FLOOR: ClassVar[float] = 0.002

    def ratio(self, measured: float | None) -> float | None:
        """Measured over predicted KL (None where either is missing)."""
        return measured / self.predicted_kl if measured is not None and self.predicted_kl > 0 \
            else None

    def held(self, measured: float | None) -> bool | None:
        """Whether the measured KL is within ``HELD`` of the prediction, or within ``FLOOR``
        of it (None: not measured)."""
        found = self.ratio(measured)
        if found is None or measured is None:
            return None
        return self.HELD[0] <= found <= self.HELD[1] or \
            abs(measured - self.predicted_kl) <= self.FLOOR


class CostFigures(BaseModel):
    """What a row costs per million output tokens at its capacity (and, ``rate_``, at its
    arrival-rate capacity), each priced on the devices of the run that measured it, with the
    range from the capacity's interval (None: unbounded on that side); a censored capacity
    gives only the dearest end, an upper bound (``cost_bound``, exported as
    ``<name>_upper_bound``: :meth:`metrics`); and the machines a target load needs."""

    model_config = ConfigDict(extra="ignore")
    price_per_hour: float  # the concurrency capacity's server, per hour
    rate_price_per_hour: float | None = None  # the rate capacity's, where it has one
    usd_per_million_output_tokens: float | None = None
    usd_per_million_output_tokens_min: float | None = None
    usd_per_million_output_tokens_max: float | None = None
    cost_bound: Literal["upper"] | None = None
    rate_usd_per_million_output_tokens: float | None = None
    rate_usd_per_million_output_tokens_min: float | None = None
    rate_usd_per_million_output_tokens_max: float | None = None
    rate_cost_bound: Literal["upper"] | None = None
    machines_for_target_users: int | None = None
    planned_devices_for_target_users_kv: int | None = None
    machines_for_target_rps: int | None = None
    rps_from: str = ""

    def at(self, prefix: str = "") -> tuple[float | None, float | None, float | None, bool]:
        """(cost, cheapest, dearest, an upper bound only) of the concurrency search's figures,
        or the rate search's (``prefix="rate_"``)."""
        key = f"{prefix}usd_per_million_output_tokens"
        return (getattr(self, key), getattr(self, key + "_min"), getattr(self, key + "_max"),
                getattr(self, prefix + "cost_bound") == "upper")

    def metrics(self) -> dict[str, float]:
        """Its figures under their MLflow metric names; a bound's under ``<name>_upper_bound``
        (its dearest end), never under the plain figure's name."""
        out = {k: float(v) for k, v in self.model_dump().items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None}
        for prefix in ("", "rate_"):
            if getattr(self, prefix + "cost_bound") == "upper":
                key = f"{prefix}usd_per_million_output_tokens"
                bound = out.pop(key + "_max", None)
                out.pop(key, None)
                if bound is not None:
                    out[key + "_upper_bound"] = bound
        return out


class Row(BaseModel):
    """Everything known about one model of a comparison."""

    model_config = ConfigDict(extra="ignore", validate_assignment=True)
    name: str  # "baseline" or the recipe
    recipe: str  # "none" for the baseline
    scheme: str
    format: str
    precision: str
    group_size: int | None = None  # inputs per weight scale, as the checkpoint chose (None:
    # per channel, per block, or fixed by the format)
    symmetric: bool = True  # False: a zero point per group (AWQ)
    kv_dtype: str = "bf16"  # the KV cache the checkpoint asks for (its kv_cache_scheme)
    weight_bytes: int
    weight_ratio: float  # weight bytes / the baseline's
    quantize_seconds: float | None = None
    plan: PlanFigures | None = None  # None: not planned (the note says why)
    serving: str = "not measured"  # ok | unsupported | failed | not measured
    serving_reason: str = ""
    serving_log: str = ""
    headline: PointFigures = Field(default_factory=PointFigures)  # at the headline load point
    sweep: dict[int, PointFigures] = Field(default_factory=dict)  # load point -> its figures
    crossover: str = ""  # where the speedup crosses 1 across the sweep, as a sentence
    capacity: Capacity | None = None  # at the latency objective: users
    rate_capacity: Capacity | None = None  # and requests/s (a rate search)
    cost: CostFigures | None = None  # per million tokens, machines needed
    price: Price | None = None  # the hourly price of what its run's server used
    kv: dict[str, float] = Field(default_factory=dict)
    engine: EngineUse = Field(default_factory=EngineUse)  # what the engine chose and used
    peak_memory_bytes: int = 0
    prefix: dict[str, float] = Field(default_factory=dict)
    eval_backend: str | None = None  # served | emulated | None (not evaluated)
    suites: dict[str, SuiteFigure] = Field(default_factory=dict)
    tasks: dict[str, TaskEntry] = Field(default_factory=dict)
    divergence: dict[str, float] = Field(default_factory=dict)
    search: Prediction | None = None  # the precision search's prediction for this variant
    threshold: float | None = None
    threshold_from: str = ""  # whose threshold: the recipe's, or a campaign's (said so)
    gate_status: str = NOT_EVALUATED
    gate_reason: str = ""
    notes: list[str] = Field(default_factory=list)
    measurement: str = ""  # the bench run (its key) the speed figures come from
    comparable: bool = True  # measured in the comparison's reference run: same baseline run,
    # workload and load point as every other comparable row

    @field_validator("plan", "price", "search", "capacity", "rate_capacity", "cost",
                     mode="before")
    @classmethod
    def _none_for_empty(cls, value: Any) -> Any:
        return None if value == {} else value  # as comparisons before these were typed say

    @property
    def speedup(self) -> float | None:
        return self.headline.speedup.point if self.headline.speedup else None

    def served_concurrency(self, context: int) -> int | None:
        """Requests of ``context`` tokens the served engine's KV cache holds at once (paged)."""
        tokens = self.kv.get("kv_cache_tokens")
        block = int(self.kv.get("kv_block_size") or 0)  # 0: read from the log, size unknown
        if not tokens or context <= 0:
            return None
        per_request = -(-context // block) * block if block > 0 else context
        return int(tokens // per_request)

    @property
    def figures_from(self) -> str:
        """Where the accuracy figures come from, as the report shows it."""
        if self.eval_backend == EMULATED:
            return "emulated (hf, de-compressed weights)"
        return self.eval_backend or "-"


class Failure(BaseModel):
    """A stage that failed for a variant (``all``: the whole stage) for a reason other than a
    hardware limit; the comparison shows it and the campaign exits 1 naming it."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    variant: str
    stage: str  # quantize | bench | eval | bench/eval (one Ray task ran both)
    reason: str
    log: str = ""

    def rerun(self) -> str:
        """The command that runs the failed stage again for that variant alone."""
        def one(stage: str) -> str:
            if self.variant == "all" or (self.variant == "baseline" and stage != "eval"):
                return f"make {stage}"  # bench always serves the baseline
            return f"make {stage} RECIPE={'none' if self.variant == 'baseline' else self.variant}"
        return " and ".join(one(stage) for stage in self.stage.split("/"))


OBJECTIVES = ("speed", "memory", "capacity", "cost")
Objective = Literal["speed", "memory", "capacity", "cost"]  # what a recommendation optimises


class Comparison(Artifact):
    """``artifacts/reports/<baseline>/comparison.json``: the join and its verdict."""

    FILE: ClassVar[str] = "comparison.json"
    baseline: str
    rows: list[Row]
    workload: str
    load_point: int | None
    plan_target: PlanTarget
    cost_target: CostTarget = Field(default_factory=CostTarget)
    price: Price | None = None  # the reference run's price; each row has its own
    traffic: dict[str, dict[str, float]] = Field(default_factory=dict)  # prompt-file lengths
    recommendation: str | None
    reason: str
    sources: dict[str, str] = Field(default_factory=dict)
    # what failed for a reason other than a hardware limit: {variant, stage, reason, log}
    failures: list[Failure] = Field(default_factory=list)
    hardware: str = ""  # where the bench figures were measured (the machine's profile)
    measurement: dict[str, str] = Field(default_factory=dict)  # the reference bench run
    # where the reference is served in another dtype than the checkpoints' own (float32 on a
    # CPU without bf16 units): the baseline in its own dtype against it, point / low / high
    own_dtype_speedup: dict[str, float] = Field(default_factory=dict)
    objective: Objective = "speed"
    plan_note: str = ""  # when the plan is not for the card the figures come from
    meta: dict[str, str] = Field(default_factory=dict)  # provenance: commit, versions, hardware

    @staticmethod
    def directory(baseline: str) -> Path:
        return paths.artifacts_dir() / "reports" / baseline

    @property
    def suites(self) -> list[str]:
        """Every suite any row was scored on, sorted."""
        return sorted({s for row in self.rows for s in row.suites})

    @property
    def planned_on(self) -> str:
        """Where the plan columns place each variant: ``80 GB`` or the card's preset."""
        t = self.plan_target
        return f"{t.memory_gb:g} GB" if t.memory_gb is not None else t.gpu

    def as_dict(self) -> dict[str, Any]:
        data = json.loads(self.model_dump_json())
        for row, obj in zip(data["rows"], self.rows, strict=True):
            row["speedup"] = obj.speedup
        return data
