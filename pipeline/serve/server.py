"""A vLLM server as a context manager: start, wait until it answers, watch memory, stop.

The server runs from the serving environment (``.venv-serve``, its own pins) as ``vllm serve``
on 127.0.0.1 and a free port, in its own process group (:mod:`pipeline.core.procs`). Up means
answered: ``/health``, then a warm-up request (prefill and a few decode steps), so that a
format that loads but cannot run (a kernel missing on this CPU or GPU) fails at the start as
:class:`~pipeline.serve.failure.UnsupportedFormat`. Leaving the ``with`` block (normally, on an
error, on Ctrl-C or SIGTERM) stops the whole group; if qpipe itself is killed, the kernel sends
the server SIGTERM, so no server outlives a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from pipeline.core import hardware, procs
from pipeline.core.hardware import serve_target
from pipeline.core.provenance import serve_python
from pipeline.serve.failure import ServeError, UnsupportedFormat, failure_reason
from pipeline.serve.settings import EngineSettings

# Scripts run by the serving environment's Python (they import only vLLM and torch).
WORKERS_DIR = Path(__file__).with_name("workers")
# The warm-up request: a short prefill and a few decode steps. A prompt shorter than one KV
# block leaves nothing in the prefix cache for the measurements to hit.
WARMUP_PROMPT = "The capital of France is"
WARMUP_TOKENS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``with VllmServer(model_dir, name, settings, log_path) as server: server.base_url``."""

    death_grace_s = 20.0  # after a failed warm-up: time for the engine to exit and log why

    def __init__(self, model_dir: Path, served_name: str, settings: EngineSettings,
                 log_path: Path, startup_timeout: float = 600, target: str | None = None,
                 warmup_timeout: float = 300) -> None:
        self.model_dir = model_dir
        self.served_name = served_name
        self.target = target or serve_target()
        self.settings = settings.resolved(self.target)
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.warmup_timeout = warmup_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.peak_memory_bytes = 0
        self._sampler: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        s = self.settings
        vllm = serve_python().parent / "vllm"
        cmd = [str(vllm), "serve", str(self.model_dir), "--served-model-name", self.served_name,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", s.dtype,
               "--max-model-len", str(s.max_model_len),
               "--enable-prefix-caching" if s.enable_prefix_caching
               else "--no-enable-prefix-caching"]
        if self.target == "cuda":
            cmd += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
        if s.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
        if s.max_num_seqs:
            cmd += ["--max-num-seqs", str(s.max_num_seqs)]
        if s.enforce_eager:
            cmd.append("--enforce-eager")
        if s.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(s.tensor_parallel_size)]
        if s.pipeline_parallel_size > 1:
            cmd += ["--pipeline-parallel-size", str(s.pipeline_parallel_size)]
        return [*cmd, *s.extra_args]

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        if self.target == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.settings.kv_cache_space_gib))
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # ~20% faster on 2 cores
            env.update(hardware.serving_environment(hardware.forced_isa()))
        return env

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Launch the server and wait until it answers a request (stopped on any failure)."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting: several servers can then load at once."""
        if not serve_python().exists():
            raise ServeError(f"the serving environment is missing ({serve_python()}): run "
                             "`make setup` (or set QPIPE_SERVE_PYTHON to a Python with vLLM).")
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")
        self.proc = procs.start(self.command(), log=self.log_path, env=self.environment(),
                                die_with_parent=True)
        self._sampler = threading.Thread(target=self._sample_memory, daemon=True)
        self._sampler.start()

    def wait_ready(self) -> None:
        """Up means answered: ``/health``, then a warm-up request."""
        try:
            self._wait_healthy()
            self._warm_up()
        except BaseException:
            self.stop()
            raise

    def _fail(self, what: str) -> ServeError:
        """The error for an engine that failed, classified by its log's fatal error."""
        assert self.proc is not None
        reason, unsupported = failure_reason(self.log_text())
        if unsupported:
            reason = f"{reason} ({hardware.explain(reason, hardware.profile())})"
            return UnsupportedFormat(f"vLLM cannot serve {self.served_name} ({self.model_dir}) "
                                     f"on this hardware: {reason}. Full log: {self.log_path}",
                                     reason=reason)
        code = self.proc.poll()
        state = f"exit {code}" if code is not None else "still running"
        return ServeError(f"vLLM {what} {self.served_name} ({self.model_dir}; {state}): "
                          f"{reason}. Full log: {self.log_path}", reason=reason)

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._fail("could not serve")
            if self.healthy():
                return
            time.sleep(1)
        raise ServeError(f"vLLM did not become healthy within {self.startup_timeout:.0f} s "
                         f"serving {self.model_dir}; it was stopped. Log: {self.log_path}")

    def _warm_up(self) -> None:
        assert self.proc is not None
        body = json.dumps({"model": self.served_name, "prompt": WARMUP_PROMPT,
                           "max_tokens": WARMUP_TOKENS, "temperature": 0,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{self.base_url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.warmup_timeout) as response:
                answer = json.loads(response.read())
            if answer.get("usage", {}).get("completion_tokens", 0) >= 1:
                return
            problem = f"the warm-up request got no tokens back ({str(answer)[:200]})"
        except (OSError, ValueError) as err:  # HTTPError and URLError are OSErrors
            detail = f"HTTP {err.code}: {err.read().decode(errors='replace')[:300]}" \
                if isinstance(err, urllib.error.HTTPError) else str(err)
            problem = f"the warm-up request failed ({detail})"
        # An engine that cannot run a kernel dies on its first request: give it time to go
        # down and log why, then classify by that.
        deadline = time.monotonic() + self.death_grace_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        error = self._fail("answered /health but failed its warm-up request for")
        if not isinstance(error, UnsupportedFormat) and self.proc.poll() is None:
            error = ServeError(f"vLLM answered /health but {problem} serving {self.served_name};"
                               f" it was stopped. Log: {self.log_path}", reason=problem)
        raise error

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        """Raise if the server died (e.g. mid-benchmark), with the reason from its log."""
        if not self.alive():
            reason, _ = failure_reason(self.log_text())
            code = self.proc.returncode if self.proc else None
            how = f"was killed by signal {-code}" if code is not None and code < 0 \
                else f"died (exit {code})"
            raise ServeError(f"the vLLM server for {self.served_name} {how}: {reason}. "
                             f"Log: {self.log_path}", reason=f"server {how}: {reason}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def metrics_text(self) -> str:
        """The server's Prometheus ``/metrics``; a dead or silent server is a ServeError."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=30) as response:
                return response.read().decode()
        except OSError as err:
            if self.proc is not None:  # a refused or reset connection: is it going down?
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5)
            self.check_alive()
            raise ServeError(f"the vLLM server for {self.served_name} did not answer /metrics "
                             f"({err}). Log: {self.log_path}", reason=f"/metrics: {err}") from None

    def processes(self) -> list[psutil.Process]:
        """The server and every process it started."""
        return procs.family(self.proc) if self.proc is not None else []

    def _sample_memory(self) -> None:
        while not self._stopping.is_set():
            self.peak_memory_bytes = max(self.peak_memory_bytes, self._memory_now())
            self._stopping.wait(0.5)

    def _memory_now(self) -> int:
        if self.target == "cuda":
            return gpu_memory_of({p.pid for p in self.processes()})
        total = 0
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total

    def stop(self, timeout: float = 30) -> None:
        """Stop the whole process group (:func:`pipeline.core.procs.stop`)."""
        self._stopping.set()
        procs.stop(self.proc, timeout)
        if self._sampler is not None:
            self._sampler.join(timeout=5)


def gpu_memory_of(pids: set[int]) -> int:
    """GPU memory nvidia-smi attributes to ``pids`` (0 where it cannot say: MIG, containers)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    total = 0
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and int(pid) in pids and mib.strip().isdigit():  # MIG: [N/A]
            total += int(mib.strip()) * 2**20
    return total


def describe_command(server: VllmServer) -> str:
    """The command (with its CPU environment) that starts this server by hand."""
    import shlex

    cpu_env = [f"{k}={v}" for k, v in server.environment().items()
               if k.startswith(("VLLM_CPU", hardware.ISA_ENV))]
    return shlex.join([*cpu_env, *server.command()])
