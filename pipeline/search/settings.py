"""``qpipe sensitivity`` and ``qpipe search`` settings (``make sensitivity`` / ``make search``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.core.heldout import SCAN_SPAN
from pipeline.core.settings import StageSettings, baseline_field, force_field

SCAN_TOKENS = SCAN_SPAN  # two 512-token windows: ~9 min for the embedded model on 2 cores


class ScanOptions(BaseModel):
    """What the sensitivity table is measured with: its menu and its text."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    formats: list[str] | None = Field(
        None, description="the menu: formats each unit may take (int4, int8, bf16); default: "
        "every one vLLM serves on this machine, and bf16", json_schema_extra={
            "make": "FORMATS", "flag": "--format"})
    target: str | None = Field(
        None, description="the machine the recipe is for, whose kernels decide the menu: an "
        "accelerator preset (h100-80gb, ...), cpu-avx2 or cpu-avx512 (default: this machine)",
        json_schema_extra={"make": "TARGET"})
    scan_tokens: int = Field(SCAN_TOKENS, gt=1, le=SCAN_SPAN, description="score each unit on "
                             "the first N tokens of the held-out text (evals/_heldout/"
                             "heldout.txt; the divergence check measures on the tokens after "
                             "the first 1,024)",
                             json_schema_extra={"make": "SCAN_TOKENS"})


class SensitivitySettings(StageSettings):
    baseline: str = baseline_field()
    scan: ScanOptions = Field(default_factory=ScanOptions, json_schema_extra={"nested": True})
    force: bool = force_field("scan again")


class SearchSettings(StageSettings):
    baseline: str = baseline_field()
    budget: str | None = Field(
        None, description="weight-memory budget: bytes (130MB, 1.2e8), a share of the "
        "baseline's weights (0.45 or 45%), or a multiple of a uniform format (1.15xint4)",
        json_schema_extra={"make": "BUDGET"})
    max_damage: float | None = Field(
        None, ge=0, description="instead of BUDGET: the smallest weights whose predicted "
        "damage (summed KL, nats/token) stays within this", json_schema_extra={
            "make": "MAX_DAMAGE"})
    speedup: float | None = Field(
        None, gt=0, description="a speed budget: the least damage whose predicted throughput "
        "is at least this multiple of the baseline's (from the uniform variants' speedups "
        "measured in the newest comparison); alone or with BUDGET= / MAX_DAMAGE=",
        json_schema_extra={"make": "SPEEDUP"})
    name: str | None = Field(None, description="the recipe to write, recipes/NAME.yaml "
                             "(default: searched-<budget>)", json_schema_extra={"make": "NAME"})
    method: Literal["rtn", "gptq"] = Field(
        "rtn", description="how the searched checkpoint is quantized: rtn, the scan's own "
        "round-to-nearest (what was predicted is what ships; data-free), or gptq, as the "
        "shipped int4/int8 recipes (the prediction then calibrated by their measured damage)",
        json_schema_extra={"make": "METHOD"})
    calibrate: bool = Field(True, description="METHOD=gptq: scale each format's scanned "
                            "damages by its uniform GPTQ variant's measured/predicted KL in the "
                            "newest comparison", json_schema_extra={
                                "negative": "--no-calibrate",
                                "negative_help": "use the damages as scanned"})
    refine: bool = Field(False, description="a second pass: re-score every unit in the first "
                         "choice's context and re-solve; the prediction is then the mix's "
                         "whole-model KL (about as long as the scan)", json_schema_extra={
                             "make": "REFINE=1"})
    threshold: float = Field(96.0, gt=0, le=1000,
                             description="the recipe's recovery threshold, percent",
                             json_schema_extra={"make": "THRESHOLD"})
    scan: ScanOptions = Field(default_factory=ScanOptions, json_schema_extra={"nested": True})
