"""``qpipe compare`` settings (``make compare``): the one source of their defaults."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.core.settings import StageSettings, baseline_field, recipes_field


class CompareSettings(StageSettings):
    baseline: str = baseline_field()
    recipes: tuple[str, ...] = recipes_field("include")
    campaign: str = Field("default", description="campaign file whose plan target and "
                          "objective are used", json_schema_extra={"make": "CAMPAIGN"})
    gpu: str | None = Field(None, description="accelerator preset the planner places each "
                            "variant on (auto: this machine's card)",
                            json_schema_extra={"make": "PLAN_GPU"})
    context: int | None = Field(None, description="tokens per request for planned concurrency",
                                json_schema_extra={"make": "PLAN_CONTEXT"})
    max_context: int | None = Field(None, description="tokens reserved per request, worst case")
    memory_gb: float | None = Field(None, description="accelerator memory instead of --gpu")
    objective: Literal["speed", "memory", "capacity"] | None = Field(
        None, description="what the recommendation optimises (default: the campaign's, speed): "
        "the fastest passing variant faster than the baseline, the smallest, or the one holding "
        "the most requests at the plan target", json_schema_extra={"make": "OBJECTIVE"})
    track: bool = Field(True, description="log the comparison to MLflow",
                        json_schema_extra={"negative": "--no-track",
                                           "negative_help": "do not log to MLflow"})
