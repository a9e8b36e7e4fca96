"""Server lifecycle failure paths, with a stand-in `vllm` executable, and log parsing."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from pipeline.core import hardware, procs
from pipeline.serve.server import (
    EngineSettings,
    ServeError,
    UnsupportedFormat,
    VllmServer,
    ephemeral_range,
    failure_reason,
    free_port,
)

# A stand-in server: GET answers 200 (/health, /metrics); POST calls the scenario's handler.
HTTP_FAKE = """
        import http.server, json, os, sys, threading, time
        port = int(sys.argv[sys.argv.index("--port") + 1])
        COMPLETION = json.dumps({"choices": [{"text": " Paris"}],
                                 "usage": {"completion_tokens": 4}}).encode()
        handler = None
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                handler(self)
            def log_message(self, *a): pass
        def answer(code, body):
            def reply(request):
                request.send_response(code); request.end_headers(); request.wfile.write(body)
            return reply
        def serve(on_post):
            global handler
            handler = on_post
            server = http.server.HTTPServer(("127.0.0.1", port), H)
            threading.Thread(target=server.serve_forever, daemon=True).start()
"""

FAKE_VLLM = {
    "unsupported": """
        import sys
        print("INFO 11-29 09:45:00 [api_server.py:1] vLLM API server version 0.32.0")
        print("(Worker pid=1) ERROR 11-29 09:45:01 [multiproc_executor.py:953] ValueError: "
              "Failed to find a kernel that can implement the MXFP4 linear layer. Reasons: ")
        sys.exit(1)
    """,
    "crash": """
        import sys
        print("ERROR 11-29 09:45:01 [core.py:1] RuntimeError: out of memory allocating KV cache")
        sys.exit(3)
    """,
    "hang": """
        import time
        time.sleep(600)
    """,
    # Answers /health and its warm-up request, then dies (an engine crash mid-benchmark).
    "dies": HTTP_FAKE + """
        serve(answer(200, COMPLETION))
        time.sleep(float(os.environ.get("FAKE_LIFETIME", "3")))
        print("(EngineCore pid=7) ERROR [core.py:9] RuntimeError: EngineCore died unexpectedly")
        sys.stdout.flush()
        os._exit(1)
    """,
    # Loads, answers /health, and dies at its first request: a kernel this CPU's vLLM lacks.
    "kernel_missing": HTTP_FAKE + """
        def die():
            print("(Worker pid=9) ERROR 11-30 18:22:15 [multiproc_executor.py:1063] "
                  "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'")
            print("(EngineCore pid=8) ERROR 11-30 18:22:15 [core.py:1512] RuntimeError: Worker "
                  "failed with error ''_OpNamespace' '_C' object has no attribute "
                  "'cpu_gemm_wna16'', please check the stack trace above for the root cause")
            sys.stdout.flush()
            os._exit(1)
        serve(lambda request: die())
        time.sleep(600)
    """,
    # The first start finds its port taken (vLLM's API server then stays up, unbound); the
    # second serves.
    "port_taken": HTTP_FAKE + """
        marker = os.path.join(os.path.dirname(sys.argv[0]), "started-once")
        if not os.path.exists(marker):
            open(marker, "w").close()
            print("OSError: [Errno 98] Address already in use (while attempting to bind on "
                  f"address ('127.0.0.1', {port}))")
            sys.stdout.flush()
            time.sleep(600)
        serve(answer(200, COMPLETION))
        time.sleep(600)
    """,
    # Answers /health but every completion with HTTP 500, and stays up.
    "answers_500": HTTP_FAKE + """
        serve(answer(500, b'{"error": "internal"}'))
        time.sleep(600)
    """,
    # Warns that something "is not supported", then dies of an out-of-memory error.
    "oom": """
        import sys
        print("WARNING 11-30 09:45:00 [config.py:1] chunked prefill is not supported here")
        print("ERROR 11-30 09:45:01 [core.py:1] torch.OutOfMemoryError: CUDA out of memory. "
              "Tried to allocate 2.00 GiB")
        sys.exit(1)
    """,
}


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def make(kind: str) -> Path:
        bin_dir = tmp_path / f"bin-{kind}"
        bin_dir.mkdir()
        (bin_dir / "python").symlink_to(sys.executable)
        script = bin_dir / "vllm"
        script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(FAKE_VLLM[kind]))
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("QPIPE_SERVE_PYTHON", str(bin_dir / "python"))
        return bin_dir
    return make


def _server(tmp_path: Path, timeout: float = 60) -> VllmServer:
    return VllmServer(tmp_path, "m", EngineSettings(), tmp_path / "server.log",
                      startup_timeout=timeout, target="cpu")


def _no_children_left() -> None:
    _, alive = psutil.wait_procs(psutil.Process(os.getpid()).children(recursive=True), timeout=5)
    assert not [p for p in alive if "vllm" in procs.command_line(p)]


def test_engine_without_a_kernel_is_reported_unsupported_with_its_reason(
        tmp_path: Path, fake_vllm) -> None:
    fake_vllm("unsupported")
    with pytest.raises(UnsupportedFormat) as err, _server(tmp_path):
        pass
    assert "Failed to find a kernel that can implement the MXFP4 linear layer" in str(err.value)
    assert "(Worker pid" not in str(err.value) and str(tmp_path / "server.log") in str(err.value)
    _no_children_left()


def test_engine_that_fails_to_start_is_a_serve_error(tmp_path: Path, fake_vllm) -> None:
    fake_vllm("crash")
    with pytest.raises(ServeError) as err, _server(tmp_path):
        pass
    assert not isinstance(err.value, UnsupportedFormat)
    assert "out of memory allocating KV cache" in str(err.value) and "exit 3" in str(err.value)
    _no_children_left()


def test_a_port_taken_before_vllm_binds_it_is_left_for_another_once(
        tmp_path: Path, fake_vllm) -> None:
    fake_vllm("port_taken")
    server = _server(tmp_path, timeout=30)
    with server:  # the first process never binds: healthy only once started again
        assert server.healthy()
    assert "Address already in use" not in server.log_text()  # the log is the second start's
    assert (tmp_path / "bin-port_taken" / "started-once").exists()
    _no_children_left()


def test_free_ports_lie_below_the_range_other_processes_bind_at_random() -> None:
    low, _ = ephemeral_range()
    assert all(port < low for port in {free_port() for _ in range(20)})


def test_health_timeout_stops_the_server(tmp_path: Path, fake_vllm) -> None:
    fake_vllm("hang")
    server = _server(tmp_path, timeout=3)
    with pytest.raises(ServeError, match="did not become healthy within 3 s"), server:
        pass
    assert server.proc is not None and server.proc.poll() is not None
    _no_children_left()


def test_server_dying_mid_run_is_detected_with_its_reason(
        tmp_path: Path, fake_vllm, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    fake_vllm("dies")
    monkeypatch.setenv("FAKE_LIFETIME", "2")
    with _server(tmp_path) as server:
        server.check_alive()  # healthy at first
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        with pytest.raises(ServeError, match="EngineCore died unexpectedly"):
            server.check_alive()
    _no_children_left()


def test_interrupt_while_waiting_stops_the_server(tmp_path: Path, fake_vllm,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm("hang")
    server = _server(tmp_path)

    def interrupted(self: VllmServer) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(VllmServer, "healthy", interrupted)
    with pytest.raises(KeyboardInterrupt), server:
        pass
    assert server.proc is not None and server.proc.poll() is not None
    _no_children_left()


def test_failure_reason_prefers_the_kernel_line_over_the_traceback() -> None:
    log = "\n".join([
        "(Worker pid=9) ERROR 11-29 09:45:01 [x.py:1] ValueError: Failed to find a kernel that "
        "can implement the MXFP4 linear layer.",
        "(EngineCore pid=8) ERROR 11-29 09:45:04 [core.py:1510] RuntimeError: Engine core "
        "initialization failed. See root cause above.",
    ])
    reason, unsupported = failure_reason(log)
    assert unsupported and reason.startswith("ValueError: Failed to find a kernel")
    # vLLM's workers log the traceback's source lines at ERROR level too: the message wins
    worker = "(Worker pid=7187) ERROR 11-30 21:54:01 [multiproc_executor.py:1063] "
    reason, unsupported = failure_reason("\n".join([
        worker + "    raise NotImplementedError(",
        worker + "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX.",
    ]))
    assert unsupported
    assert reason == "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX"
    reason, unsupported = failure_reason("RuntimeError: boom: no memory\n")
    assert not unsupported and reason == "RuntimeError: boom: no memory"
    reason, _ = failure_reason("pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
                               "  Value error, invalid literal for int(): '0.25'\n")
    assert reason.endswith("VllmConfig: Value error, invalid literal for int(): '0.25'")


def test_cpu_and_gpu_commands_differ_only_where_they_must(tmp_path: Path) -> None:
    settings = EngineSettings(max_model_len=512, kv_cache_space_gib=2,
                              enable_prefix_caching=False)
    cpu = VllmServer(tmp_path, "m", settings, tmp_path / "l", target="cpu")
    gpu = VllmServer(tmp_path, "m", settings, tmp_path / "l", target="cuda")
    assert "--no-enable-prefix-caching" in cpu.command()
    assert "--gpu-memory-utilization" in gpu.command()
    assert "--gpu-memory-utilization" not in cpu.command()
    assert cpu.environment()["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "VLLM_CPU_KVCACHE_SPACE" not in {k for k in gpu.environment() if k not in os.environ}


def test_a_cpu_server_runs_its_worker_in_process_with_vllms_automatic_binding(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(hardware, "serving_cpus", lambda: (0, 2))
    settings = EngineSettings()
    cpu = VllmServer(tmp_path, "m", settings, tmp_path / "l", target="cpu")
    assert cpu.command()[-2:] == ["--distributed-executor-backend", "uni"]
    env = cpu.environment()
    assert (env["VLLM_ENABLE_V1_MULTIPROCESSING"], env["OMP_NUM_THREADS"], env["OMP_PLACES"],
            env["OMP_PROC_BIND"]) == ("0", "2", "{0,2}", "true")
    # vLLM's own processes where it binds by NUMA node, on GPUs, across devices, or when the
    # user binds or picks the executor
    kept = [VllmServer(tmp_path, "m", settings, tmp_path / "l", target="cuda"),
            VllmServer(tmp_path, "m", settings.model_copy(update={"tensor_parallel_size": 2}),
                       tmp_path / "l", target="cpu"),
            VllmServer(tmp_path, "m", settings.model_copy(
                update={"extra_args": ("--distributed-executor-backend", "mp")}),
                tmp_path / "l", target="cpu")]
    monkeypatch.setattr(hardware, "serving_cpus", lambda: None)
    kept.append(VllmServer(tmp_path, "m", settings, tmp_path / "l", target="cpu"))
    for server in kept:
        assert server.command().count("--distributed-executor-backend") <= 1
        assert "uni" not in server.command()
        added = server.environment().keys() - os.environ.keys()
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in added
    monkeypatch.setattr(hardware, "serving_cpus", lambda: (0, 1))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert "uni" not in VllmServer(tmp_path, "m", settings, tmp_path / "l", target="cpu").command()


def test_a_format_that_loads_but_cannot_run_is_unsupported_with_the_hardware_fact(
        tmp_path: Path, fake_vllm) -> None:
    """Served means answered: /health alone is not enough (vLLM CPU's AVX2 kernels)."""
    fake_vllm("kernel_missing")
    with pytest.raises(UnsupportedFormat) as err, _server(tmp_path):
        pass
    reason = err.value.reason
    assert reason.startswith("AttributeError: '_OpNamespace' '_C' object has no attribute "
                             "'cpu_gemm_wna16'"), reason  # the root cause, not the RuntimeError
    assert "cpu_gemm_wna16 kernel for W4A16" in reason and "_C_AVX" in reason
    _no_children_left()


def test_a_server_that_fails_its_warm_up_but_lives_is_a_serve_error(
        tmp_path: Path, fake_vllm) -> None:
    fake_vllm("answers_500")
    server = _server(tmp_path)
    server.death_grace_s = 2
    with pytest.raises(ServeError) as err, server:
        pass
    assert not isinstance(err.value, UnsupportedFormat)
    assert "failed the warm-up request" in str(err.value) and "500" in str(err.value)
    assert server.proc is not None and server.proc.poll() is not None  # stopped
    _no_children_left()


def test_an_out_of_memory_crash_is_not_recorded_as_unsupported(tmp_path: Path, fake_vllm) -> None:
    fake_vllm("oom")
    with pytest.raises(ServeError) as err, _server(tmp_path):
        pass
    assert not isinstance(err.value, UnsupportedFormat)
    assert "OutOfMemoryError" in err.value.reason


@pytest.mark.parametrize("line, refused", [
    # vLLM's refusal sites, as their format strings write them
    ("ValueError: The quantization method compressed-tensors is not supported for the current "
     "GPU. Minimum capability: 80. Current capability: 75.", True),
    ("RuntimeError: Quantization scheme is not supported for the current GPU. Min capability: "
     "89. Current capability: 80.", True),
    ("ValueError: fp8 quantization is currently not supported in cpu.", True),
    ("ValueError: No compressed-tensors compatible scheme was found for layer_name='x'", True),
    # oneDNN without the op for FP8 on AVX2 (torch._scaled_mm; a Xeon, VLLM_CPU_ISA=avx2)
    ("RuntimeError: could not create a primitive descriptor for the matmul primitive. Run "
     "workload with environment variable ONEDNN_VERBOSE=all to get additional diagnostic "
     "information.", True),
    # GPU-only crashes (compile, CUDA graphs, a missing CUDA op): failures, not hardware facts
    ("RuntimeError: CUDA error: operation not supported when stream is capturing", False),
    ("torch._dynamo.exc.Unsupported: call_function BuiltinVariable(setattr) is not supported",
     False),
    ("NotImplementedError: Could not run 'aten::_fp8_op' with arguments from the 'CUDA' backend",
     False),
    ("ValueError: Weight output_partition_size = 576 is not divisible by weight quantization "
     "block_n = 128", True),  # as vLLM 0.32 refused fp8-block on the embedded model
    ("NotImplementedError: Currently supported kv cache quantization is num_bits=8, type=float, "
     "however received num_bits=4, type=int", False),  # the checkpoint's, on any hardware
])
def test_only_vllms_refusal_sites_mean_unsupported(line: str, refused: bool) -> None:
    reason, unsupported = failure_reason(f"(EngineCore pid=7) ERROR 12-01 10:00:00 [core.py:1] "
                                         f"{line}\n")
    assert unsupported is refused and reason == line.rstrip(".")


def test_failure_reason_ignores_warnings_and_prefers_a_resource_failure() -> None:
    log = ("WARNING 11-30 [x.py:1] FP8 KV cache is not supported on this device\n"
           "ERROR 11-30 [core.py:1] RuntimeError: CUDA error: out of memory\n")
    reason, unsupported = failure_reason(log)
    assert not unsupported and "out of memory" in reason
    reason, unsupported = failure_reason("WARNING [x.py:1] is not supported\n"
                                         "ERROR [core.py:1] ValueError: bad max_model_len\n")
    assert not unsupported and reason == "ValueError: bad max_model_len"
    # a warning that quotes an exception vLLM recovered from is not the root cause
    reason, unsupported = failure_reason(
        "(EngineCore pid=7) WARNING 12-04 03:06:13 [utils.py:597] Failed to create oneDNN "
        "linear, fallback to torch linear. Exception: could not create a primitive "
        "descriptor for the matmul primitive.\n"
        "(EngineCore pid=7) ERROR 12-04 03:06:36 [core.py:1512] RuntimeError: shape mismatch\n")
    assert not unsupported and reason == "RuntimeError: shape mismatch"


def test_metrics_of_a_killed_server_is_a_serve_error_naming_it(
        tmp_path: Path, fake_vllm, monkeypatch: pytest.MonkeyPatch) -> None:
    """kill -9 of a server mid-bench: one sentence naming the model and its log."""
    import signal

    fake_vllm("dies")
    monkeypatch.setenv("FAKE_LIFETIME", "600")
    with _server(tmp_path) as server:
        with contextlib.suppress(ProcessLookupError):  # gone already: the assertion says so
            os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        with pytest.raises(ServeError) as err:
            server.metrics_text()
    assert "the vLLM server for m was killed by signal 9" in str(err.value)
    assert str(tmp_path / "server.log") in str(err.value)
    _no_children_left()
