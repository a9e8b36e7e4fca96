"""``qpipe quantize`` settings (``make quantize``): the one source of their defaults."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pipeline.core.settings import StageSettings, baseline_field, force_field


class CalibrationOverrides(BaseModel):
    """What overrides a recipe's ``calibration:`` block (every recipe's, in a campaign)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    calib_samples: int | None = Field(None, ge=1, description="override calibration.num_samples",
                                      json_schema_extra={"make": "CALIB_SAMPLES"})
    calib_seq_len: int | None = Field(None, ge=1, description="override calibration.max_seq_length",
                                      json_schema_extra={"make": "CALIB_SEQ_LEN"})
    calib_data: str | None = Field(None, description="override calibration.dataset (a file or "
                                   "hub id)", json_schema_extra={"make": "CALIB_DATA"})


class QuantizeSettings(StageSettings):
    baseline: str = baseline_field()
    recipe: str = Field(..., description="recipe name in recipes/ (int4, awq, fp8, ...) or a "
                        "recipe file", json_schema_extra={"make": "RECIPE"})
    force: bool = force_field("quantize again")
    calibration: CalibrationOverrides = Field(default_factory=CalibrationOverrides,
                                              json_schema_extra={"nested": True})
