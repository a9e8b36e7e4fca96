"""Faults injected at each phase of a served model (start-up, /health, warm-up, /metrics): each
ends as one ServeError sentence that names the model, the phase, what the connection or the
process did, and the log; nothing is left running. A stand-in server behind the fault proxy
(tests/faults.py) makes these fast and independent of the machine's speed; the same faults
against a real vLLM server are in test_bench_faults.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.serve import EngineSettings, ServeError, UnsupportedFormat
from pipeline.serve.server import VllmServer
from tests import faults, services

NAME = "tiny-int8"


@pytest.fixture
def serve_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``serve_with(plan, **timeouts)``: a VllmServer (not started) behind the fault proxy."""
    made: list[VllmServer] = []

    def make(plan: dict[str, Any], **attrs: float) -> VllmServer:
        for key, value in faults.serving_env(tmp_path / "fault", plan).items():
            monkeypatch.setenv(key, value)
        server = VllmServer(tmp_path / "model", NAME, EngineSettings(), tmp_path / "server.log",
                            startup_timeout=attrs.pop("startup_timeout", 60), target="cpu",
                            warmup_timeout=attrs.pop("warmup_timeout", 30))
        server.death_grace_s, server.death_wait_s = 1.0, 1.0
        for key, value in attrs.items():
            setattr(server, key, value)
        made.append(server)
        return server

    yield make
    for server in made:  # nothing left running, whatever the test did
        server.stop()
        assert server.proc is not None
        assert not services.process_group(server.proc.pid), server.log_text()[-2000:]


def _fails(server: VllmServer, call: Any) -> ServeError:
    with pytest.raises(ServeError) as info:
        call()
    err = info.value
    assert not isinstance(err, UnsupportedFormat), err  # a fault is never a hardware limit
    assert NAME in str(err) and str(server.log_path) in str(err), err
    return err


def _applied(tmp_path: Path) -> list[str]:
    return [e.get("action") or e.get("fault") for e in faults.events(tmp_path / "fault")]


def test_the_stand_in_serves_warms_up_and_exports_metrics(serve_with: Any) -> None:
    server = serve_with({})
    server.start()
    text = server.metrics_text()
    assert "vllm:cache_config_info" in text and len(text) > 40_000  # as long as vLLM's
    assert server.alive()


@pytest.mark.parametrize(("plan", "said"), [
    ({"exit_at_start": "ValueError: max_model_len 99999 is larger than the model's 1024"},
     ["died (exit 1) during start-up", "ValueError: max_model_len 99999"]),
    ({"kill_on_log": "Starting vLLM API server"},
     ["was killed by signal 9 (SIGKILL) during start-up", "out-of-memory killer"]),
], ids=["exits", "killed"])
def test_a_server_that_dies_at_start_up_says_how_and_why(serve_with: Any, tmp_path: Path,
                                                         plan: dict, said: list[str]) -> None:
    server = serve_with(plan)
    err = _fails(server, server.start)
    assert all(s in str(err) for s in said), err
    assert _applied(tmp_path)
    assert not server.alive()


def test_a_server_whose_health_never_answers_is_stopped_at_its_deadline(
        serve_with: Any, tmp_path: Path) -> None:
    server = serve_with({"faults": [{"path": "/health", "action": "stall", "every": True}]},
                        startup_timeout=4)
    err = _fails(server, server.start)
    assert "did not become healthy within 4 s" in str(err)
    assert not server.alive()  # stopped at once


@pytest.mark.parametrize(("fault", "said"), [
    ({"action": "status"}, "the warm-up request (after /health answered): HTTP 500"),
    ({"action": "drop"}, "the connection closed mid-answer"),
    ({"action": "half-headers"}, "failed the warm-up request (after /health answered): an empty"),
    ({"action": "stall"}, "no answer within 2 s"),
    ({"action": "kill"}, "was killed by signal 9 (SIGKILL) during the warm-up request"),
    ({"action": "kill", "when": "mid-body"}, "killed by signal 9 (SIGKILL) during the warm-up"),
], ids=["500", "dropped-mid-body", "half-headers", "stalled", "killed", "killed-mid-body"])
def test_a_warm_up_request_that_fails_in_any_way_is_one_sentence(
        serve_with: Any, tmp_path: Path, fault: dict, said: str) -> None:
    server = serve_with({"faults": [{"path": "/v1/completions", **fault}]}, warmup_timeout=2)
    err = _fails(server, server.start)
    assert said in str(err), err
    assert _applied(tmp_path) == [fault["action"]]
    assert not server.alive()


