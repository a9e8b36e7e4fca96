"""MLflow: one experiment per baseline, one run per stage and variant; metric names in one place.

The tracking store is ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<project>/mlflow.db``.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pipeline.core import paths
from pipeline.core.errors import TrackingError

EXPERIMENT_PREFIX = "qpipe/"

# Params every run carries, so that runs of one variant join across stages.
PARAM_BASELINE = "baseline"
PARAM_RECIPE = "recipe"
PARAM_SCHEME = "scheme"

# quantize
CHECKPOINT_BYTES = "checkpoint_bytes"
WEIGHT_BYTES = "weight_bytes"
COMPRESSION_RATIO = "compression_ratio"  # baseline weight bytes / variant weight bytes
QUANTIZED_LAYER_RATIO = "quantized_layer_bytes_ratio"  # quantized linears vs their bf16 bytes
QUANTIZE_SECONDS = "quantize_seconds"
PEAK_RSS_BYTES = "peak_rss_bytes"

TAG_STAGE = "qpipe.stage"
# the experiment tag MLflow 3's UI reads to choose its view (runs, not GenAI traces)
EXPERIMENT_KIND, MODEL_DEVELOPMENT = "mlflow.experimentKind", "custom_model_development"
TAG_CACHE_KEY = "qpipe.cache_key"
# A campaign puts its id in the environment (its processes and Ray tasks inherit it); the stage
# runs it causes carry it and their model's name, and are nested under the campaign's run of
# that model when the campaign logs its comparison.
CAMPAIGN_ENV = "QPIPE_CAMPAIGN_ID"
TAG_CAMPAIGN_ID, TAG_VARIANT = "qpipe.campaign_id", "qpipe.variant"
# Where a figure came from: the machine's one-line profile (param) and its key (tag).
PARAM_HARDWARE = "hardware"
TAG_HARDWARE_KEY = "qpipe.hardware_key"
TAG_SERVING_STATUS = "serving_status"  # ok | unsupported (a hardware limit) | failed


def mlflow_module() -> Any:
    """``mlflow``, pointed at the tracking store."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # ./mlruns still works if asked for
    import mlflow

    mlflow.set_tracking_uri(paths.default_tracking_uri())
    return mlflow


def _fix(uri: str) -> str:
    local = f"sqlite:///{paths.PROJECT_ROOT / 'mlflow.db'}"
    return (f"Fix: start the server (`make ui` starts a local one), correct MLFLOW_TRACKING_URI "
            f"(now {uri}), or unset it to use the local store {local}.")


def check_store(timeout: float = 5) -> None:
    """Fail in seconds, before any work, when the tracking store cannot be reached (MLflow
    itself retries an unreachable server for minutes, and only after the work is done)."""
    uri = paths.default_tracking_uri()
    scheme = urlparse(uri).scheme.split("+")[0]
    try:
        if scheme in ("http", "https"):
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout):
                pass
        elif scheme in ("postgresql", "mysql"):
            import sqlalchemy

            engine = sqlalchemy.create_engine(uri, connect_args={"connect_timeout": int(timeout)})
            try:
                with engine.connect():
                    pass
            finally:
                engine.dispose()
        elif scheme == "sqlite":
            db = Path(uri.removeprefix("sqlite:///"))
            folder = db.parent if uri.startswith("sqlite:///") else Path.cwd()
            if not folder.is_dir() or not os.access(folder, os.W_OK):
                raise OSError(f"{folder} is not a writable directory")
    except Exception as err:  # any driver's or socket's failure ends the same way for the user
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TrackingError(f"the MLflow tracking store {uri} cannot be reached ({first}); "
                            f"nothing was done. {_fix(uri)}") from None


def experiment_name(baseline_name: str) -> str:
    return f"{EXPERIMENT_PREFIX}{baseline_name}"


