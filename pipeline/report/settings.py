"""``qpipe compare`` settings (``make compare``): the one source of their defaults."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pipeline.core.artifacts import CostTarget, Objective, PlanTarget
from pipeline.core.settings import StageSettings, baseline_field, recipes_field


class CostOverrides(BaseModel):
    """What overrides a campaign file's ``cost:`` block."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    price_per_device_hour: float | None = Field(
        None, gt=0, description="USD per device-hour, times the devices (TP x PP GPUs, or the "
        "host) of the run that measured each capacity (default: the accelerator preset's "
        "example price, or the campaign's host_price_per_device_hour)",
        json_schema_extra={"make": "PRICE_PER_DEVICE_HOUR"})
    target_users: int | None = Field(None, gt=0, description="concurrent users to serve: "
                                     "machines needed at the latency objective",
                                     json_schema_extra={"make": "TARGET_USERS"})
    target_rps: float | None = Field(None, gt=0, description="requests per second to serve: "
                                     "machines needed at the latency objective",
                                     json_schema_extra={"make": "TARGET_RPS"})

    def apply(self, target: CostTarget) -> CostTarget:
        return target.model_copy(update={k: v for k, v in self.model_dump().items()
                                         if v is not None})


class ComparisonOverrides(BaseModel):
    """What overrides a campaign file's plan target, objective, cost and threshold: in ``make
    compare`` and ``make all`` alike."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    gpu: str | None = Field(None, description="accelerator preset the planner places each "
                            "variant on (auto: this machine's card; default: the campaign's)",
                            json_schema_extra={"make": "PLAN_GPU"})
    context: int | None = Field(None, ge=1, description="tokens per request for planned "
                                "concurrency", json_schema_extra={"make": "PLAN_CONTEXT"})
    max_context: int | None = Field(None, ge=1,
                                    description="tokens reserved per request, worst case")
    memory_gb: float | None = Field(None, gt=0, description="accelerator memory instead of --gpu")
    objective: Objective | None = Field(
        None, description="what the recommendation optimises (default: the campaign's, speed): "
        "the fastest passing variant faster than the baseline, the smallest, the one holding "
        "the most requests at the plan target, or the cheapest per million tokens at the latency "
        "objective", json_schema_extra={"make": "OBJECTIVE"})
    cost: CostOverrides = Field(default_factory=CostOverrides,
                                json_schema_extra={"nested": True})
    threshold: float | None = Field(None, gt=0, le=1000, description="the gate threshold of "
                                    "every variant (percent), instead of the campaign file's or "
                                    "each recipe's", json_schema_extra={"make": "THRESHOLD"})

    def plan(self, target: PlanTarget) -> PlanTarget:
        """``target`` (a campaign file's) with these overrides."""
        return target.model_copy(update={k: getattr(self, k) for k in
                                         ("gpu", "context", "max_context", "memory_gb")
                                         if getattr(self, k)})


class CompareSettings(StageSettings):
    baseline: str = baseline_field()
    recipes: tuple[str, ...] = recipes_field("include")
    campaign: str = Field("default", description="campaign file whose plan target and "
                          "objective are used", json_schema_extra={"make": "CAMPAIGN"})
    comparison: ComparisonOverrides = Field(default_factory=ComparisonOverrides,
                                            json_schema_extra={"nested": True})
    track: bool = Field(True, description="log the comparison to MLflow",
                        json_schema_extra={"negative": "--no-track",
                                           "negative_help": "do not log to MLflow"})
