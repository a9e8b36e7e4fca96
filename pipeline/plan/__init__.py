"""Plan: weight and KV-cache memory and concurrency from a model's config, per accelerator."""

from pipeline.plan.capacity import CapacityPlan, PlanSettings, plan_capacity
from pipeline.plan.settings import PlanRequest

__all__ = ["CapacityPlan", "PlanRequest", "PlanSettings", "plan_capacity"]
