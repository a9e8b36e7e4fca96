"""A whole campaign on a tiny model: stages, report, MLflow parent/child runs in SQLite and in
PostgreSQL, the MLflow server's REST API, and the HTML report in headless Chromium."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import psutil
import pytest

from tests import services
from tests.conftest import TINY_LOAD, run_cli

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

    from pipeline import campaign
    from pipeline.quantize import baseline as baselines

    base = baselines.resolve(str(tiny_model))
    monkeypatch.delenv("QPIPE_QUANTIZE_JOBS", raising=False)
    cpu = campaign.quantize_slots(base, "cpu")
    assert cpu == (os.cpu_count() or 1)  # a tiny model never limits by memory
    assert campaign.quantize_slots(base, "cuda") == 1
    assert campaign.quantize_slots(base, "cuda", 3) == 3
    monkeypatch.setenv("QPIPE_QUANTIZE_JOBS", "1")
    assert campaign.quantize_slots(base, "cpu") == 1


def test_quantize_progress_names_the_modifier_whose_pass_it_counts(tmp_path: Path) -> None:
    from pipeline import campaign
    from pipeline.core import jobs

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


KILL_CAMPAIGN = """\
description: a campaign whose int8 server is killed mid-bench
recipes: [fp8, int8]
workloads: [{workload}]
suites: [app]
limit: 4
backend: hf
divergence: false
plan: {{gpu: h100-80gb, context: 512, max_context: 1024}}
"""


def _kill_when_measured(workspace: Path, name: str, stop: threading.Event,
                        killed: dict[str, int]) -> None:
    """kill -9 the vLLM server of ``name`` once its first load point is on disk."""
    while not stop.is_set():
        if list((workspace / "artifacts" / "bench").glob(f"*/.tmp-*/runs/{name}-*.json")):
            for proc in psutil.process_iter(["cmdline"]):
                cmd = proc.info["cmdline"] or []
                if "serve" in cmd and name in cmd and "--served-model-name" in cmd:
                    killed["pgid"] = os.getpgid(proc.pid)
                    proc.kill()
                    return
        stop.wait(0.2)


@pytest.mark.slow
@pytest.mark.serve
def test_a_variant_whose_server_is_killed_mid_bench_does_not_sink_the_campaign(
    tiny_model: Path, workspace: Path
) -> None:
    (workspace / "kill.yaml").write_text(TINY_LOAD)
    spec = workspace / "kill-campaign.yaml"
    spec.write_text(KILL_CAMPAIGN.format(workload=workspace / "kill.yaml"))
    stop, killed = threading.Event(), {}
    watcher = threading.Thread(target=_kill_when_measured,
                               args=(workspace, "int8", stop, killed), daemon=True)
    watcher.start()
    try:
        result = run_cli("campaign", "--baseline", str(tiny_model), "--campaign", str(spec),
                         "--engine-arg=--max-model-len=512", timeout=1200)
    finally:
        stop.set()
        watcher.join(5)
    assert "pgid" in killed, result.stdout[-3000:]
    # exit 1 and one line at the end: int8 failed in bench, the rest was measured
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "int8 in bench" in last and "killed by signal 9" in last, last
    assert "The other variants were measured, compared and logged" in last
    # nothing left running: not the killed server's engine processes, nor any other server
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if str(workspace) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers and not services.process_group(killed["pgid"])

    reports = workspace / "artifacts" / "reports" / tiny_model.name
    comparison = json.loads((reports / "comparison.json").read_text())
    rows = {r["name"]: r for r in comparison["rows"]}
    assert rows["int8"]["serving"] == "failed" and rows["fp8"]["serving"] == "ok"
    assert rows["fp8"]["speedup"] > 0 and rows["int8"]["speedup"] is None
    assert [(f["variant"], f["stage"]) for f in comparison["failures"]] == [("int8", "bench")]
    assert comparison["recommendation"] != "int8"
    assert "FAILED: int8 in bench" in (reports / "report.html").read_text()

    import mlflow

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    experiment = mlflow.get_experiment_by_name(f"qpipe/{tiny_model.name}")
    runs = {r.info.run_name: r.data for r in mlflow.search_runs(
        [experiment.experiment_id], output_format="list")}
    assert runs["bench:fp8"].metrics["output_tokens_per_s"] > 0
    assert runs["bench:int8"].tags["serving_status"] == "failed"
    assert "killed by signal 9" in runs["bench:int8"].params["serving_reason"]
    assert runs["variant:int8"].tags["serving_status"] == "failed"
    assert runs["variant:fp8"].metrics["speedup"] > 0
    assert runs["campaign:kill-campaign"].tags["failures"] == "int8 (bench)"
