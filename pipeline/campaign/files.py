"""Campaign files (``configs/campaigns/*.yaml``): what ``make all`` runs, and where the planner
places the variants. A plain settings file, checked field by field (file and field named)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from pipeline.core import paths
from pipeline.core.artifacts import CostTarget, Objective, PlanTarget
from pipeline.core.errors import ConfigError
from pipeline.core.settings import from_yaml
from pipeline.report.settings import ComparisonOverrides

CAMPAIGNS_DIR = paths.CONFIGS_DIR / "campaigns"


class CampaignFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field("", json_schema_extra={"internal": True})  # set from the file's name
    path: Path = Field(Path(), json_schema_extra={"internal": True})
    description: str = ""
    recipes: tuple[str, ...] = ()  # empty: every recipe in recipes/
    workloads: tuple[str, ...] = ("chat", "prefix")  # empty: no bench
    repeats: PositiveInt | None = None  # None: each workload's own
    suites: tuple[str, ...] = ()  # empty: every suite in evals/
    limit: PositiveInt | Literal["all"] | None = None  # None: each task's qpipe_limit
    backend: Literal["auto", "served", "hf"] = "auto"
    divergence: bool = True
    objective: Objective = "speed"
    # the capacity search (a workload with an slo) run when the objective ranks by its cost,
    # whatever `workloads` says; name it in `workloads` to run it for every objective
    capacity_workload: str = "capacity"
    # on a GPU host: these instead (CPU-sized sweeps would leave an H100 idle); empty: the same
    gpu_workloads: tuple[str, ...] = ()
    gpu_capacity_workload: str | None = None

    def for_target(self, target: str) -> CampaignFile:
        """This campaign as it runs on a ``target`` (cpu | cuda) host."""
        if target != "cuda" or not (self.gpu_workloads or self.gpu_capacity_workload):
            return self
        return self.model_copy(update={
            "workloads": self.gpu_workloads or self.workloads,
            "capacity_workload": self.gpu_capacity_workload or self.capacity_workload})
    # the gate threshold of every variant in this campaign, instead of each recipe's own
    # recovery_threshold_pct (said wherever a verdict is shown); None: the recipes'
    threshold: float | None = Field(None, gt=0, le=1000)
    plan: PlanTarget = Field(default_factory=PlanTarget)
    cost: CostTarget = Field(default_factory=CostTarget)


def load(name_or_path: str) -> CampaignFile:
    """A campaign by name (``configs/campaigns/<name>.yaml``) or path."""
    path = paths.find_yaml(name_or_path, CAMPAIGNS_DIR)
    if path is None:
        raise ConfigError(f"no campaign {name_or_path!r}: the campaigns are "
                          f"{', '.join(paths.yaml_names(CAMPAIGNS_DIR))} (configs/campaigns/), "
                          "or give a path to a YAML file.")
    return from_yaml(CampaignFile, path, {"name": path.stem, "path": path})


def with_comparison(file: CampaignFile, given: ComparisonOverrides) -> CampaignFile:
    """``file`` with the command line's plan target, objective, cost and threshold."""
    return file.model_copy(update={
        "plan": given.plan(file.plan), "cost": given.cost.apply(file.cost),
        **{k: v for k, v in (("objective", given.objective), ("threshold", given.threshold))
           if v}})


def bench_workloads(file: CampaignFile, is_search: Callable[[str], bool]) -> tuple[str, ...]:
    """The workloads a campaign benches: its own, and its capacity search where the objective
    is cost and none of them is a search (``is_search``: whether a workload has an slo)."""
    if file.objective != "cost" or not file.workloads or any(map(is_search, file.workloads)):
        return file.workloads
    return (*file.workloads, file.capacity_workload)
