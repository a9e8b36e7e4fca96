"""Which layers vLLM runs as one GEMM (and so must share a quantization format), read from
vLLM itself: the model class's ``packed_modules_mapping`` (e.g. Llama: ``qkv_proj`` = q, k, v;
``gate_up_proj`` = gate, up). Asked once per architecture and vLLM version, then cached."""

from __future__ import annotations

import json
import subprocess

from pipeline.core import paths
from pipeline.core.errors import ConfigError
from pipeline.core.fsutil import read_json, write_json_atomic
from pipeline.core.provenance import serve_python, vllm_version
from pipeline.serve.server import WORKERS_DIR


def packed_modules(architecture: str) -> tuple[dict[str, list[str]], str]:
    """(fused name -> member leaf names, where that came from) for ``architecture``."""
    version = vllm_version()
    cache = paths.artifacts_dir() / "cache" / "fusions" / f"{architecture}-vllm{version}.json"
    source = f"vLLM {version}: {architecture}.packed_modules_mapping"
    if cache.is_file():
        return read_json(cache)["packed"], source
    python = serve_python()
    if not python.exists():
        raise ConfigError(
            f"the layers vLLM fuses are read from vLLM itself, and the serving environment "
            f"({python}) is missing. Fix: `make setup` (or `scripts/setup.sh serve`).")
    try:
        out = subprocess.run([str(python), str(WORKERS_DIR / "vllm_packed_modules.py"),
                              architecture], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as err:
        raise ConfigError(f"could not ask vLLM ({python}) which layers it fuses for "
                          f"{architecture}: {err}") from None
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    answer = json.loads(lines[-1]) if lines else {
        "error": (out.stderr.strip().splitlines() or ["no answer"])[-1]}
    if "error" in answer:
        raise ConfigError(f"vLLM {version} cannot tell which layers of {architecture} it fuses: "
                          f"{answer['error']}. A model vLLM cannot load cannot be searched for "
                          "serving in vLLM.")
    write_json_atomic(cache, answer)
    return answer["packed"], source
