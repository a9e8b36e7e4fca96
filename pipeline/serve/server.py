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
import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import psutil

from pipeline.core import hardware, procs
from pipeline.core.hardware import serve_target
from pipeline.core.provenance import serve_python
from pipeline.serve import http
from pipeline.serve.failure import ServeError, UnsupportedFormat, failure_reason
from pipeline.serve.settings import EngineSettings

# Scripts run by the serving environment's Python (they import only vLLM and torch).
WORKERS_DIR = Path(__file__).with_name("workers")
# The warm-up request: a short prefill and a few decode steps. A prompt shorter than one KV
# block leaves nothing in the prefix cache for the measurements to hit.
WARMUP_PROMPT = "The capital of France is"
WARMUP_TOKENS = 4
# The phases a server can fail in, as errors name them (bench and eval name theirs).
START_UP = "start-up (loading the model, before /health answered)"
WARM_UP = "the warm-up request (after /health answered)"
PROBE = "the speed probe (the warm-up request, timed)"


PORT_TAKEN = "Address already in use"


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ``bind(0)`` (Linux's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free port below the kernel's ephemeral range: vLLM picks its engine's internal ports
    with ``bind(0)``, so a port from that range, free when chosen, can be taken by another
    server's engine before this one binds it (seen with three servers starting at once)."""
    low, _ = ephemeral_range()
    choose = random.Random()
    for _ in range(100):
        port = choose.randrange(max(1024, low - 10000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_environment(settings: EngineSettings, target: str) -> dict[str, str]:
    """The environment a vLLM process runs in (a server, or vLLM's benchmark client)."""
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    if target == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(settings.kv_cache_space_gib))
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # ~20% faster on 2 cores
        env.update(hardware.serving_environment(hardware.forced_isa()))
    return env


# Where a CPU server's one worker can run inside its engine process (vLLM's uniprocess
# executor, as on one GPU), it does, instead of in a third process: one import of vLLM and
# torch fewer a server. Five servers started at once on 2 cores were up in 96 s instead of 129,
# serving unchanged (in-process over three processes, 14 interleaved repeats of the chat
# headline, 2026-12-03: baseline 1.01x [0.95, 1.08], int8 0.99x [0.91, 1.08]). vLLM binds a
# worker's OpenMP threads only in the process it starts for it, so the engine process gets the
# binding vLLM's automatic one gives that worker: the same CPUs, one thread each.
IN_PROCESS_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS", "OMP_PLACES",
                  "OMP_PROC_BIND")


def in_process_cpus(settings: EngineSettings, target: str) -> tuple[int, ...] | None:
    """The CPUs of an in-process worker, or None where vLLM's own processes are kept: not a
    CPU, several devices, a machine with several NUMA nodes (vLLM binds one node's CPUs and
    memory), or the user's own binding (``VLLM_CPU_OMP_THREADS_BIND``) or executor."""
    if target != "cpu" or settings.tensor_parallel_size * settings.pipeline_parallel_size > 1:
        return None
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or any(
            arg.startswith("--distributed-executor-backend") for arg in settings.extra_args):
        return None
    return hardware.serving_cpus()


class VllmServer:
    """``with VllmServer(model_dir, name, settings, log_path) as server: server.base_url``."""

    death_grace_s = 20.0  # after a failed warm-up: time for the engine to exit and log why
    death_wait_s = 5.0  # after a failed request: time for a dying server's process to end
    metrics_timeout = 30.0

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
        if in_process_cpus(s, self.target):
            cmd += ["--distributed-executor-backend", "uni"]
        return [*cmd, *s.extra_args]

    def environment(self) -> dict[str, str]:
        env = server_environment(self.settings, self.target)
        cpus = in_process_cpus(self.settings, self.target)
        if cpus:
            places = "{" + ",".join(map(str, cpus)) + "}"
            env.update(zip(IN_PROCESS_ENV, ("0", str(len(cpus)), places, "true"), strict=True))
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
        if self._sampler is None or not self._sampler.is_alive():  # a relaunch keeps its own
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

    def _fail(self, phase: str) -> ServeError:
        """The error for an engine that failed during ``phase`` of its start, classified by
        its log's fatal error: a format this hardware cannot serve, or a failure."""
        assert self.proc is not None
        reason, unsupported = failure_reason(self.log_text())
        if unsupported:
            reason = f"{reason} ({hardware.explain(reason, hardware.profile())})"
            return UnsupportedFormat(f"vLLM cannot serve {self.served_name} ({self.model_dir}) "
                                     f"on this hardware: {reason}. Full log: {self.log_path}",
                                     reason=reason)
        if self.proc.poll() is not None:
            return self.died(phase)
        return ServeError(f"vLLM failed {phase} for {self.served_name} ({self.model_dir}; still "
                          f"running): {reason}. Full log: {self.log_path}", reason=reason)

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        relaunched = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._fail(START_UP)
            if self.healthy():
                return
            if not relaunched and self._port_taken():
                # taken between its choice and vLLM's bind, its API server stays up without
                # it: start again on another port, once
                procs.stop(self.proc, 30)
                self.launch()
                relaunched = True
            time.sleep(1)
        raise ServeError(f"vLLM did not become healthy within {self.startup_timeout:.0f} s "
                         f"serving {self.served_name} ({self.model_dir}); it was stopped. To do: "
                         f"its log says where it stopped: {self.log_path}",
                         reason=f"/health did not answer within {self.startup_timeout:.0f} s of "
                                "start-up; it was stopped (its log says where it stopped)")

    def _warmup_body(self) -> dict[str, object]:
        return {"model": self.served_name, "prompt": WARMUP_PROMPT,
                "max_tokens": WARMUP_TOKENS, "temperature": 0, "ignore_eos": True}

    def _warm_up(self) -> None:
        assert self.proc is not None
        try:
            answer = http.request_json(f"{self.base_url}/v1/completions", self.warmup_timeout,
                                       self._warmup_body())
            tokens = answer.get("usage", {}).get("completion_tokens", 0) \
                if isinstance(answer, dict) else 0
            if tokens >= 1:
                return
            problem = f"it got no tokens back ({str(answer)[:200]})"
        except http.RequestFailed as err:
            problem = err.detail
        # An engine that cannot run a kernel dies on its first request: give it time to go
        # down and log why, then classify by that.
        deadline = time.monotonic() + self.death_grace_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        _, unsupported = failure_reason(self.log_text())
        if unsupported or self.proc.poll() is not None:
            raise self._fail(WARM_UP)
        raise self.lost(WARM_UP, problem)

    def probe(self, timeout: float, phase: str = PROBE) -> float | None:
        """Seconds the warm-up request takes now (the server warm), or None when it gave no
        answer within ``timeout`` (the request is abandoned: vLLM aborts it when the
        connection closes). Any other failure is a :class:`ServeError` naming ``phase``."""
        started = time.monotonic()
        try:
            http.request_json(f"{self.base_url}/v1/completions", timeout, self._warmup_body())
        except http.RequestFailed as err:
            if err.timed_out:
                return None
            raise self.lost(phase, err.detail) from None
        return time.monotonic() - started

    def _port_taken(self) -> bool:
        """Whether vLLM's API server could not bind its port (its process stays up)."""
        text = self.log_text()
        return PORT_TAKEN in text and f"'127.0.0.1', {self.port})" in text

    def healthy(self) -> bool:
        try:
            http.request(f"{self.base_url}/health", timeout=2, allow_empty=True)
            return True
        except http.RequestFailed:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def died(self, phase: str) -> ServeError:
        """The error for a server whose process has ended: how (signal or exit code), during
        which phase, its log's last error, the log, and what to do."""
        reason, _ = failure_reason(self.log_text())
        code = self.proc.returncode if self.proc else None
        if code is not None and code < 0:
            how = f"was killed by signal {-code} ({_signal_name(-code)})"
            advice = ("signal 9 is most often the kernel's out-of-memory killer (see `dmesg`): "
                      "run fewer servers at once or lower KV_CACHE_GIB / GPU_UTIL, then re-run "
                      "it" if -code == signal.SIGKILL else "re-run it")
        else:
            how, advice = f"died (exit {code})", "its log says why; fix that and re-run it"
        short = f"server {how} during {phase}; its log ends: {reason[:160]}; {advice}"
        return ServeError(f"the vLLM server for {self.served_name} {how} during {phase}: "
                          f"{reason[:300]}. Log: {self.log_path}. To do: {advice}.",
                          reason=short)

    def lost(self, phase: str, detail: str) -> ServeError:
        """The error for a request that failed during ``phase``: the server's death if it is
        going down (a reset connection often means so), else what the connection did."""
        if self.going_down():
            return self.died(phase)
        return ServeError(f"the vLLM server for {self.served_name} failed {phase}: {detail}. "
                          f"It was stopped. Log: {self.log_path}. To do: re-run it; if it "
                          "fails again, the log says why.",
                          reason=f"{phase} failed: {detail}; re-run it (server log says why "
                                 "if it recurs)")

    def going_down(self) -> bool:
        """Whether the process ends within ``death_wait_s`` (after a failed request)."""
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(self.death_wait_s)
        return not self.alive()

    def check_alive(self, phase: str = "the run") -> None:
        """Raise if the server died (e.g. mid-benchmark), with the reason from its log."""
        if not self.alive():
            raise self.died(phase)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def metrics_text(self, phase: str = "a /metrics scrape") -> str:
        """The server's Prometheus ``/metrics``; a dead or silent server is a ServeError."""
        try:
            return http.request(f"{self.base_url}/metrics", self.metrics_timeout).decode(
                errors="replace")
        except http.RequestFailed as err:
            raise self.lost(phase, err.detail) from None

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

    def begin_stop(self) -> None:
        """Ask the server to shut down, without waiting (:meth:`stop` then waits)."""
        self._stopping.set()
        procs.terminate(self.proc)

    def stop(self, timeout: float = 30) -> None:
        """Stop the whole process group (:func:`pipeline.core.procs.stop`)."""
        self._stopping.set()
        procs.stop(self.proc, timeout)
        if self._sampler is not None:
            self._sampler.join(timeout=5)


def stop_servers(servers: list[VllmServer]) -> None:
    """Stop every server, all shutting down at once (each takes a few seconds)."""
    for server in servers:
        server.begin_stop()
    for server in servers:
        server.stop()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


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
               if k.startswith(("VLLM_CPU", hardware.ISA_ENV)) or k in IN_PROCESS_ENV]
    return shlex.join([*cpu_env, *server.command()])
