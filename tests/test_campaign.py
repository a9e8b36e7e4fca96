"""A whole campaign on a tiny model: stages, report, MLflow parent/child runs in SQLite and in
PostgreSQL, the MLflow server's REST API, and the HTML report in headless Chromium."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from pipeline.core.artifacts import Comparison, Manifest
from tests import faults, services
from tests.conftest import TINY_CAMPAIGN, TINY_LOAD, run_cli

postgres_uri = services.postgres_uri
chromium_path = services.chromium_path

VARIANTS = {"variant:baseline", "variant:fp8", "variant:mxfp4"}


def _outputs(workspace: Path) -> dict[Path, int]:
    """Each variant's and each scored task's files, with when they were written."""
    root = workspace / "artifacts"
    return {p: p.stat().st_mtime_ns for pattern in ("variants/*/*/*", "evals/*/cache/*/*/*")
            for p in root.glob(pattern) if p.is_file()}


def test_campaign_runs_every_stage_and_logs_the_same_runs_to_sqlite_and_postgres(
    tiny_model: Path, workspace: Path, postgres_uri: str, chromium_path: str
) -> None:
    spec = workspace / "tiny-campaign.yaml"
    spec.write_text(TINY_CAMPAIGN)
    sqlite = f"sqlite:///{workspace / 'campaign.db'}"
    args = ("campaign", "--baseline", str(tiny_model), "--campaign", str(spec))

    first = run_cli(*args, env={"MLFLOW_TRACKING_URI": sqlite})
    assert first.returncode == 0, first.stderr[-3000:]
    reports = workspace / "artifacts" / "reports" / tiny_model.name
    comparison = Comparison.read(reports / "comparison.json")
    assert comparison is not None and comparison.recommendation is None
    assert [r.name for r in comparison.rows] == ["baseline", "fp8", "mxfp4"]
    assert all(r.serving == "not measured" and r.eval_backend == "emulated"
               for r in comparison.rows[1:])
    logs = workspace / "artifacts" / "logs"
    assert {p.name for p in logs.glob("quantize-*.log")} == {"quantize-fp8.log",
                                                             "quantize-mxfp4.log"}
    report = reports / "report.html"
    assert report.is_file()
    made = _outputs(workspace)
    assert any(p.name == Manifest.FILE for p in made) and any(
        p.name == "qpipe_task_result.json" for p in made)

    # Nothing changed: every stage is reused (nothing rewritten); the same campaign lands in
    # PostgreSQL.
    again = run_cli(*args, env={"MLFLOW_TRACKING_URI": postgres_uri})
    assert again.returncode == 0, again.stderr[-3000:]
    assert _outputs(workspace) == made

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
    # the stage runs the campaign made sit under its run of their model
    assert in_sqlite["quantize:fp8"]["parent"] == "variant:fp8"
    assert in_sqlite["eval:mxfp4 (emulated)"]["parent"] == "variant:mxfp4"

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
    from pipeline.report.plots import PLOTS

    assert dom.count("<svg") == len(PLOTS)
    assert 'id="comparison"' in dom and "mxfp4" in dom and "emulated" in dom


def test_the_command_line_sets_the_objective_and_cost_of_a_campaign() -> None:
    from pipeline.campaign.runner import CampaignSettings, stages
    from pipeline.core.settings import from_options

    settings = from_options(CampaignSettings, slo_ttft_ms=300, slo_itl_ms=80, objective="cost",
                            price_per_device_hour=1.5, target_users=40)
    file = settings.file()
    assert file.cost.price_per_device_hour == 1.5 and file.cost.target_users == 40
    assert file.cost.host_price_per_device_hour == 0.10  # the file's, not overridden
    _, bench, _ = stages(settings, file)
    assert bench is not None and (bench.slo_ttft_ms, bench.slo_itl_ms) == (300, 80)
    assert "capacity" in bench.workloads  # the cost objective runs the capacity search


def test_quantize_slots_as_memory_holds_on_a_cpu_host_one_on_a_gpu(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.campaign.local import slots
    from pipeline.quantize import baseline as baselines

    base = baselines.resolve(str(tiny_model))
    monkeypatch.delenv("QPIPE_QUANTIZE_JOBS", raising=False)
    # with 16 GiB free a tiny model is limited by the 1.5 GB of runtime each, not by the cores
    # (one long GPTQ recipe left alone would leave a core idle)
    free = type("Memory", (), {"available": 16 * 2**30})()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    assert slots(base, "cpu") == 10
    free.available = 2 * 2**30
    assert slots(base, "cpu") == 1
    assert slots(base, "cuda") == 1
    assert slots(base, "cuda", 3) == 3
    monkeypatch.setenv("QPIPE_QUANTIZE_JOBS", "1")
    assert slots(base, "cpu") == 1


def test_quantize_progress_names_the_modifier_whose_pass_it_counts(tmp_path: Path) -> None:
    from pipeline.campaign import jobs
    from pipeline.campaign.local import progress

    job = jobs.Job("quantize int8", [], tmp_path / "int8.log")
    job.log.write_text("Preparing cache\n")
    assert progress(job) == ""
    smooth = ("Inferred `SequentialPipeline` for `SmoothQuantModifier`\n"
              + "".join(f"({i}/31): Calibrating: 100%\r({i}/31): Propagating: 50%\n"
                        for i in range(1, 32)))
    job.log.write_text(smooth)
    assert progress(job) == "SmoothQuant layer 31/31"
    job.log.write_text(smooth + "Inferred `SequentialPipeline` for `GPTQModifier`\n"
                       "(1/31): Calibrating: 100%\n(2/31): Calibrating:  10%\n")
    assert progress(job) == "GPTQ layer 2/31"
    job.log.write_text("[quantize] waiting for int8: another process is making it\n")
    assert progress(job) == "waiting for int8"


class _Stages:
    """Stand-ins for the stage functions a campaign calls, recording what each was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, bench_error: Exception | None = None
                 ) -> None:
        from pipeline.campaign import local, runner
        from pipeline.core.artifacts import Comparison, Failure, PlanTarget
        from pipeline.quantize.baseline import Baseline

        self.calls: dict[str, object] = {}
        monkeypatch.setattr(runner.baselines, "resolve",
                            lambda spec: Baseline("tiny", Path("/nowhere"), spec, "B"))
        monkeypatch.setattr(local, "serve_target", lambda: "cuda")  # no server pool
        monkeypatch.setattr(local.Local, "quantize", lambda self, todo, *_: [
            Failure(variant="int4", stage="quantize", reason="boom", log="q.log")])

        def bench(settings: object, pool: object) -> None:
            self.calls["bench"] = settings
            if bench_error is not None:
                raise bench_error

        def evaluate(settings: object, pool: object) -> None:
            self.calls["eval"] = settings

        def compare(base: object, recipes: list[str], target: object, name: str, track: bool,
                    failures: list[Failure], objective: str,
                    cost: object, per_variant: bool = False,
                    threshold: float | None = None,
                    seconds: float | None = None) -> tuple[object, list]:
            assert seconds is not None and seconds >= 0  # the parent run spans the campaign
            self.calls["compare"] = recipes
            self.calls["per_variant"] = per_variant
            self.calls["cost"] = cost
            self.calls["threshold"] = threshold
            return Comparison(baseline="tiny", rows=[], workload="", load_point=None,
                              plan_target=PlanTarget(), recommendation=None, reason="",
                              failures=failures), []

        monkeypatch.setattr(local.bench, "run", bench)
        monkeypatch.setattr(local.evaluation, "run", evaluate)
        monkeypatch.setattr(runner.report, "compare_and_log", compare)


