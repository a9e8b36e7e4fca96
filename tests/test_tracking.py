"""The tracking store: checked in seconds before any work; a record that failed is made later."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline.core import tracking
from pipeline.core.errors import TrackingError
from pipeline.quantize import baseline as baselines
from pipeline.quantize import recipes
from pipeline.quantize import stage as quantize
from tests.conftest import run_cli


def test_an_unreachable_store_stops_the_command_before_the_work(
    tiny_model: Path, workspace: Path
) -> None:
    started = time.monotonic()
    result = run_cli("quantize", "--baseline", str(tiny_model), "--recipe", "fp8",
                     env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}, timeout=120)
    assert time.monotonic() - started < 60  # not MLflow's minutes of retries
    assert result.returncode == 2
    assert "http://127.0.0.1:9 cannot be reached" in result.stderr
    assert "nothing was done" in result.stderr and "MLFLOW_TRACKING_URI" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (workspace / "artifacts" / "variants" / tiny_model.name / "fp8").exists()


def test_check_store_accepts_a_local_sqlite_store(workspace: Path) -> None:
    tracking.check_store()  # the workspace's sqlite file need not exist yet


def test_a_variant_whose_record_failed_is_recorded_by_the_next_run(
    tiny_model: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    import mlflow

    base = baselines.resolve(str(tiny_model))
    recipe = recipes.load("fp8")

    def store_down(*args: object, **kwargs: object) -> None:
        raise mlflow.exceptions.MlflowException("API request failed: connection refused")

    with monkeypatch.context() as patch, pytest.raises(TrackingError) as err:
        patch.setattr(mlflow, "start_run", store_down)
        quantize.quantize(base, recipe)
    assert "the results are on disk" in str(err.value)
    assert "next run of the same command records them" in str(err.value)
    assert (workspace / "artifacts" / "variants" / base.name / "fp8").is_dir()

    manifest = quantize.quantize(base, recipe)  # up to date: no work, but now recorded
    assert "is up to date" in capsys.readouterr().out
    assert tracking.find_run(base.name, quantize.STAGE, manifest.cache_key)
