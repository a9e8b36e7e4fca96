"""vLLM's own benchmark client (``vllm bench serve``), kept loaded in one process.

Each :meth:`BenchClient.run` is exactly ``vllm bench serve ARGS`` (vLLM's own parser and
``main``, in ``serve/workers/vllm_bench_worker.py``); only the import of vLLM is shared between
runs. A client that hangs or dies is replaced before the next run.
"""

from __future__ import annotations

import json
import select
import subprocess
from pathlib import Path
from typing import Any

from pipeline.bench.workloads import Workload
from pipeline.core import procs
from pipeline.core.fsutil import read_json
from pipeline.core.provenance import serve_python
from pipeline.core.variant import Variant
from pipeline.serve import ServeError, VllmServer
from pipeline.serve.server import WORKERS_DIR

CLIENT_TIMEOUT_S = 1800


class BenchClient:
    """Started at once, ready at its first run: its import of vLLM (~8 s on 2 cores) overlaps
    the servers' loading."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        self.proc: subprocess.Popen[str] | None = None
        self._ready = False
        self._start()

    def _start(self) -> None:
        self.proc = procs.start([str(serve_python()), str(WORKERS_DIR / "vllm_bench_worker.py")],
                                log=self.log, env=self.env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, die_with_parent=True)
        self._ready = False

    def __enter__(self) -> BenchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        procs.stop(self.proc, timeout=5)

    def _answer(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            self.close()
            raise ServeError("vLLM's benchmark client " + (
                f"exited (code {code})" if code is not None else f"gave no answer in {timeout} s")
                + f"; see {self.log}.")
        return json.loads(line)

    def run(self, argv: list[str], log: Path, timeout: float = CLIENT_TIMEOUT_S) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        if not self._ready:
            self._answer(timeout=300)  # {"ready": true} once vLLM is imported
            self._ready = True
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(timeout)
        if not answer.get("ok"):
            raise ServeError(f"vllm bench serve failed: {answer.get('error')}. Log: {log}")


def has_chat_template(model_dir: Path) -> bool:
    """Whether the tokenizer in ``model_dir`` has a chat template (a base model has none)."""
    if any((model_dir / name).is_file() for name in ("chat_template.jinja",
                                                      "chat_template.json")):
        return True
    return bool(read_json(model_dir / "tokenizer_config.json").get("chat_template"))


def client_argv(server: VllmServer, variant: Variant, workload: Workload, concurrency: int,
                out_dir: Path, tag: str, repeat: int = 0) -> list[str]:
    """The ``vllm bench serve`` arguments for one load point (docs/bench.md: by hand).
    A prompt file goes through the model's chat template, as a chat request would; a model
    without one (a base model) gets the prompts as they are."""
    skip = ["--skip-chat-template"] if workload.dataset == "custom" and not has_chat_template(
        variant.path) else []
    return ["--backend", "vllm", "--base-url", server.base_url, "--endpoint", "/v1/completions",
            "--model", server.served_name, "--tokenizer", str(variant.path),
            *workload.client_args(concurrency, repeat), *skip, "--save-result", "--result-dir",
            str(out_dir), "--result-filename", f"{tag}.json", "--disable-tqdm"]


def run_client(client: BenchClient, server: VllmServer, variant: Variant, workload: Workload,
               concurrency: int, out_dir: Path, tag: str, repeat: int = 0,
               phase: str = "a load point") -> dict[str, Any]:
    """One load point against ``server``; returns vLLM's saved result JSON. A failure names
    ``phase`` (the step); a server that died during it is the better explanation."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / f"{tag}.log"
    during = f"{phase} (vllm bench serve)"
    try:
        client.run(client_argv(server, variant, workload, concurrency, out_dir, tag, repeat), log)
    except ServeError as err:  # the client failed: a server that went down is why
        if server.going_down():
            raise server.died(during) from None
        raise ServeError(f"{err} (during {during}, against {variant.name})",
                         reason=f"the benchmark client failed during {during}: {err.reason}"
                         ) from None
    server.check_alive(during)
    result = read_json(out_dir / f"{tag}.json")
    if result.get("failed"):
        errors = [e for e in result.get("errors") or [] if e]
        first = f" (the first: {str(errors[0]).strip()[:200]})" if errors else ""
        # requests fail at once when the server goes down: its death is the explanation
        raise server.lost(during, f"{result['failed']} of {result['num_prompts']} requests "
                                  f"failed{first}; client log: {log}")
    return result
