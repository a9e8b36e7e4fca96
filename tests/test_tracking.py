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


def test_a_run_logged_after_its_work_spans_the_work_and_opens_on_runs(workspace: Path) -> None:
    """A stage records its run when the work is done: the run starts ``seconds`` earlier, so
    MLflow shows how long the work took, not milliseconds; the experiment is marked as model
    development (MLflow 3's UI then opens on its runs, not on GenAI traces)."""
    import mlflow

    run_id = tracking.log_run("tiny", "bench", "bench:int8", {"p": 1}, {"m": 2.0},
                              seconds=120.0)
    info = mlflow.get_run(run_id).info
    assert 119_000 <= info.end_time - info.start_time <= 125_000
    assert info.status == "FINISHED"
    experiment = mlflow.get_experiment_by_name(tracking.experiment_name("tiny"))
    assert experiment.tags[tracking.EXPERIMENT_KIND] == tracking.MODEL_DEVELOPMENT
    quick = mlflow.get_run(tracking.log_run("tiny", "bench", "bench:fp8", {}, {"m": 1.0})).info
    assert quick.end_time - quick.start_time < 60_000  # no seconds given: the run's own time


def test_make_ui_links_the_newest_campaign_and_its_variants(workspace: Path) -> None:
    """Where a review starts: the runs table in the model-training view, the newest campaign
    run and MLflow's comparison of its variant children (none before a campaign exists)."""
    from pipeline.report import ui
    from pipeline.report.log import CHILD_STAGE

    assert ui.newest_campaign(5000) == ""
    experiment = tracking.use_experiment("tiny")
    with tracking.started_run(experiment, "campaign:default", {tracking.TAG_STAGE: "campaign"},
                              seconds=30) as parent:
        with tracking.started_run(experiment, "variant:int8", {tracking.TAG_STAGE: CHILD_STAGE},
                                  parent=parent.info.run_id) as child:
            pass
        with tracking.started_run(experiment, "bench:gone", {}, parent=parent.info.run_id):
            pass  # a stage run nested beside the variants is not one of them
    link = ui.newest_campaign(5000)
    assert f"/#/experiments/{experiment}/runs?workflowType=machine_learning" in link
    assert f"runs/{parent.info.run_id}?workflowType=machine_learning" in link
    assert f'compare-runs?runs=["{child.info.run_id}"]' in link


def test_a_campaigns_stage_runs_are_nested_under_its_run_of_their_model(workspace: Path) -> None:
    """Runs logged while a campaign runs carry its id; when it logs its comparison they go
    under its run of their model (else under the campaign's run); runs made outside stay."""
    import os

    import mlflow

    before = tracking.log_run("tiny", "quantize", "quantize:fp8", {}, {}, variant="fp8")
    with tracking.campaign_scope() as campaign_id:
        assert os.environ[tracking.CAMPAIGN_ENV] == campaign_id
        made = {name: tracking.log_run("tiny", name.split(":")[0], name, {}, {},
                                       variant=name.split(":")[1])
                for name in ("quantize:int8", "bench:baseline", "bench:int8", "eval:gone")}
        experiment = tracking.use_experiment("tiny")
        with tracking.started_run(experiment, "campaign:default", {}) as parent:
            kids = {}
            for model in ("baseline", "int8"):
                with tracking.started_run(experiment, f"variant:{model}", {},
                                          parent=parent.info.run_id) as child:
                    kids[model] = child.info.run_id
        assert tracking.nest_stage_runs(experiment, campaign_id, parent.info.run_id, kids) == 4
    assert tracking.CAMPAIGN_ENV not in os.environ

    def parent_of(run_id: str) -> str | None:
        return mlflow.get_run(run_id).data.tags.get("mlflow.parentRunId")

    assert parent_of(made["quantize:int8"]) == parent_of(made["bench:int8"]) == kids["int8"]
    assert parent_of(made["bench:baseline"]) == kids["baseline"]
    assert parent_of(made["eval:gone"]) == parent.info.run_id  # its model is not a row
    assert parent_of(before) is None


def test_a_comparison_whose_figures_cannot_be_logged_leaves_no_half_logged_run(
        workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tag, param and metric is built before MLflow is called: a figure that fails to
    flatten (here: the second variant's) leaves no campaign run with only some children."""
    import mlflow

    from pipeline.core.artifacts import Comparison, PlanTarget, Row
    from pipeline.report import log

    mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")  # not an earlier test's

    rows = [Row(name=n, recipe=n, scheme="x", format="dense", precision="bf16",
                weight_bytes=1, weight_ratio=1.0) for n in ("baseline", "int8")]
    comparison = Comparison(baseline="half-logged", rows=rows, workload="", load_point=None,
                            plan_target=PlanTarget(), recommendation=None, reason="")
    flatten = log.child_metrics

    def failing(row: Row) -> dict[str, float]:
        if row.name == "int8":
            raise ValueError("a figure that does not flatten")
        return flatten(row)

    monkeypatch.setattr(log, "child_metrics", failing)
    with pytest.raises(ValueError):
        log.log_comparison(comparison, [], {"campaign": "default"})
    experiment = mlflow.get_experiment_by_name(tracking.experiment_name("half-logged"))
    assert experiment is None or not mlflow.search_runs([experiment.experiment_id],
                                                        output_format="list")

    monkeypatch.setattr(log, "child_metrics", flatten)
    parent = log.log_comparison(comparison, [], {"campaign": "default"})
    experiment = mlflow.get_experiment_by_name(tracking.experiment_name("half-logged"))
    runs = mlflow.search_runs([experiment.experiment_id], output_format="list")
    assert {r.info.run_name for r in runs} == {"campaign:default", "variant:baseline",
                                               "variant:int8"}
    assert all(r.data.tags.get("mlflow.parentRunId") == parent for r in runs
               if r.info.run_id != parent)
