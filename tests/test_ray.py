"""A campaign on a real Ray cluster of two nodes started here (``ray start --head`` and a second
``ray start --address``), each with one slot of a custom resource every task asks for, so the
two recipes' tasks must land on both nodes; logged to PostgreSQL, and compared with the same
campaign run by the local executor into SQLite: the same runs, params, figures and verdicts.
Nothing is left running afterwards, also after a failure and after Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pipeline.core import procs
from pipeline.core.artifacts import Comparison
from tests import services
from tests.conftest import TINY_CAMPAIGN, TINY_LOAD, run_cli

postgres_uri = services.postgres_uri
pytest.importorskip("ray")
# one Ray cluster per machine (the fixture refuses a second): every test here on one worker
pytestmark = pytest.mark.xdist_group("servers")

SLOT = '{"qpipe_slot": 1}'
RAY = str(Path(sys.executable).with_name("ray"))
# figures that are measurements of time or memory: equal only within noise
NOISY = ("seconds", "peak_rss", "duration", "_per_s", "time")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_processes() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        text = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
        if any(word in text for word in ("raylet", "gcs_server", "ray::", "default_worker.py")):
            out.append(p)
    return out


def _described(found: list[psutil.Process]) -> str:
    """Each process as pid, parent, state, age, name and command line (what matched)."""
    now = time.time()
    lines = []
    for p in found:
        try:
            age = now - p.create_time()
            lines.append(f"{p.pid} (parent {p.ppid()}, {p.status()}, {age:.0f} s old) "
                         f"{p.name()}: {procs.command_line(p)[:300]}")
        except psutil.Error:
            lines.append(f"{p.pid}: gone")
    return "\n".join(lines)


def _qpipe_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "pipeline.cli" in (line := procs.command_line(p)) or "vllm" in line]


@pytest.fixture
def ray_cluster() -> Iterator[str]:
    """Two Ray nodes on this machine, one CPU and one ``qpipe_slot`` each. One per test, not per
    module: an xdist worker that does not yet hold the next test tears module fixtures down
    anyway, so a shared cluster would be stopped and started again at unknown points."""
    deadline = time.monotonic() + 30  # a previous test's `ray stop` may still be finishing
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(1)
    if found := _ray_processes():
        pytest.fail("a Ray cluster is already running on this machine; `ray stop` it first:\n"
                    + _described(found), pytrace=False)
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--num-cpus=1", "--num-gpus=0", f"--resources={SLOT}", "--disable-usage-stats"]
    try:
        subprocess.run([RAY, "start", "--head", f"--port={port}", "--include-dashboard=false",
                        *common], check=True, capture_output=True, env=env, timeout=120)
        subprocess.run([RAY, "start", f"--address=127.0.0.1:{port}", *common], check=True,
                       capture_output=True, env=env, timeout=120)
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, env=env, timeout=120)
        deadline = time.monotonic() + 30
        while _ray_processes() and time.monotonic() < deadline:
            time.sleep(1)
        assert not (left := _ray_processes()), ("Ray processes left after `ray stop`:\n"
                                                + _described(left))


def _comparable(snapshot: dict) -> dict:
    """Runs with their params, tags and the metrics that are not timings."""
    return {name: {"params": run["params"], "tags": run["tags"], "parent": run["parent"],
                   "metrics": {k: v for k, v in run["metrics"].items()
                               if not any(n in k for n in NOISY)}}
            for name, run in snapshot.items()}


@pytest.mark.slow
def test_a_campaign_on_a_two_node_ray_cluster_matches_the_local_executor(
        tiny_model: Path, tmp_path: Path, ray_cluster: str, postgres_uri: str) -> None:
    spec = tmp_path / "tiny-campaign.yaml"
    spec.write_text(TINY_CAMPAIGN)
    args = ("campaign", "--baseline", str(tiny_model), "--campaign", str(spec))
    on_ray, locally = tmp_path / "ray", tmp_path / "local"
    sqlite = f"sqlite:///{tmp_path / 'local.db'}"

    done = run_cli(*args, "--executor", "ray", "--ray-address", ray_cluster,
                   "--ray-resources", SLOT,
                   env={"QPIPE_ARTIFACTS": str(on_ray / "artifacts"),
                        "MLFLOW_TRACKING_URI": postgres_uri})
    assert done.returncode == 0, done.stderr[-3000:]
    assert not _qpipe_children() and not _quantize_processes(on_ray)
    outcomes = [json.loads(line) for line in
                (on_ray / "artifacts/logs/executor.jsonl").read_text().splitlines()]
    assert {o["label"] for o in outcomes} == {"quantize fp8", "quantize mxfp4",
                                              "eval baseline", "measure fp8", "measure mxfp4"}
    assert all(o["ok"] for o in outcomes)
    # one slot per node, two tasks at once: the two recipes were quantized on both nodes
    quantized_on = {o["node"] for o in outcomes if o["label"].startswith("quantize")}
    assert len(quantized_on) == 2, quantized_on
    assert len({o["node"] for o in outcomes}) == 2

    local = run_cli(*args, env={"QPIPE_ARTIFACTS": str(locally / "artifacts"),
                                "MLFLOW_TRACKING_URI": sqlite})
    assert local.returncode == 0, local.stderr[-3000:]

    experiment = f"qpipe/{tiny_model.name}"
    ignore = services.VOLATILE_TAGS | {"qpipe.created", "qpipe.git_commit", "qpipe.variant_dir",
                                       "qpipe.report_dir"}
    from_ray = _comparable(services.store_snapshot(postgres_uri, experiment, ignore))
    from_local = _comparable(services.store_snapshot(sqlite, experiment, ignore))
    assert set(from_ray) == set(from_local)
    for name in from_local:
        assert from_ray[name] == from_local[name], name
    reports = [Comparison.read(root / "artifacts/reports" / tiny_model.name / "comparison.json")
               for root in (on_ray, locally)]
    assert [(r.name, r.gate_status, r.weight_bytes, r.suites) for r in reports[0].rows] == [
        (r.name, r.gate_status, r.weight_bytes, r.suites) for r in reports[1].rows]


@pytest.mark.slow
def test_a_failing_task_is_retried_once_then_named_with_its_node_and_log(
        tiny_model: Path, tmp_path: Path, ray_cluster: str) -> None:
    spec = tmp_path / "broken.yaml"
    spec.write_text(TINY_CAMPAIGN.replace("[fp8, mxfp4]", "[fp8, nosuch]"))
    done = run_cli("campaign", "--baseline", str(tiny_model), "--campaign", str(spec),
                   "--executor", "ray", "--ray-address", ray_cluster, "--no-track",
                   env={"QPIPE_ARTIFACTS": str(tmp_path / "artifacts"),
                        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"})
    assert done.returncode == 1, done.stderr[-3000:]
    assert "nosuch in quantize" in done.stderr and "quantize-nosuch.log" in done.stderr
    outcome = next(json.loads(line) for line in
                   (tmp_path / "artifacts/logs/executor.jsonl").read_text().splitlines()
                   if "nosuch" in line)
    assert outcome["attempts"] == 2 and not outcome["ok"] and "exited 2 on" in outcome["reason"]
    assert outcome["node"] != "unknown (the node was lost)"
    log = Path(outcome["log"]).read_text()
    assert log.count("unknown recipe") >= 2, log  # it ran twice: once, then its one retry
    # the other recipe went on: quantized and scored
    assert (tmp_path / "artifacts/variants" / tiny_model.name / "fp8/config.json").is_file()
    assert not _quantize_processes(tmp_path)


@pytest.mark.slow
@pytest.mark.serve
def test_on_ray_each_variant_is_benched_beside_its_own_baseline_server(
        tiny_model: Path, tmp_path: Path, ray_cluster: str) -> None:
    # one load point: the pairing on each node is what is tested, not the sweep
    (tmp_path / "tiny.yaml").write_text(TINY_LOAD.replace("load_points: [1, 2]",
                                                          "load_points: [2]"))
    spec = tmp_path / "bench.yaml"
    spec.write_text(TINY_CAMPAIGN.replace("[fp8, mxfp4]", "[fp8, int8]").replace(
        "workloads: []", f"workloads: [{tmp_path / 'tiny.yaml'}]"))
    done = run_cli("campaign", "--baseline", str(tiny_model), "--campaign", str(spec),
                   "--executor", "ray", "--ray-address", ray_cluster, "--max-model-len=512",
                   "--reference=bfloat16",
                   env={"QPIPE_ARTIFACTS": str(tmp_path / "artifacts"),
                        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"}, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    comparison = Comparison.read(tmp_path / "artifacts/reports" / tiny_model.name /
                                 "comparison.json")
    assert comparison is not None
    rows = {r.name: r for r in comparison.rows}
    for name in ("fp8", "int8"):  # each from its own run, paired with its own baseline there
        assert rows[name].serving == "ok" and (rows[name].speedup or 0) > 0, name
        assert rows[name].comparable, name
        log = (tmp_path / f"artifacts/logs/measure-{name}.log").read_text()
        assert "starting vLLM for baseline" in log and f"starting vLLM for {name}" in log
    assert rows["fp8"].measurement != rows["int8"].measurement
    assert sum("beside its own baseline server" in " ".join(rows[n].notes)
               for n in ("fp8", "int8")) == 1  # the other is in the comparison's reference run
    # no server and no stage command outlived its task
    assert not _quantize_processes(tmp_path)
    assert not [p for p in psutil.process_iter(["cmdline"])
                if "vllm" in " ".join(p.info["cmdline"] or []) and (
                    str(tmp_path) in " ".join(p.info["cmdline"] or [])
                    or str(tiny_model) in " ".join(p.info["cmdline"] or []))]


@pytest.mark.slow
def test_ctrl_c_on_a_ray_campaign_cancels_every_task(tiny_model: Path, tmp_path: Path,
                                                     ray_cluster: str) -> None:
    spec = tmp_path / "c.yaml"
    spec.write_text(TINY_CAMPAIGN.replace("[fp8, mxfp4]", "[int4, int8]"))  # GPTQ: seconds long
    env = {**os.environ, "QPIPE_ARTIFACTS": str(tmp_path / "artifacts"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "campaign", "--baseline",
                             str(tiny_model), "--campaign", str(spec), "--executor", "ray",
                             "--ray-address", ray_cluster], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    logs = tmp_path / "artifacts" / "logs"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(
            "calibration" in p.read_text(errors="replace") for p in logs.glob("quantize-*.log")):
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _quantize_processes(tmp_path):
        time.sleep(1)
    assert not _quantize_processes(tmp_path), "a task's command outlived the campaign"
    assert not list((tmp_path / "artifacts" / "variants").glob("*/.tmp-*")), "half-written"


def _quantize_processes(tmp_path: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            if "pipeline.cli" in " ".join(p.info["cmdline"] or []) and str(tmp_path) in (
                    (p.info["environ"] or {}).get("QPIPE_ARTIFACTS", "")):
                found.append(p)
        except psutil.Error:
            continue
    return found
