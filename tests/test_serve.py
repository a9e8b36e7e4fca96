"""Server lifecycle failure paths, with a stand-in `vllm` executable, and log parsing."""

from __future__ import annotations

import os
import stat
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from pipeline.serve import EngineSettings, ServeError, UnsupportedFormat, VllmServer, failure_reason

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
    # Answers /health, then dies (as an engine crash mid-benchmark would).
    "dies": """
        import http.server, sys, threading, os, time
        port = int(sys.argv[sys.argv.index("--port") + 1])
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
            def log_message(self, *a): pass
        server = http.server.HTTPServer(("127.0.0.1", port), H)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        time.sleep(float(os.environ.get("FAKE_LIFETIME", "3")))
        print("(EngineCore pid=7) ERROR [core.py:9] RuntimeError: EngineCore died unexpectedly")
        sys.stdout.flush()
        os._exit(1)
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
    assert not [p for p in alive if "vllm" in " ".join(p.cmdline())]


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