def test_a_campaign_calls_each_stage_without_the_recipe_that_failed_before_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.campaign import runner as campaign

    stages = _Stages(monkeypatch)
    settings = campaign.CampaignSettings(baseline="tiny", recipes=("fp8", "int4"), track=False)
    with pytest.raises(campaign.CampaignIncomplete) as info:
        campaign.run(settings)
    # int4 failed to quantize: bench, eval and the comparison go on without it
    assert stages.calls["bench"].recipes == ("fp8",)  # type: ignore[attr-defined]
    assert stages.calls["eval"].recipes == ("fp8",)  # type: ignore[attr-defined]
    assert stages.calls["compare"] == ["fp8"]
    assert stages.calls["per_variant"] is False  # one bench run pairs every variant locally
    assert info.value.exit_code == 1 and "int4 in quantize: boom (log q.log)" in str(info.value)


def test_a_failed_stage_is_recorded_and_a_bad_setting_stops_with_its_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.campaign import runner as campaign
    from pipeline.core.errors import ConfigError, QpipeError

    stages = _Stages(monkeypatch, bench_error=QpipeError("vLLM is missing"))
    settings = campaign.CampaignSettings(baseline="tiny", recipes=("fp8", "int4"), track=False)
    with pytest.raises(campaign.CampaignIncomplete, match="all in bench: vLLM is missing"):
        campaign.run(settings)
    assert "eval" in stages.calls  # the stage after the failed one still ran
    _Stages(monkeypatch, bench_error=ConfigError("no workload 'chatt'"))
    with pytest.raises(QpipeError) as info:
        campaign.run(settings)
    assert "Re-run it alone: qpipe bench --baseline=tiny --recipe=fp8" in str(info.value)


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


