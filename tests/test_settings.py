"""Every number a user can set is checked before any work starts: a bound on each numeric
field of every command's settings (and of the files they read), and a refusal that names the
option, the Makefile variable and the range."""

from __future__ import annotations

import subprocess
import types
import typing
from pathlib import Path
from typing import Any, get_args, get_origin

import annotated_types
import pytest
from pydantic import BaseModel

from pipeline.campaign.files import CampaignFile
from pipeline.campaign.files import load as load_campaign
from pipeline.core.artifacts import CostTarget, PlanTarget
from pipeline.core.errors import ConfigError
from pipeline.registry import STAGES
from tests.conftest import run_cli


def _numeric(annotation: Any) -> bool:
    if annotation in (int, float):
        return True
    if get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_numeric(a) for a in get_args(annotation))
    if get_origin(annotation) is typing.Annotated:
        return _numeric(get_args(annotation)[0])
    return False


def _bounded(field: Any) -> bool:
    """A lower bound on the field or on every numeric member of its union (PositiveInt)."""
    if any(isinstance(m, (annotated_types.Ge, annotated_types.Gt)) for m in field.metadata):
        return True
    members = [a for a in get_args(field.annotation) if a is not type(None)] or [
        field.annotation]
    numeric = [a for a in members if _numeric(a)]
    return bool(numeric) and all(
        get_origin(a) is typing.Annotated and any(
            isinstance(m, (annotated_types.Ge, annotated_types.Gt)) for m in get_args(a)[1:])
        for a in numeric)


def _models() -> set[type[BaseModel]]:
    seen: set[type[BaseModel]] = set()
    todo = [stage.settings_type() for stage in STAGES] + [CampaignFile, PlanTarget,
                                                               CostTarget]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for field in model.model_fields.values():
            for arg in (field.annotation, *get_args(field.annotation)):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    todo.append(arg)
    return seen


def test_every_numeric_setting_has_a_bound() -> None:
    unbounded = [f"{model.__name__}.{name}" for model in _models()
                 for name, field in model.model_fields.items()
                 if _numeric(field.annotation) and not _bounded(field)]
    assert not unbounded, f"numeric settings with no range (0 or -1 would be taken): {unbounded}"
    assert len(_models()) > 15  # the walk reached every command's settings and their parts


@pytest.mark.parametrize(("argv", "said"), [
    (["bench", "--repeats", "0"], "--repeats (make REPEATS=): input should be greater than or "
                                  "equal to 1 (got 0)"),
    (["bench", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization (make GPU_UTIL=): "
                                                   "input should be less than or equal to 1"),
    (["eval", "--limit", "0"], "--limit (make LIMIT=)"),
    (["gate", "--threshold", "-5"], "--threshold (make THRESHOLD=): input should be greater "
                                    "than 0"),
    (["quantize", "--recipe", "int8", "--calib-samples", "0"], "--calib-samples (make "
                                                               "CALIB_SAMPLES=)"),
    (["campaign", "--max-model-len", "0"], "--max-model-len (make MAX_MODEL_LEN=)"),
])
def test_a_bad_number_is_refused_before_any_work_naming_the_variable(
        argv: list[str], said: str) -> None:
    result = run_cli(*argv, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert said in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "starting vLLM" not in result.stderr



def test_the_old_price_name_is_refused_naming_the_new_in_make_cli_and_file(
        tmp_path: Path) -> None:
    """One unit, said in its name: a price per hour per server is never read as the price
    per device-hour, nor silently dropped."""
    root = Path(__file__).parents[1]
    made = subprocess.run(["make", "--no-print-directory", "-n", "compare", "PRICE_PER_HOUR=3"],
                          cwd=root, capture_output=True, text=True, timeout=60)
    assert made.returncode != 0 and "PRICE_PER_HOUR= is now PRICE_PER_DEVICE_HOUR=" in \
        made.stderr, made.stderr
    said = run_cli("compare", "--price-per-hour", "3", timeout=60)
    assert said.returncode == 2 and "--price-per-hour is now --price-per-device-hour" in \
        said.stderr and "Traceback" not in said.stderr, said.stderr[-2000:]
    campaign = tmp_path / "old.yaml"
    campaign.write_text((root / "configs/campaigns/default.yaml").read_text().replace(
        "price_per_device_hour", "price_per_hour"))
    with pytest.raises(ConfigError, match=r"old\.yaml.*price_per_hour is now "
                                          r"price_per_device_hour"):
        load_campaign(str(campaign))