def use_experiment(baseline_name: str) -> str:
    """Make the baseline's experiment the active one, creating it if missing; its id. With a
    local SQLite store its artifacts go beside the database (``mlruns/`` next to
    ``mlflow.db``), not to ``./mlruns`` under whatever directory the process runs in. It is
    marked as model development: MLflow 3's UI then opens on its runs, not on GenAI traces."""
    mlflow = mlflow_module()
    name = experiment_name(baseline_name)
    uri = mlflow.get_tracking_uri()
    if uri.startswith("sqlite:///") and mlflow.get_experiment_by_name(name) is None:
        location = (Path(uri[len("sqlite:///"):]).parent / "mlruns").resolve().as_uri()
        with contextlib.suppress(Exception):  # created meanwhile by another process: use it
            mlflow.create_experiment(name, artifact_location=location)
    experiment = mlflow.set_experiment(name)
    if experiment.tags.get(EXPERIMENT_KIND) != MODEL_DEVELOPMENT:
        with contextlib.suppress(Exception):  # a view setting: never worth failing a run
            mlflow.MlflowClient().set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND,
                                                     MODEL_DEVELOPMENT)
    return str(experiment.experiment_id)


@contextlib.contextmanager
def started_run(experiment_id: str, run_name: str, tags: Mapping[str, str],
                seconds: float | None = None, parent: str | None = None) -> Iterator[Any]:
    """``mlflow.start_run`` in the experiment, begun ``seconds`` ago when given (MLflow then
    shows how long the work took); ``parent``: the run it is nested under."""
    mlflow = mlflow_module()
    if not seconds or seconds <= 0:
        with mlflow.start_run(run_name=run_name, tags=dict(tags), experiment_id=experiment_id,
                              nested=parent is not None, parent_run_id=parent) as run:
            yield run
        return
    all_tags = {**tags, "mlflow.runName": run_name,
                **({"mlflow.parentRunId": parent} if parent else {})}
    client = mlflow.MlflowClient()
    created = client.create_run(experiment_id, start_time=int((time.time() - seconds) * 1000),
                                tags=all_tags, run_name=run_name)
    try:
        active = mlflow.start_run(run_id=created.info.run_id, nested=parent is not None)
    except BaseException:
        with contextlib.suppress(Exception):  # no half-made run left in the store
            client.delete_run(created.info.run_id)
        raise
    with active as run:
        yield run


@contextlib.contextmanager
def campaign_scope() -> Iterator[str]:
    """A new campaign id in the environment while the campaign runs."""
    campaign_id, before = uuid.uuid4().hex[:16], os.environ.get(CAMPAIGN_ENV)
    os.environ[CAMPAIGN_ENV] = campaign_id
    try:
        yield campaign_id
    finally:
        if before is None:
            os.environ.pop(CAMPAIGN_ENV, None)
        else:
            os.environ[CAMPAIGN_ENV] = before


def nest_stage_runs(experiment_id: str, campaign_id: str, parent: str,
                    children: Mapping[str, str]) -> int:
    """Nest the stage runs made during campaign ``campaign_id`` under its run of their model
    (``children``: model name -> run id), else under the campaign's run; returns how many."""
    mlflow = mlflow_module()
    client = mlflow.MlflowClient()
    runs = client.search_runs([experiment_id],
                              filter_string=f"tags.`{TAG_CAMPAIGN_ID}` = '{campaign_id}'")
    nested = 0
    for run in runs:
        if run.info.run_id == parent or run.info.run_id in children.values():
            continue
        target = children.get(run.data.tags.get(TAG_VARIANT, ""), parent)
        client.set_tag(run.info.run_id, "mlflow.parentRunId", target)
        nested += 1
    return nested


def prepare(baseline_name: str) -> None:
    """Create the store and the baseline's experiment now: processes that log at once must
    not race to create the schema of a new SQLite store."""
    use_experiment(baseline_name)


