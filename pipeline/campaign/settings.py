"""``make all`` settings: the campaign's own options, and the options of each stage it runs
that it may override, as that stage declares them (composed, not copied)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt

from pipeline.bench.settings import BenchOverrides
from pipeline.campaign import files
from pipeline.core.hardware import serve_target
from pipeline.core.settings import StageSettings, baseline_field, force_field
from pipeline.eval.settings import EvalOverrides
from pipeline.quantize.settings import CalibrationOverrides
from pipeline.report.settings import ComparisonOverrides
from pipeline.serve import EngineSettings


class CampaignSettings(StageSettings):
    """``make all``: a campaign file and what the command line overrides in it."""

    baseline: str = baseline_field()
    campaign: str = Field("default", description="a campaign in configs/campaigns/ or a YAML "
                          "file", json_schema_extra={"make": "CAMPAIGN= or QUICK=1"})
    recipes: tuple[str, ...] = Field((), description="override the campaign's recipes",
                                     json_schema_extra={"flag": "--recipe", "make": "RECIPE"})
    force: bool = force_field("redo every stage")
    quantize_jobs: PositiveInt | None = Field(
        None, description="recipes quantized at once (default: one per core on a CPU host, as "
        "memory allows; one on a GPU host)", json_schema_extra={"make": "QUANTIZE_JOBS"})
    calibration: CalibrationOverrides = Field(default_factory=CalibrationOverrides,
                                              json_schema_extra={"nested": True})
    bench: BenchOverrides = Field(default_factory=BenchOverrides,  # type: ignore[valid-type]
                                  json_schema_extra={"nested": True})
    scores: EvalOverrides = Field(default_factory=EvalOverrides,  # type: ignore[valid-type]
                                  json_schema_extra={"nested": True})
    comparison: ComparisonOverrides = Field(default_factory=ComparisonOverrides,
                                            json_schema_extra={"nested": True})
    engine: EngineSettings = Field(default_factory=EngineSettings,
                                   json_schema_extra={"nested": True})
    track: bool = Field(True, description="log to MLflow", json_schema_extra={
        "negative": "--no-track", "negative_help": "do not log the comparison to MLflow"})
    executor: Literal["local", "ray"] = Field(
        "local", description="where the stages run: this machine, or the tasks of a Ray cluster "
        "(one per recipe to quantize, one per variant to measure)", json_schema_extra={
            "make": "EXECUTOR"})
    ray_address: str | None = Field(None, description="EXECUTOR=ray: the cluster (default: "
                                    "$RAY_ADDRESS, else a local Ray instance over this node)",
                                    json_schema_extra={"make": "RAY_ADDRESS"})
    ray_resources: str | None = Field(
        None, description="EXECUTOR=ray: custom resources every task asks for, as JSON, e.g. "
        "'{\"h100\": 1}' to pin a node type", json_schema_extra={"make": "RAY_RESOURCES"})

    def file(self) -> files.CampaignFile:
        """The campaign file with this command line's overrides applied: a field the stages'
        overrides share with the file replaces the file's where it is given."""
        file = files.load(self.campaign).for_target(serve_target())
        given = {**self.bench.model_dump(), **self.scores.model_dump(), "recipes": self.recipes}
        update = {k: v for k, v in given.items() if v and k in files.CampaignFile.model_fields}
        return files.with_comparison(file.model_copy(update=update), self.comparison)

    def bench_only(self) -> dict[str, object]:
        """The bench overrides the campaign file has no field for (the latency objective)."""
        return {k: v for k, v in self.bench.model_dump().items()
                if v is not None and k not in files.CampaignFile.model_fields}
