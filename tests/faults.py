"""Fault injection at named phases of a served model, deterministic on any machine.

:func:`serving_env` makes a stand-in serving environment: its ``vllm`` starts the real
``vllm serve`` (or, for tests without vLLM, a small stand-in server) on a private port and puts
a proxy in front of it on the port qpipe asked for. A fault plan (JSON) says which request to
break and how, so a fault lands at a protocol point (the 3rd ``/metrics`` scrape, the first
streamed completion), never at a moment that depends on how fast the machine is:

- ``kill``: SIGKILL the server process when the request arrives (``when: "request"``) or
  after part of its answer was sent (``when: "mid-body"``);
- ``drop``: close the connection after part of the answer (the server lives on);
- ``half-headers``: send half of the status line and headers, then close;
- ``stall``: hold the connection without answering;
- ``status``: answer with an error status (500).

A fault matches a request by ``path``, ``method``, a ``body`` substring and an ``agent``
(``qpipe``: qpipe's own requests, not vLLM's benchmark client's or lm-eval's), and fires on
the ``nth`` match (or ``every`` one).

and a plan's ``kill_on_log`` kills the server when a line of its log matches (a start-up
phase), ``exit_at_start`` makes it exit before it listens. When the server process ends, the
stand-in ``vllm`` ends the same way (the same exit code or signal), as the real one would.
Every fault applied is written to the plan's ``events`` file. Only the standard library is
used, and qpipe's own free port for the upstream server: this file runs under the serving
environment's Python and the pipeline's (both import ``pipeline.serve.server``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

PLAN_ENV = "QPIPE_FAULT_PLAN"


# --- what a test calls ---------------------------------------------------------------------------
def serving_env(root: Path, plan: dict[str, Any], serve_python: Path | None = None
                ) -> dict[str, str]:
    """Environment variables that make qpipe serve through the fault proxy with ``plan``.

    ``serve_python``: the real serving environment's Python (real vLLM upstream); without it
    the upstream is the stand-in server (``plan["upstream"] = "standin"``).
    """
    root.mkdir(parents=True, exist_ok=True)
    bindir = root / "serve-bin"
    bindir.mkdir(exist_ok=True)
    python = Path(serve_python) if serve_python else Path(sys.executable)
    plan = {"upstream": "vllm" if serve_python else "standin", "events": str(root / "events.jsonl"),
            **plan}
    if plan["upstream"] == "vllm":
        plan["vllm"] = str(python.parent / "vllm")
    (root / "plan.json").write_text(json.dumps(plan))
    (bindir / "python").write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
    (bindir / "vllm").write_text(f'#!/bin/sh\nexec "{python}" "{Path(__file__).resolve()}" '
                                 f'launch "$@"\n')
    for name in ("python", "vllm"):
        (bindir / name).chmod(0o755)
    # a vllm version for qpipe's provenance: the real environment's metadata, if any
    site = python.parent.parent / "lib"
    if site.is_dir() and not (root / "lib").exists():
        (root / "lib").symlink_to(site)
    return {PLAN_ENV: str(root / "plan.json"), "QPIPE_SERVE_PYTHON": str(bindir / "python")}


def events(root: Path) -> list[dict[str, Any]]:
    """The faults the proxy applied, in order."""
    path = root / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# --- the stand-in ``vllm`` -----------------------------------------------------------------------
def _log(*parts: object) -> None:
    print("[fault-proxy]", *parts, flush=True)


def _record(plan: dict[str, Any], **event: Any) -> None:
    with open(plan["events"], "a") as f:
        f.write(json.dumps(event) + "\n")
    _log("fault:", json.dumps(event))


def _free_port() -> int:
    """qpipe's own choice (below the ephemeral range, where vLLM's engines bind at random)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pipeline.serve.server import free_port
    return free_port()


def _option(argv: list[str], name: str, default: str = "") -> str:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


def _with_option(argv: list[str], name: str, value: str) -> list[str]:
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == name and i + 1 < len(argv):
            skip = True
            continue
        if arg.startswith(name + "="):
            continue
        out.append(arg)
    return [*out, name, value]