def find_run(baseline_name: str, stage: str, cache_key: str) -> str | None:
    """The id of a finished run of ``stage`` with this cache key, if one is recorded."""
    mlflow = mlflow_module()
    try:
        experiment = mlflow.get_experiment_by_name(experiment_name(baseline_name))
        if experiment is None:
            return None
        runs = mlflow.search_runs(
            [experiment.experiment_id],
            filter_string=f"tags.`{TAG_STAGE}` = '{stage}' and "
            f"tags.`{TAG_CACHE_KEY}` = '{cache_key}' and attributes.status = 'FINISHED'",
            max_results=1,
            output_format="list",
        )
    except KeyboardInterrupt:
        raise
    except Exception as err:
        uri = paths.default_tracking_uri()
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TrackingError(f"the MLflow store {uri} could not be searched ({first[:300]}). "
                            f"{_fix(uri)}") from None
    return runs[0].info.run_id if runs else None


def log_run(
    baseline_name: str,
    stage: str,
    run_name: str,
    params: Mapping[str, Any],
    metrics: Mapping[str, float],
    tags: Mapping[str, str] | None = None,
    artifacts: list[Path] | None = None,
    stepped: list[tuple[str, float, int]] | None = None,
    seconds: float | None = None,
    variant: str | None = None,
) -> str:
    """Log one finished run in the baseline's experiment; returns its id.

    ``stepped`` holds (metric, value, step) for sweeps: the step is the load point.
    ``seconds``: how long the work took; the run then starts that long ago (it is logged
    when the work is done, and would otherwise last milliseconds in the UI). ``variant``: the
    model it is about, under whose campaign run it is nested when a campaign made it.
    """
    mlflow = mlflow_module()
    all_tags = {TAG_STAGE: stage, "qpipe.host": platform.node(), **(tags or {})}
    if variant is not None:
        all_tags[TAG_VARIANT] = variant
    if os.environ.get(CAMPAIGN_ENV):
        all_tags[TAG_CAMPAIGN_ID] = os.environ[CAMPAIGN_ENV]
    try:
        experiment_id = use_experiment(baseline_name)
        with started_run(experiment_id, run_name, all_tags, seconds) as run:
            mlflow.log_params(dict(params))
            mlflow.log_metrics({k: float(v) for k, v in metrics.items() if v is not None})
            for name, value, step in stepped or []:
                mlflow.log_metric(name, float(value), step=step)
            for artifact in artifacts or []:
                mlflow.log_artifact(str(artifact))
            return run.info.run_id
    except (KeyboardInterrupt, TrackingError):
        raise
    except Exception as err:  # the work is on disk; only its record failed
        uri = paths.default_tracking_uri()
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TrackingError(
            f"{run_name}: the results are on disk, but the MLflow store {uri} refused them "
            f"({first[:300]}). The next run of the same command records them (nothing is "
            f"redone). {_fix(uri)}") from None


