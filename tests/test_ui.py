"""`make ui`: the MLflow server answers on 127.0.0.1 and Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from pipeline.core import paths, procs
from pipeline.report.ui import port_is_free

pytestmark = pytest.mark.slow


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ui_serves_the_store_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "ui", "--port", str(port)],
                            env=env, cwd=paths.PROJECT_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        body = None
        while body is None:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the MLflow UI never answered"
            try:
                url = f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=10"
                with urllib.request.urlopen(url, timeout=5) as response:
                    body = json.loads(response.read())
            except OSError:
                time.sleep(0.5)
        assert any(e["name"] == "Default" for e in body["experiments"])
        family = procs.family(proc)[1:]
        assert family, "the server runs as a child process"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert "[ui] stopped" in out
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, f"left behind: {[procs.command_line(p) for p in alive]}"
    assert port_is_free(port)
