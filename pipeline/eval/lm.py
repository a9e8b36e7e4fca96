"""lm-eval, adapted: score one task on one model, served (``local-completions`` against a vLLM
server) or emulated (``hf`` on de-compressed weights); and the command that reproduces it.

Each variant is scored through vLLM when vLLM serves its format here; otherwise with lm-eval's
``hf`` backend on de-compressed weights, and every figure of it is marked ``emulated``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core import hardware, interrupts, paths
from pipeline.core import log as qlog
from pipeline.core.artifacts import EMULATED, SERVED
from pipeline.core.errors import QpipeError
from pipeline.core.fsutil import atomic_dir, read_json, write_json_atomic
from pipeline.core.variant import Variant
from pipeline.eval import divergence, suites
from pipeline.eval.settings import SEEDS, EvalSettings
from pipeline.quantize.checkpoint import partial_blocks
from pipeline.serve.server import VllmServer, serve_target
from pipeline.serve.settings import EngineSettings

if TYPE_CHECKING:
    from pipeline.serve import ServeError, ServerPool
log = qlog.get("eval")


RESULT_FILE = "qpipe_task_result.json"


# lm-eval's defaults (its CLI's --seed 0,1234,1234,1234): random, numpy, torch, few-shot.

CHANCE_METRICS = {"acc", "acc_norm", "acc_mutual_info"}  # 1/choices for multiple_choice


class EvalError(QpipeError):
    """lm-eval failed on a task."""


class NotDecompressible(EvalError):
    """The checkpoint cannot be scored emulated: compressed-tensors cannot de-compress it for
    transformers. A limit of the format on this model (as vLLM's refusal is), not a failure."""


def not_decompressible(model: Variant, err: BaseException) -> NotDecompressible | None:
    """The error to raise where loading ``model`` for emulated scoring failed because its
    block-wise scales do not tile its layers (None: some other failure)."""
    layers = partial_blocks(model.path) if (model.path / "config.json").is_file() else []
    if not layers:
        return None
    words = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return NotDecompressible(
        f"{model.name} ({model.path}) cannot be scored emulated either: compressed-tensors "
        f"cannot de-compress it for lm-eval's hf backend ({type(err).__name__}: {words}). Its "
        f"block-wise weight scales do not tile {len(layers)} layer(s), e.g. {layers[0]}: "
        "llmcompressor scales a layer's last, partial block as a block of its own. A block "
        "format needs every quantized layer's widths in whole blocks; on this model it is "
        "unsupported (fp8, a scale per channel, fits any width).")


def request_errors() -> tuple[type[BaseException], ...]:
    """What lm-eval's API models raise when a request to the server fails: socket errors and
    timeouts (OSError, requests' errors among them), aiohttp's client errors (a dropped
    connection, a payload cut short, an error status), a malformed answer."""
    import http.client

    from aiohttp import ClientError

    return OSError, http.client.HTTPException, ClientError


def served_failure(server: VllmServer, task: suites.Task, err: EvalError) -> ServeError | None:
    """A served task's failure as the server's: it died, or a request to it failed (the
    server is the better explanation than the task); None if it was something else."""
    phase = f"scoring task {task.name} (lm-eval's requests)"
    cause = err.__cause__
    if isinstance(cause, request_errors()):
        detail = f"{type(cause).__name__}: {str(cause).strip()[:200] or 'no message'}"
        return server.lost(phase, detail)
    return server.died(phase) if not server.alive() else None


@dataclass
class TaskResult:
    """One task scored on one model through one backend."""

    task: str
    backend: str
    metrics: dict[str, float]  # lm-eval's "acc,none" -> score (and "..._stderr,none")
    per_item: dict[str, dict[str, float]]  # metric key -> doc_id (str) -> per-item score
    chance: dict[str, float]  # metric key -> score of random answers
    settings: dict[str, Any]
    command: str  # the lm_eval command line that reproduces it
    directory: str = ""  # where results.json and samples_<task>.jsonl lie
    seconds: float = 0.0
    higher_is_better: dict[str, bool] = field(default_factory=dict)  # lm-eval's, per metric
    cached: bool = field(default=False, compare=False)

    @classmethod
    def load(cls, directory: Path) -> TaskResult | None:
        data = read_json(directory / RESULT_FILE)
        return cls(**data, cached=True) if data else None


def quiet_libraries() -> None:
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("lm-eval", "lm_eval", "datasets", "transformers", "httpx", "urllib3"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _max_model_len(model: Variant, settings: EvalSettings) -> int:
    config = read_json(model.path / "config.json")
    limit = config.get("max_position_embeddings") or settings.engine.max_model_len
    return int(min(settings.engine.max_model_len, limit))


def engine_for(model: Variant, settings: EvalSettings) -> EngineSettings:
    """The engine settings a served model is scored with: the campaign's (or eval's) own, its
    context capped at the model's, every automatic choice made for this host."""
    return settings.engine.model_copy(
        update={"max_model_len": _max_model_len(model, settings)}).resolved(serve_target())


def hf_model_args(model: Variant) -> str:
    return f"pretrained={paths.shown(model.path)},dtype={divergence.hf_dtype()}"


def served_model_args(model: Variant, base_url: str, settings: EvalSettings) -> str:
    return (f"model={model.served_name},base_url={base_url}/v1/completions,"
            f"tokenizer_backend=huggingface,tokenizer={paths.shown(model.path)},"
            f"num_concurrent={settings.num_concurrent},max_retries=3,timeout=3600,"
            f"max_length={_max_model_len(model, settings)}")


def lm_eval_command(model: Variant, task: suites.Task, backend: str, settings: EvalSettings,
                    limit: int | None, base_url: str = "http://127.0.0.1:8000") -> str:
    """The ``lm_eval`` command line that reproduces one task's score (from the project root)."""
    if backend == SERVED:
        args = ["--model", "local-completions", "--model_args",
                served_model_args(model, base_url, settings)]
    else:
        args = ["--model", "hf", "--model_args", hf_model_args(model), "--device",
                hardware.torch_device()]
    args += ["--batch_size", str(settings.batch_size)]
    if task.path != Path():
        args += ["--include_path", paths.shown(task.include_path)]
    args += ["--tasks", task.name]
    if limit is not None:
        args += ["--limit", str(limit)]
    if settings.num_fewshot is not None:
        args += ["--num_fewshot", str(settings.num_fewshot)]
    args += ["--log_samples", "--output_path", f"lm_eval_out/{model.name}"]
    return shlex.join([".venv/bin/lm_eval", *args])


def serve_command(model: Variant, settings: EvalSettings) -> str:
    """The ``vllm serve`` command for the hand-made served run (port 8000)."""
    from pipeline.serve.server import VllmServer

    server = VllmServer(Path(paths.shown(model.path)), model.served_name,
                        engine_for(model, settings), Path("/dev/null"))
    server.port = 8000
    cpu_env = [f"{k}={v}" for k, v in server.environment().items()
               if k.startswith("VLLM_CPU_KVCACHE")]
    command = server.command()
    command[0] = ".venv-serve/bin/vllm"
    return shlex.join([*cpu_env, *command])


def _task_manager(task: suites.Task) -> Any:
    from lm_eval.tasks import TaskManager

    if task.path == Path():  # an lm-eval built-in task, passed through by name
        return TaskManager()
    return TaskManager(include_path=str(task.include_path), include_defaults=False)


def per_item_scores(samples: list[dict], output_type: str
                    ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """From lm-eval's per-sample records: metric key -> {doc_id: score}, and chance levels."""
    scores: dict[str, dict[str, float]] = {}
    chance_sum: dict[str, float] = {}
    for sample in samples:
        for metric in sample.get("metrics", []):
            value = sample.get(metric)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            key = f"{metric},{sample.get('filter', 'none')}"
            scores.setdefault(key, {})[str(sample["doc_id"])] = float(value)
            n_choices = len(sample.get("arguments") or [])
            level = 1 / n_choices if (output_type == "multiple_choice" and n_choices
                                      and metric in CHANCE_METRICS) else 0.0
            chance_sum[key] = chance_sum.get(key, 0.0) + level
    chance = {k: chance_sum[k] / len(scores[k]) for k in scores}
    return scores, chance


def primary_key(task: suites.Task, result: TaskResult) -> str:
    """The metric recovery and the gate use: the task's, else the first one scored that lm-eval
    marks higher-is-better (recovery is variant / baseline: a perplexity would read inverted)."""
    if task.primary_metric in result.per_item:
        return task.primary_metric
    upward = [k for k in result.per_item if result.higher_is_better.get(k.split(",")[0], True)]
    if result.per_item and not upward:
        raise EvalError(
            f"lm-eval task {task.name}: every metric it scores per item "
            f"({', '.join(result.per_item)}) is lower-is-better (lm-eval's higher_is_better), "
            "and recovery (variant / baseline) and its gate assume higher is better, so the task "
            "would be judged inverted. Fix: choose a task with an accuracy-like metric, or copy "
            f"it into a suite under evals/ with metadata.{suites.META_METRIC} set to a "
            "higher-is-better metric.")
    return next(iter(upward), task.primary_metric)


def _json_default(obj: Any) -> Any:
    from lm_eval.utils import handle_non_serializable

    return handle_non_serializable(obj)


def run_task(lm: Any, model_args: str | None, model: Variant, task: suites.Task, backend: str,
             settings: EvalSettings, target: Path) -> TaskResult:
    """One ``simple_evaluate`` call; writes results.json, the samples and qpipe's summary."""
    from lm_eval import simple_evaluate

    task_settings = settings.for_task(task)
    started = time.monotonic()
    try:
        with suites.chdir(suites.data_root()):  # data_files are relative to the project root
            out = simple_evaluate(
                model=lm, model_args=model_args, tasks=[task.name],
                num_fewshot=settings.num_fewshot,
                batch_size=settings.batch_size,
                device=hardware.torch_device() if backend == EMULATED else None,
                limit=task_settings["limit"], log_samples=True, task_manager=_task_manager(task),
                **SEEDS)
    except KeyboardInterrupt:
        raise
    except Exception as err:
        interrupts.check()  # the interrupt surfaced as the library's own error: still one
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise EvalError(
            f"lm-eval failed on task {task.name} ({paths.shown(task.path)}) for {model.name} "
            f"({backend}): {type(err).__name__}: {first}. Check the task with `qpipe suites "
            f"validate {paths.shown(task.path)}`.") from err
    seconds = time.monotonic() - started
    samples = out.pop("samples", {}).get(task.name, [])
    output_type = out.get("configs", {}).get(task.name, {}).get("output_type", task.output_type)
    per_item, chance = per_item_scores(samples, output_type)
    metrics = {k: float(v) for k, v in out["results"][task.name].items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    task_settings["num_fewshot_used"] = out.get("n-shot", {}).get(task.name)
    result = TaskResult(
        task=task.name, backend=backend, metrics=metrics, per_item=per_item, chance=chance,
        settings=task_settings, seconds=round(seconds, 2), directory=str(target),
        higher_is_better={str(k): bool(v) for k, v in
                          out.get("higher_is_better", {}).get(task.name, {}).items()},
        command=lm_eval_command(model, task, backend, settings, task_settings["limit"]))
    with atomic_dir(target) as tmp:
        (tmp / "results.json").write_text(json.dumps(out, indent=2, default=_json_default))
        with (tmp / f"samples_{task.name}.jsonl").open("w") as f:
            for sample in samples:
                f.write(json.dumps(sample, default=_json_default) + "\n")
        data = asdict(result)
        data.pop("cached")
        write_json_atomic(tmp / RESULT_FILE, data)
    return result


def free_accelerator_memory() -> None:
    """Collect what a finished model left and return the CUDA allocator's cache."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def open_lm(model: Variant, backend: str, settings: EvalSettings, log_dir: Path,
        pool: ServerPool | None = None) -> Iterator[tuple[Any, str | None, VllmServer | None]]:
    """(model or its name, model_args, the server) for simple_evaluate; serves the model when
    SERVED (through the pool's server when it holds one started with the same settings)."""
    if backend == SERVED:
        engine = engine_for(model, settings)
        running = pool.get(model.path, model.served_name, engine, any_caching=True) \
            if pool else None
        if running is not None:
            log.info(f"{model.name}: scoring through the running vLLM server "
                     f"({running.base_url})")
            yield "local-completions", served_model_args(model, running.base_url, settings), running
            return
        server_log = log_dir / f"{model.name}-vllm.log"
        log.info(f"{model.name}: starting vLLM (log {paths.shown(server_log)})")
        with VllmServer(model.path, model.served_name, engine, server_log) as server:
            yield "local-completions", served_model_args(model, server.base_url, settings), server
    else:
        from lm_eval.models.huggingface import HFLM

        try:
            pretrained = divergence.load_model(model.path)
        except Exception as err:
            interrupts.check()
            if (unscoreable := not_decompressible(model, err)) is not None:
                raise unscoreable from err
            raise
        lm = HFLM(pretrained=pretrained, tokenizer=str(model.path),
                  batch_size=settings.batch_size, device=hardware.torch_device())
        try:
            yield lm, None, None
        finally:  # the model's GPU memory back for what runs next (a vLLM server)
            del lm
            free_accelerator_memory()
