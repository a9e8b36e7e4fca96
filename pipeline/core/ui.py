"""``make ui``: the MLflow UI on 127.0.0.1 over qpipe's tracking store; Ctrl-C stops all of it."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys

from pipeline.core import paths
from pipeline.core.errors import ConfigError


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) != 0


def server_command(port: int, host: str = "127.0.0.1") -> list[str]:
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
            paths.default_tracking_uri(), "--host", host, "--port", str(port), "--workers", "1"]


def server_env() -> dict[str, str]:
    # Without this, MLflow 3.17 starts huey job consumers in their own sessions that
    # outlive a SIGTERM to the server.
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "MLFLOW_ALLOW_FILE_STORE": "true"}


def stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after ``timeout``."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=5000, help="port on 127.0.0.1 (%(default)s)")


def run(args: argparse.Namespace) -> int:
    if not port_is_free(args.port):
        raise ConfigError(f"port {args.port} on 127.0.0.1 is in use (another `make ui`?): open "
                          f"http://127.0.0.1:{args.port} or choose another with MLFLOW_PORT=.")
    print(f"[ui] MLflow UI on http://127.0.0.1:{args.port} over {paths.default_tracking_uri()} "
          "(Ctrl-C stops it)")
    proc = subprocess.Popen(server_command(args.port), env=server_env(), start_new_session=True)
    try:
        return proc.wait()
    finally:
        stop(proc)
        print("[ui] stopped")
