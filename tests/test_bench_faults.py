"""Faults at named phases of a real vLLM CPU server (a tiny Llama), injected by the fault proxy
(tests/faults.py) at protocol points, so where a fault lands never depends on the machine's
speed: kill -9 at start-up, mid-stream and between load points, a /metrics answer cut
mid-body, and a kill during an lm-eval request. Each ends the model's stage with one sentence
naming the model, the phase, the signal or what the connection did, and the log; the other
models go on; nothing is left running. The campaign-level case is in test_campaign."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest

from pipeline.bench import stage as bench
from pipeline.bench import workloads
from pipeline.core.artifacts import EvalFailure
from pipeline.core.provenance import serve_python
from pipeline.eval import EvalSettings
from pipeline.eval import stage as evaluate
from pipeline.quantize import baseline as baselines
from pipeline.quantize import recipes
from pipeline.quantize import stage as quantize
from pipeline.serve import EngineSettings
from tests import faults
from tests.conftest import TINY_LOAD

pytestmark = [pytest.mark.slow, pytest.mark.serve]

ENGINE = EngineSettings(max_model_len=512, kv_cache_space_gib=1)
# one load point, two repeats: qpipe scrapes /metrics for the KV read-out, then before and
# after each run (vLLM's benchmark client scrapes it too: faults match qpipe's own)
ONE_POINT = TINY_LOAD.replace("load_points: [1, 2]", "load_points: [2]")
STREAMED = '"stream": true'  # vLLM's benchmark client streams every request


@pytest.fixture
def faulty(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``faulty(plan)``: every vLLM server from now on is served behind the fault proxy."""
    if not serve_python().exists():
        pytest.fail(f"the serving environment is missing ({serve_python()}): run make setup")
    real = serve_python()

    def apply(plan: dict[str, Any]) -> Path:
        root = workspace / "fault"
        for key, value in faults.serving_env(root, {"trace": True, **plan},
                                             serve_python=real).items():
            monkeypatch.setenv(key, value)
        return root
    return apply


def _left_running(workspace: Path) -> list[str]:
    """Processes that still mention this test's workspace (a server, its engine, the proxy)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(workspace) in cmd and "pytest" not in cmd:
            out.append(cmd[:200])
    return out


def _bench_baseline_only(tiny_model: Path, workspace: Path) -> Any:
    (workspace / "tiny.yaml").write_text(ONE_POINT)
    loads = [workloads.load(str(workspace / "tiny.yaml"))]
    base = baselines.resolve(str(tiny_model))
    return bench.bench(base, [], loads, ENGINE, target="cpu",
                       reference_dtype="bfloat16").models["baseline"]


@pytest.mark.parametrize(("plan", "phase", "how"), [
    # kill -9 while the engine loads its weights: before /health ever answered
    ({"kill_on_log": r"Starting to load model|Loading weights took|Model loading took"},
     "during start-up", "killed by signal 9 (SIGKILL)"),
    # kill -9 between two load points: when the scrape before the second one arrives
    ({"faults": [{"path": "/metrics", "agent": "qpipe", "nth": 4, "action": "kill"}]},
     "during the /metrics scrape before load point tiny at concurrency 2, repeat 2",
     "killed by signal 9 (SIGKILL)"),
    # kill -9 mid-stream: after part of a streamed completion was sent
    ({"faults": [{"path": "/v1/completions", "body": STREAMED, "nth": 2, "action": "kill",
                  "when": "mid-body"}]},
     "during load point tiny at concurrency 2, repeat 1 (vllm bench serve)",
     "killed by signal 9 (SIGKILL)"),
    # the fault an AVX2-only machine met: a /metrics answer cut mid-body, the server alive
    ({"faults": [{"path": "/metrics", "agent": "qpipe", "nth": 2, "action": "drop"}]},
     "the /metrics scrape before load point tiny at concurrency 2, repeat 1",
     "the connection closed mid-answer"),
], ids=["killed-at-start", "killed-between-runs", "killed-mid-stream", "metrics-cut-mid-body"])
def test_a_fault_at_any_bench_phase_fails_the_model_in_one_sentence(
        tiny_model: Path, workspace: Path, faulty: Any, plan: dict, phase: str,
        how: str) -> None:
    root = faulty(plan)
    record = _bench_baseline_only(tiny_model, workspace)
    assert faults.events(root), "the fault was never applied"
    assert record.status == "failed", record
    assert phase in record.reason and how in record.reason, record.reason
    assert record.log and Path(record.log).is_file()
    if "killed" in how:
        assert "dmesg" in record.reason  # what to do about a SIGKILL
    assert not _left_running(workspace)


@pytest.mark.parametrize(("fault", "said"), [
    ({"nth": 2, "action": "kill", "when": "mid-body"},
     "killed by signal 9 (SIGKILL) during scoring task"),
    # lm-eval retries a request 3 times: an error on every one is the server's failure
    ({"every": True, "action": "status"}, "failed scoring task"),
], ids=["killed-mid-answer", "500-every-time"])
def test_a_server_that_fails_an_lm_eval_request_fails_that_variant_only(
        tiny_model: Path, workspace: Path, faulty: Any, fault: dict, said: str) -> None:
    base = baselines.resolve(str(tiny_model))
    quantize.quantize(base, recipes.load("fp8"))
    root = faulty({"models": ["fp8"], "faults": [
        {"path": "/v1/completions", "body": '"echo": true', **fault}]})
    settings = EvalSettings(baseline=str(tiny_model), recipes=("fp8",), suites=("app",),
                            limit=4, backend="served", divergence=False, engine=ENGINE)
    report = evaluate.run(settings)
    applied = faults.events(root)
    assert applied and all("fp8" in e["served"] for e in applied), applied
    failure = report["fp8"].failed
    assert failure is not None, report
    assert said in failure.reason, failure.reason
    assert "(lm-eval's requests)" in failure.reason
    assert EvalFailure.load(base.name, "fp8") is not None
    assert report["baseline (served)"].results  # the baseline was scored
    assert not _left_running(workspace)
