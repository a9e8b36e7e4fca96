#!/usr/bin/env bash
# The GPU path, checked. Two modes (docs/gpu-smoke.md says what each has verified, and when):
#
#   scripts/gpu_smoke.sh --offline [OUT]   # no vLLM, no registry (the lent H200), or here on the
#                                          # CPU as its stand-in: quantize every recipe, score
#                                          # emulated (lm-eval hf), scan + search + the searched
#                                          # mix, the planner for the card found; ~8 min on the
#                                          # H200, under 10 here. Results: OUT/offline.json; last
#                                          # line: the wheels it needs carried and their total.
#   scripts/gpu_smoke.sh [OUT]             # connected: a GPU host with the registries. vLLM's
#                                          # part, short: baseline + fp8 + int4 served, one load
#                                          # point, one repeat, 20 items a task, a bounded
#                                          # capacity search; checks read vLLM's own log.
#
# Every step runs whatever an earlier one did (no `set -e`): each check says PASS or FAIL, and
# the script exits 1 if any failed. Offline, wheels in .whl/ (scripts/gpu_offline.py carry
# fetches them where pip reaches an index) are installed first when the packages are missing.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=connected
if [ "${1:-}" = --offline ]; then MODE=offline; shift; fi
OUT=${1:-${OUT:-gpu-smoke-out}}
mkdir -p "$OUT"
start=$(date +%s)
step() { printf '\n[gpu-smoke] %s (%s s)\n' "$*" "$(( $(date +%s) - start ))"; }
failed=0

if [ "$MODE" = offline ]; then
  PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  if ! "$PY" -c "import llmcompressor, lm_eval, mlflow" 2>/dev/null; then
    step "installing the carried wheels (.whl/) into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || failed=1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  step "offline checks on $("$PY" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "the CPU (stand-in)")')"
  "$PY" scripts/gpu_offline.py run "$OUT" || failed=1
  step "done ($( [ $failed = 0 ] && echo all passed || echo FAILED))"
  "$PY" scripts/gpu_offline.py carry | tee "$OUT/carry.txt" | tail -n 1
  exit $failed
fi

export SERVE_TARGET=${SERVE_TARGET:-auto}
export QPIPE_ARTIFACTS=${ARTIFACTS:-$PWD/$OUT/artifacts}
RECIPES=${RECIPES:-fp8 int4}
run() { step "$1"; shift; "$@" 2>&1 | tee -a "$OUT/smoke.log" || failed=1; }
run "setup: vllm for CUDA, torch must see the GPU in both environments" make setup
[ "$(scripts/setup.sh target)" = cuda ] || { echo "[gpu-smoke] no GPU visible to nvidia-smi" >&2; exit 1; }
run "doctor: the card, its compute capability, the formats it serves" make doctor
run "quantize on the GPU" make quantize RECIPE="$RECIPES"
run "bench: one load point, one repeat" make bench RECIPE="$RECIPES" WORKLOAD=quick REPEATS=1
run "bench: the capacity search at the GPU objective (up to 512 users)" \
  make bench RECIPE="$RECIPES" WORKLOAD=capacity-gpu
run "eval: the app suite, 20 items a task, served on the GPU" \
  make eval RECIPE="$RECIPES" SUITE=app LIMIT=20
run "compare: planned for this card, cost at the card's preset price" \
  make compare RECIPE="$RECIPES" OBJECTIVE=cost
step "checks: from vLLM's own log lines and the run's records, found by key"
.venv/bin/python scripts/gpu_checks.py --recipes "$RECIPES" | tee "$OUT/checks.txt" || failed=1
echo "[gpu-smoke] done in $(( $(date +%s) - start )) s$( [ $failed = 0 ] || echo ': FAILED')"
exit $failed