def launch(argv: list[str]) -> None:
    """``vllm serve ...`` with the plan of ``$QPIPE_FAULT_PLAN`` (argv without ``vllm``)."""
    plan = json.loads(Path(os.environ[PLAN_ENV]).read_text())
    served = _option(argv, "--served-model-name")
    port = int(_option(argv, "--port", "8000"))
    targets = plan.get("models")
    if targets and not any(t in served for t in targets):
        plan = {**plan, "faults": [], "kill_on_log": None, "exit_at_start": None}
    if plan.get("exit_at_start"):
        print(plan["exit_at_start"], flush=True)
        _record(plan, served=served, fault="exit_at_start")
        sys.exit(1)
    upstream_port = _free_port()
    if plan["upstream"] == "vllm":
        cmd = [plan["vllm"], "serve", *_with_option(argv, "--port", str(upstream_port))]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "standin", "--port",
               str(upstream_port), "--served-model-name", served]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proxy = Proxy(plan, served, port, upstream_port, server)
    threading.Thread(target=proxy.serve, daemon=True).start()
    reader = threading.Thread(target=_copy_log, args=(server, plan, served), daemon=True)
    reader.start()
    code = server.wait()  # its children (vLLM's engine) may live on, as after a real kill
    _log(f"server exited ({code})")
    if code < 0:  # end as the server did: killed by the same signal
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(5)
    sys.exit(code)


def _copy_log(server: subprocess.Popen[bytes], plan: dict[str, Any], served: str) -> None:
    """The server's output into this process's (qpipe's log); ``kill_on_log`` applied."""
    pattern = re.compile(plan["kill_on_log"]) if plan.get("kill_on_log") else None
    assert server.stdout is not None
    for raw in server.stdout:
        sys.stdout.buffer.write(raw)
        sys.stdout.flush()
        if pattern is not None and pattern.search(raw.decode(errors="replace")):
            _record(plan, served=served, fault="kill_on_log", line=raw.decode().strip()[:200])
            server.kill()
            pattern = None


