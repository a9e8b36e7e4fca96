"""A whole campaign on a tiny model: stages, report, MLflow parent/child runs in SQLite and in
PostgreSQL, the MLflow server's REST API, and the HTML report in headless Chromium."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import services
from tests.conftest import run_cli

postgres_uri = services.postgres_uri
chromium_path = services.chromium_path

# No bench stage (its serving path is tested in test_bench; here it would add minutes): the
# comparison shows those variants as "not benched", which is also what a user sees before
# `make bench`.
CAMPAIGN = """\
description: tiny end-to-end campaign
recipes: [fp8, mxfp4]
workloads: []
suites: [app]
limit: 8
backend: hf
divergence: false
plan: {gpu: h100-80gb, context: 512, max_context: 1024}
"""
VARIANTS = {"variant:baseline", "variant:fp8", "variant:mxfp4"}


def test_campaign_runs_every_stage_and_logs_the_same_runs_to_sqlite_and_postgres(
    tiny_model: Path, workspace: Path, postgres_uri: str, chromium_path: str
) -> None:
    spec = workspace / "tiny-campaign.yaml"
    spec.write_text(CAMPAIGN)
    sqlite = f"sqlite:///{workspace / 'campaign.db'}"
    args = ("campaign", "--baseline", str(tiny_model), "--campaign", str(spec))

    first = run_cli(*args, env={"MLFLOW_TRACKING_URI": sqlite})
    assert first.returncode == 0, first.stderr[-3000:]
    for step in ("[all 1-2/4] quantize fp8, quantize mxfp4: ", "[all] quantize fp8: done in",
                 "[all] quantize mxfp4: done in", "[all 3/4] eval", "[all 4/4] compare",
                 "recommendation: none."):
        assert step in first.stdout, step
    logs = workspace / "artifacts" / "logs"
    assert "[quantize] wrote" in (logs / "quantize-fp8.log").read_text()
    report = workspace / "artifacts" / "reports" / tiny_model.name / "report.html"
    assert report.is_file()

    # Nothing changed: every stage is reused; the same campaign lands in PostgreSQL.
    again = run_cli(*args, env={"MLFLOW_TRACKING_URI": postgres_uri})
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("is up to date") == 2
    assert "[all 1/4] quantize fp8" in again.stdout
    assert "all 3 task(s) up to date" in again.stdout

    experiment = f"qpipe/{tiny_model.name}"
    ignore = services.VOLATILE_TAGS | {"qpipe.created", "qpipe.git_commit"}
    in_sqlite = services.store_snapshot(sqlite, experiment, ignore)
    in_postgres = services.store_snapshot(postgres_uri, experiment, ignore)
    assert in_sqlite == in_postgres
    assert {name for name, run in in_sqlite.items() if run["parent"] == "campaign:tiny-campaign"
            } == VARIANTS
    fp8 = in_sqlite["variant:fp8"]
    assert fp8["params"]["recipe"] == "fp8" and fp8["params"]["baseline"] == tiny_model.name
    assert 0.3 < fp8["metrics"]["weight_ratio"] < 1
    # the planner's figures at the plan target, under the planner's own names
    assert fp8["metrics"]["planned_weight_bytes"] < in_sqlite["variant:baseline"]["metrics"][
        "planned_weight_bytes"]
    assert fp8["metrics"]["planned_max_concurrency_paged"] >= fp8["metrics"][
        "planned_max_concurrency_worst_case"] > 0
    assert fp8["tags"]["eval_backend"] == "emulated"
    assert {"quantize:fp8", "quantize:mxfp4"} <= set(in_sqlite)

    # The MLflow server shows the campaign through its REST API, and stops cleanly.
    with services.mlflow_server(sqlite, workspace / "mlartifacts") as url:
        runs = [services.rest_run_summary(r) for r in services.rest_search_runs(url, experiment)]
    parent = next(r for r in runs if r["run_name"] == "campaign:tiny-campaign")
    children = {r["run_name"]: r for r in runs if r["parent_run_id"] == parent["run_id"]}
    assert set(children) == VARIANTS
    assert children["variant:mxfp4"]["metrics"]["weight_bytes"] < children[
        "variant:baseline"]["metrics"]["weight_bytes"]

    # The report renders in a browser, with its table and every plot.
    dom = services.render_dom(report, chromium_path)
    assert dom.count("<svg") == 4
    assert 'id="comparison"' in dom and "mxfp4" in dom and "emulated" in dom


def test_quantize_slots_one_per_core_on_a_cpu_host_one_on_a_gpu(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from pipeline import baseline as baselines
    from pipeline import campaign

    base = baselines.resolve(str(tiny_model))
    monkeypatch.delenv("QPIPE_QUANTIZE_JOBS", raising=False)
    cpu = campaign.quantize_slots(base, "cpu")
    assert cpu == (os.cpu_count() or 1)  # a tiny model never limits by memory
    assert campaign.quantize_slots(base, "cuda") == 1
    assert campaign.quantize_slots(base, "cuda", 3) == 3
    monkeypatch.setenv("QPIPE_QUANTIZE_JOBS", "1")
    assert campaign.quantize_slots(base, "cpu") == 1


def test_quantize_progress_names_the_modifier_whose_pass_it_counts(tmp_path: Path) -> None:
    from pipeline import campaign, jobs

    job = jobs.Job("quantize int8", [], tmp_path / "int8.log")
    job.log.write_text("Preparing cache\n")
    assert campaign._quantize_progress(job) == ""
    smooth = ("Inferred `SequentialPipeline` for `SmoothQuantModifier`\n"
              + "".join(f"({i}/31): Calibrating: 100%\r({i}/31): Propagating: 50%\n"
                        for i in range(1, 32)))
    job.log.write_text(smooth)
    assert campaign._quantize_progress(job) == "SmoothQuant layer 31/31"
    job.log.write_text(smooth + "Inferred `SequentialPipeline` for `GPTQModifier`\n"
                       "(1/31): Calibrating: 100%\n(2/31): Calibrating:  10%\n")
    assert campaign._quantize_progress(job) == "GPTQ layer 2/31"