@pytest.mark.parametrize(("fault", "said"), [
    # the fault first seen on an AVX2-only machine: a kill that lands mid-body
    ({"action": "drop"}, "failed the KV-cache read-out (/metrics): the connection closed "
                         "mid-answer"),
    ({"action": "half-headers"}, "failed the KV-cache read-out (/metrics): "),
    ({"action": "status"}, "failed the KV-cache read-out (/metrics): HTTP 500"),
    ({"action": "stall"}, "failed the KV-cache read-out (/metrics): no answer within 2 s"),
    ({"action": "kill"}, "was killed by signal 9 (SIGKILL) during the KV-cache read-out"),
    ({"action": "kill", "when": "mid-body"},
     "was killed by signal 9 (SIGKILL) during the KV-cache read-out"),
], ids=["dropped-mid-body", "half-headers", "500", "stalled", "killed", "killed-mid-body"])
def test_a_metrics_scrape_that_fails_in_any_way_is_one_sentence(
        serve_with: Any, tmp_path: Path, fault: dict, said: str) -> None:
    server = serve_with({"faults": [{"path": "/metrics", **fault}]}, metrics_timeout=2)
    server.start()
    err = _fails(server, lambda: server.metrics_text("the KV-cache read-out (/metrics)"))
    assert said in str(err), err
    assert _applied(tmp_path) == [fault["action"]]
    assert server.alive() == (fault["action"] != "kill")
    # the table's and MLflow's short reason names the phase too
    assert "KV-cache read-out" in err.reason


def test_the_phase_of_a_failure_is_in_its_short_reason_with_what_to_do(
        serve_with: Any) -> None:
    server = serve_with({"faults": [{"path": "/metrics", "nth": 2, "action": "kill"}]})
    server.start()
    server.metrics_text("the /metrics scrape before load point chat at concurrency 1, repeat 1")
    err = _fails(server, lambda: server.metrics_text(
        "the /metrics scrape after load point chat at concurrency 1, repeat 1"))
    assert err.reason.startswith("server was killed by signal 9 (SIGKILL) during the /metrics "
                                 "scrape after load point chat at concurrency 1, repeat 1")
    assert "dmesg" in err.reason  # what to do


def test_a_request_error_of_any_kind_is_described_in_words() -> None:
    import http.client
    import urllib.error

    from pipeline.serve import http as qhttp

    cases = {
        http.client.IncompleteRead(b"x" * 10, 40): "closed mid-answer (10 bytes read, 40 more",
        http.client.RemoteDisconnected("gone"): "closed before any answer",
        http.client.BadStatusLine("HTT"): "a malformed answer (BadStatusLine",
        urllib.error.URLError(ConnectionRefusedError(111, "refused")): "was refused",
        urllib.error.URLError("unknown host"): "could not connect (unknown host)",
        TimeoutError("timed out"): "no answer within 3 s",
        ConnectionResetError(104, "reset"): "the connection was reset",
    }
    for err, said in cases.items():
        assert isinstance(err, qhttp.REQUEST_ERRORS)
        assert said in qhttp.describe(err, 3), (err, qhttp.describe(err, 3))


def test_a_probe_times_the_warm_request_and_abandons_one_that_does_not_answer(
        serve_with: Any, tmp_path: Path) -> None:
    """The speed probe bench runs on every server: seconds when answered, None when no
    answer came in time (the too-slow rule's input), and a failure a ServeError naming it."""
    server = serve_with({"faults": [
        {"path": "/v1/completions", "agent": "qpipe", "nth": 3, "action": "stall",
         "seconds": 30},
        # the 4th: the stalled 3rd request was counted by the first fault only
        {"path": "/v1/completions", "agent": "qpipe", "nth": 3, "action": "status"}]})
    server.start()  # the warm-up: the first qpipe completion
    took = server.probe(10)
    assert took is not None and 0 < took < 10
    assert server.probe(1) is None  # stalled: abandoned at the timeout
    assert _applied(tmp_path) == ["stall"]
    err = _fails(server, lambda: server.probe(10))
    assert _applied(tmp_path) == ["stall", "status"]
    assert "the speed probe" in str(err) and "HTTP 500" in str(err), err