class Proxy:
    """One request per connection, relayed to the server unless a fault matches it."""

    def __init__(self, plan: dict[str, Any], served: str, port: int, upstream: int,
                 server: subprocess.Popen[bytes]) -> None:
        self.plan, self.served, self.port, self.upstream = plan, served, port, upstream
        self.server = server
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def serve(self) -> None:
        # listen only once the server does: until then a client is refused, as by vLLM
        while self.server.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.upstream), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        if self.server.poll() is not None:
            return
        listener = socket.create_server(("127.0.0.1", self.port))
        _log(f"listening on {self.port}, relaying to {self.upstream}")
        while True:
            client, _ = listener.accept()
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _fault_for(self, method: str, path: str, head: bytes, body: bytes
                   ) -> dict[str, Any] | None:
        with self.lock:
            for number, fault in enumerate(self.plan.get("faults") or []):
                if fault.get("path", path) != path or fault.get("method", method) != method:
                    continue
                if fault.get("body") and fault["body"].encode() not in body:
                    continue
                agent = re.search(rb"(?im)^user-agent:\s*(.*?)\r?$", head)
                if fault.get("agent") and (agent is None or fault["agent"].encode()
                                           not in agent.group(1)):
                    continue
                key = f"{number}"
                self.counts[key] = self.counts.get(key, 0) + 1
                if fault.get("every") or self.counts[key] == fault.get("nth", 1):
                    return fault
        return None

    def _handle(self, client: socket.socket) -> None:
        try:
            self._answer(client)
        except Exception as err:  # a bug here must show in the log, not as a silent hang
            _log(f"proxy error: {type(err).__name__}: {err}")
            client.close()

    def _answer(self, client: socket.socket) -> None:
        try:
            head, body = _read_request(client)
        except OSError:
            client.close()
            return
        if not head:
            client.close()
            return
        method, path = head.split(b" ", 2)[:2]
        path_text = path.decode().split("?")[0]
        fault = self._fault_for(method.decode(), path_text, head, body)
        if self.plan.get("trace"):
            _log(f"{method.decode()} {path_text} {len(body)} bytes")
        if fault is not None:
            _record(self.plan, **{**fault, "served": self.served, "path": path_text})
            if fault["action"] == "kill" and fault.get("when", "request") == "request":
                self.server.kill()
                client.close()
                return
            if fault["action"] == "stall":
                time.sleep(fault.get("seconds", 3600))
                client.close()
                return
            if fault["action"] == "status":
                text = json.dumps({"error": {"message": "injected fault", "code": 500}}).encode()
                client.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: "
                               b"application/json\r\nContent-Length: " + str(len(text)).encode()
                               + b"\r\nConnection: close\r\n\r\n" + text)
                client.close()
                return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream), timeout=3600)
        except OSError:
            client.close()  # the server is gone: as a dead server, nothing answers
            return
        upstream.sendall(_closing(head) + body)
        self._relay(upstream, client, fault)

    def _relay(self, upstream: socket.socket, client: socket.socket,
               fault: dict[str, Any] | None) -> None:
        """The answer, with ``Connection: close`` (a client must not reuse the connection),
        cut where the fault says."""
        answer, head = b"", b""
        try:
            while True:
                chunk = upstream.recv(65536)
                if not chunk:
                    if head and fault is None:
                        return
                    break
                answer += chunk
                if not head:
                    end = answer.find(b"\r\n\r\n")
                    if end < 0:
                        continue
                    head, answer = _closing(answer[:end + 4]), answer[end + 4:]
                    if fault is not None and fault["action"] == "half-headers":
                        client.sendall(head[:len(head) // 2])
                        return
                    if fault is None:
                        client.sendall(head)
                if fault is None:
                    client.sendall(answer)
                    answer = b""
                    continue
                length = _content_length(head)
                if (length is not None and len(answer) < length) or not answer:
                    continue  # a whole body first, then half of it; a stream: its first event
                client.sendall(head + answer[:max(1, len(answer) // 2)])
                if fault["action"] == "kill":
                    self.server.kill()
                return
        except OSError:
            pass
        finally:
            upstream.close()
            client.close()


def _read_request(conn: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b"", b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = _content_length(head) or 0
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n", body


def _content_length(head: bytes) -> int | None:
    found = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    return int(found.group(1)) if found else None


def _closing(head: bytes) -> bytes:
    """The request head with ``Connection: close``: one request per connection."""
    lines = [ln for ln in head.rstrip(b"\r\n").split(b"\r\n")
             if not ln.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


# --- a stand-in server, for tests without vLLM ----------------------------------------------------
METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",enable_prefix_caching="False",\
num_gpu_blocks="364",kv_cache_size_tokens="46592",kv_cache_memory_bytes="1073741824",\
kv_cache_max_concurrency="22.75"} 1.0
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="%(name)s"} 0.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="%(name)s"} 0.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="%(name)s"} 0.0
"""


def standin(argv: list[str]) -> None:
    """A server with vLLM's endpoints that qpipe itself calls: /health, /v1/models,
    /v1/completions (one token per request) and /metrics (as long as vLLM's: ~50 kB)."""
    port = int(_option(argv, "--port"))
    name = _option(argv, "--served-model-name", "standin")
    padding = "".join(f"# padding line {i:05d} as long as a histogram bucket of vLLM's\n"
                      for i in range(800))
    metrics = (METRICS % {"name": name} + padding).encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/metrics":
                self._send(200, metrics, "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": name}]}).encode())
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            answer = {"choices": [{"text": " Paris", "index": 0}],
                      "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
            self._send(200, json.dumps(answer).encode())

        def log_message(self, *args: Any) -> None:
            pass

    print(f"INFO standin: Starting vLLM API server on http://127.0.0.1:{port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "launch":
        launch(rest[1:] if rest[:1] == ["serve"] else rest)
    elif command == "standin":
        standin(rest)
    else:
        sys.exit(f"unknown command {command!r}")