@pytest.mark.slow
@pytest.mark.serve
@pytest.mark.xdist_group("servers")  # three servers at once
def test_a_variant_whose_server_is_killed_mid_bench_does_not_sink_the_campaign(
    tiny_model: Path, workspace: Path
) -> None:
    """kill -9 of int8's server while a streamed answer is being read (the fault proxy fires
    it at that protocol point, whatever the machine's speed): one sentence at the end."""
    from pipeline.core.provenance import serve_python

    (workspace / "kill.yaml").write_text(TINY_LOAD.replace("load_points: [1, 2]",
                                                           "load_points: [2]"))
    spec = workspace / "kill-campaign.yaml"
    spec.write_text(KILL_CAMPAIGN.format(workload=workspace / "kill.yaml"))
    root = workspace / "fault"
    env = faults.serving_env(root, {"models": ["int8"], "faults": [
        {"path": "/v1/completions", "body": '"stream": true', "nth": 3, "action": "kill",
         "when": "mid-body"}]}, serve_python=serve_python())
    result = run_cli("campaign", "--baseline", str(tiny_model), "--campaign", str(spec),
                     "--max-model-len=512", "--reference=bfloat16", env=env, timeout=1200)
    assert [e["served"] for e in faults.events(root)] == ["int8"], result.stderr[-3000:]
    # exit 1 and one line at the end: int8 failed in bench, the rest was measured
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "int8 in bench" in last and "killed by signal 9 (SIGKILL) during load point" in last
    assert "The other variants were measured, compared and logged" in last
    assert "make bench RECIPE=int8" in last  # what to do
    assert "Traceback" not in result.stderr
    # nothing left running: not the killed server's engine processes, nor any other server
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if str(workspace) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, leftovers

    reports = workspace / "artifacts" / "reports" / tiny_model.name
    comparison = Comparison.read(reports / "comparison.json")
    assert comparison is not None
    rows = {r.name: r for r in comparison.rows}
    assert rows["int8"].serving == "failed" and rows["fp8"].serving == "ok"
    assert (rows["fp8"].speedup or 0) > 0 and rows["int8"].speedup is None
    assert [(f.variant, f.stage) for f in comparison.failures] == [("int8", "bench")]
    assert comparison.recommendation != "int8"
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