# bench (per variant and load point; the first workload's names are plain, others prefixed)
OUTPUT_TOKENS_PER_S = "output_tokens_per_s"
REQUESTS_PER_S = "requests_per_s"
TTFT_MS_P50 = "ttft_ms_p50"
TTFT_MS_P99 = "ttft_ms_p99"
ITL_MS_P50 = "itl_ms_p50"
ITL_MS_P99 = "itl_ms_p99"
E2E_MS_P50 = "e2e_ms_p50"
SPEEDUP = "speedup"  # variant output_tokens_per_s / baseline's, same load point, same invocation
# (the geometric mean of the per-repeat ratios); its interval, n, level and the sequential
# p-value of "faster" (pipeline.core.speedup)
SPEEDUP_CI_LOW, SPEEDUP_CI_HIGH = "speedup_ci_low", "speedup_ci_high"
SPEEDUP_N, SPEEDUP_LEVEL, SPEEDUP_P_FASTER = "speedup_n", "speedup_level", "speedup_p_faster"
SPEEDUP_LOG_SD = "speedup_log_sd"  # the spread of the per-repeat log ratios
KV_CACHE_TOKENS = "kv_cache_tokens"  # as the engine reports it
MAX_CONCURRENCY = "max_concurrency"  # the engine's figure for max_model_len tokens per request
KV_CACHE_TOKENS_VS_PLANNED = "kv_cache_tokens_vs_planned"  # reported / planner's prediction
MAX_CONCURRENCY_VS_PLANNED = "max_concurrency_vs_planned"
KV_PLAN_OFF = "kv_plan_off"  # 1: a ratio above outside [0.9, 1.1], the plan flagged
PREFIX_CACHE_HIT_RATE = "prefix_cache_hit_rate"  # hit tokens / queried tokens during the run
PREFIX_CACHE_EXPECTED_HIT_RATE = "prefix_cache_expected_hit_rate"  # what the shared prefix allows
PREFIX_CACHE_TTFT_SPEEDUP = "prefix_cache_ttft_speedup"  # TTFT p50 caching off / on
SERVER_PEAK_MEMORY_BYTES = "server_peak_memory_bytes"  # RSS of the process tree (CPU); on GPUs
# nvidia-smi's figure, which is ~gpu_memory_utilization x the card whatever the model: the
# two below say what weights and KV cache take
ENGINE_WEIGHT_MEMORY_BYTES = "engine_weight_memory_bytes"  # "Model loading took X GiB" x TP x PP
KV_CACHE_MEMORY_BYTES = "kv_cache_memory_bytes"  # the KV budget the engine used, per device
# capacity at a latency objective (a workload with an slo): the highest max concurrency found
# to meet it, and the medians measured there
# the capacity at the objective: the largest whole load at or below the fitted knee, and its
# interval's ends (a censored capacity, a lower bound, is logged as <name>_lower_bound)
SLO_MAX_CONCURRENCY = "slo_max_concurrency"
SLO_CAPACITY_LOW = "slo_capacity_low"
SLO_CAPACITY_HIGH = "slo_capacity_high"
SLO_MAX_REQUEST_RATE = "slo_max_request_rate"  # a rate search: req/s at the knee
SLO_REQUEST_RATE_LOW = "slo_request_rate_low"
SLO_REQUEST_RATE_HIGH = "slo_request_rate_high"
SLO_ATTAINMENT = "slo_attainment"  # share of requests within the objective (stepped: per load)
SLO_REQUESTS_PER_S = "slo_requests_per_s"
SLO_OUTPUT_TOKENS_PER_S = "slo_output_tokens_per_s"
SLO_GOODPUT = "slo_goodput_requests_per_s"  # vLLM's goodput (requests meeting ttft/tpot/e2el)
GOODPUT = "goodput_requests_per_s"
PREEMPTIONS = "preemptions"  # the engine preempted requests: its KV cache was full

# evaluate. Scores are "<task>.<metric>": app_facts.acc, qpipe_gsm8k.exact_match/strict-match
RECOVERY_PREFIX = "recovery_pct."  # + task: variant / baseline score x 100 (the task's metric)
RECOVERY_CI_LOW_PREFIX = "recovery_pct_ci_low."  # + task: lower end of its 95% interval
RECOVERY_CI_HIGH_PREFIX = "recovery_pct_ci_high."
FLIP_RATE_PREFIX = "flip_rate."  # + task: share of items whose correctness changed either way
FLIPS_PREFIX = "flips."  # + task: their count
SUITE_RECOVERY_PREFIX = "suite_recovery_pct."  # + suite: mean of its tasks' recoveries
RECOVERY_PCT = "recovery_pct"  # mean of the per-task recoveries (tasks above chance only)
RECOVERY_PCT_CI_LOW = "recovery_pct_ci_low"
RECOVERY_PCT_CI_HIGH = "recovery_pct_ci_high"
KL_DIV_MEAN = "kl_div_mean"  # held-out text, nats per token, KL(baseline || variant)
TOP1_AGREEMENT = "top1_agreement"
PERPLEXITY = "perplexity"
TAG_EVAL_BACKEND = "eval_backend"  # served (vLLM endpoint) | emulated (hf, de-compressed)
TAG_DIVERGENCE_BACKEND = "divergence_backend"
TAG_NOT_MEANINGFUL = "not_meaningful"  # tasks whose baseline is within noise of chance
