"""``qpipe eval`` / ``gate`` / ``suites`` settings: the one source of their defaults."""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, PositiveInt

from pipeline.core.settings import (
    StageSettings,
    baseline_field,
    force_field,
    overrides,
    recipes_field,
)
from pipeline.serve.settings import EngineSettings

if TYPE_CHECKING:
    from pipeline.eval.suites import Task

# lm-eval's defaults (its CLI's --seed 0,1234,1234,1234): random, numpy, torch, few-shot.
SEEDS = {"random_seed": 0, "numpy_random_seed": 1234, "torch_random_seed": 1234,
         "fewshot_random_seed": 1234}
LEVELS = ("suite", "task")


class EvalSettings(StageSettings):
    """What is scored, and what determines a score besides the model and the task (recorded
    with every result)."""

    baseline: str = baseline_field()
    recipes: tuple[str, ...] = recipes_field("score (`none`: the baseline only)")
    suites: tuple[str, ...] = Field(
        ("app",), description="a suite folder under evals/ (default: app, as make all scores; "
        "the standard suite is at chance for the embedded 135M model: SUITE=\"app standard\")",
        json_schema_extra={"flag": "--suite", "make": "SUITE"})
    tasks: tuple[str, ...] = Field((), description="a task by name; names not in evals/ go to "
                                   "lm-eval's built-in tasks (they need their dataset hub)",
                                   json_schema_extra={"flag": "--task"})
    limit: PositiveInt | Literal["all"] | None = Field(
        None, description="items per task, or `all` (default: each task's qpipe_limit, else "
        "all)", json_schema_extra={"make": "LIMIT"})
    num_fewshot: int | None = Field(None, ge=0,
                                    description="few-shot examples (default: the task's)")
    backend: Literal["auto", "served", "hf"] = Field(
        "auto", description="auto: served where vLLM serves the format, else hf (emulated)",
        json_schema_extra={"make": "BACKEND"})
    batch_size: int = Field(16, ge=1, description="hf: sequences per forward pass; served: prompts "
                            "per request")
    num_concurrent: int = Field(8, ge=1, description="requests in flight to the vLLM server "
                                "(8: larger batches; FP8 on vLLM CPU scores ~25% faster than "
                                "with 2)")
    divergence: bool = Field(True, description="KL divergence, top-1 agreement and perplexity "
                             "on held-out text", json_schema_extra={
                                 "negative": "--no-divergence",
                                 "negative_help": "skip KL / top-1 / perplexity"})
    force: bool = force_field("score again")
    engine: EngineSettings = Field(default_factory=EngineSettings,
                                   json_schema_extra={"nested": True})

    def for_task(self, task: Task) -> dict[str, Any]:
        """What, besides the model and the task, determines its score."""
        limit = None if self.limit == "all" else (
            self.limit if self.limit is not None else task.default_limit)
        return {"limit": limit, "num_fewshot": self.num_fewshot, "seeds": SEEDS,
                "lm_eval": metadata.version("lm_eval")}


# what a campaign may set for its eval stage, each unset by default
EvalOverrides = overrides(EvalSettings, ("suites", "limit"), "the campaign file's")


class GateSettings(StageSettings):
    baseline: str = baseline_field()
    recipes: tuple[str, ...] = Field((), description="variant to judge (default: every "
                                     "evaluated variant)", json_schema_extra={
                                         "flag": "--recipe", "make": "RECIPE"})
    threshold: float | None = Field(None, gt=0, le=1000, description="override every recipe's "
                                    "recovery_threshold_pct (percent)",
                                    json_schema_extra={"make": "THRESHOLD"})
    level: Literal["suite", "task"] = Field("suite", description="judge each suite's interval "
                                            "or each task's", json_schema_extra={
                                                "make": "GATE_LEVEL"})
