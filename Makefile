# qpipe: every target sets up what it needs by itself (stamp files under .stamps/,
# re-made when the pinned requirements change). Every default below is overridable:
#   make quantize RECIPE=int4 BASELINE=/models/my-llama CALIB_SAMPLES=256 FORCE=1
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON        ?= python3
VENV          ?= .venv
SERVE_VENV    ?= .venv-serve
SERVE_TARGET  ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ARTIFACTS     ?= artifacts
BASELINE      ?= smollm2-135m-instruct
RECIPE        ?=
FORCE         ?=
CALIB_SAMPLES ?=
CALIB_SEQ_LEN ?=
CALIB_DATA    ?=
PYTEST_ARGS   ?=
# pytest-xdist workers for make test / test-fast (0: in this process, e.g. for --pdb)
TEST_JOBS     ?= 2
# bench / eval
WORKLOAD      ?=
SUITE         ?=
BACKEND       ?=
THRESHOLD     ?=
GATE_LEVEL    ?=
LIMIT         ?=
REPEATS       ?=
MAX_MODEL_LEN ?=
KV_CACHE_GIB  ?=
GPU_UTIL      ?=
# vLLM tensor / pipeline parallel size of every server (GPUs each spans), and of make plan
TP            ?=
PP            ?=
# any other `vllm serve` flag for every server bench and eval start, e.g. VLLM_ARGS=--enable-expert-parallel
VLLM_ARGS     ?=
MLFLOW_PORT   ?= 5000
# avx2: vLLM CPU loads its AVX2 kernels whatever this CPU has (what an AVX2-only machine serves)
VLLM_CPU_ISA  ?=
# make all / compare: a campaign file in configs/campaigns/ (QUICK=1: the quick one)
QUICK         ?=
CAMPAIGN      ?= $(if $(QUICK),quick,default)
# where make all runs its tasks: local (this machine) | ray (a Ray cluster: RAY_ADDRESS=, else a
# local Ray instance over this node's GPUs); RAY_RESOURCES='{"h100": 1}' pins each task's node type
EXECUTOR      ?=
RAY_ADDRESS   ?=
RAY_RESOURCES ?=
# where make all / compare plan each variant (default: the campaign file's plan:)
PLAN_GPU      ?=
PLAN_CONTEXT  ?=
# what the recommendation optimises: speed (default) | memory | capacity | cost
OBJECTIVE     ?=
# the capacity search's latency objective (default: the capacity workload's slo, in ms)
SLO_TTFT_MS   ?=
SLO_ITL_MS    ?=
# the unquantized serving every speedup is against: auto (float32 probed against bf16 on a CPU
# without native bf16) or a dtype (bfloat16, float32: not probed)
REFERENCE     ?=
# cost: USD per device-hour, times the devices (TP x PP GPUs, or the host) of the run that
# measured each capacity (default: the campaign's cost: block), and a target load to size for
# (concurrent users or requests per second)
PRICE_PER_DEVICE_HOUR ?=
ifneq ($(PRICE_PER_HOUR),)
$(error PRICE_PER_HOUR= is now PRICE_PER_DEVICE_HOUR=: USD per device-hour, multiplied by the TP x PP GPUs of the run that measured each capacity)
endif
TARGET_USERS  ?=
TARGET_RPS    ?=
# precision search: the machine the recipe is for (an accelerator preset, cpu-avx2, cpu-avx512;
# default: this one), the menu (default: every format vLLM serves there, and bf16), the held-out
# tokens each unit is scored on, and the budget (130MB | 0.45 | 45% | 1.15xint4) or MAX_DAMAGE,
# and/or a speed budget SPEEDUP=1.2 (from the uniform variants' measured speedups); REFINE=1;
# METHOD=gptq quantizes the searched recipe by GPTQ (default rtn: the scan's own method)
TARGET        ?=
FORMATS       ?=
SCAN_TOKENS   ?=
BUDGET        ?=
SPEEDUP       ?=
MAX_DAMAGE    ?=
NAME          ?=
REFINE        ?=
METHOD        ?=
# planner (empty: qpipe plan's defaults, `qpipe plan --help`: the embedded model's config on an
# h100-80gb at 8,192 tokens, bf16 weights and KV cache; MAX_CONTEXT: the model's maximum)
MODEL         ?=
GPU           ?=
CONTEXT       ?=
MAX_CONTEXT   ?=
WEIGHTS       ?=
KV_DTYPE      ?=
MEMORY_GB     ?=
KV_BUDGET_GB  ?=
PREFIX        ?=
PLOT          ?=
JSON          ?=

export QPIPE_ARTIFACTS := $(abspath $(ARTIFACTS))
export PYTHON VENV SERVE_VENV SERVE_TARGET TORCH_CPU_INDEX
export QPIPE_SERVE_PYTHON := $(abspath $(SERVE_VENV))/bin/python
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION := false
ifneq ($(VLLM_CPU_ISA),)
export QPIPE_VLLM_CPU_ISA := $(VLLM_CPU_ISA)
endif

QPIPE := $(VENV)/bin/qpipe
ALL_RECIPES := $(basename $(notdir $(wildcard recipes/*.yaml)))
PIPELINE_STAMP := .stamps/pipeline
RAY_STAMP := .stamps/ray
# one stamp per serving target: a checkout first set up on a CPU host gets vllm, not vllm-cpu,
# on a GPU host
SERVE_KIND := $(shell SERVE_TARGET=$(SERVE_TARGET) scripts/setup.sh target)
SERVE_STAMP := .stamps/serve-$(SERVE_KIND)
# one .venv-serve, one stamp per target: a stamp is current only while the environment holds
# that target's vLLM (after `SERVE_TARGET=cpu` on a GPU host, serve-cuda would otherwise look
# current beside vllm-cpu)
ifneq ($(shell cat $(SERVE_VENV)/.qpipe-serve-target 2>/dev/null),$(SERVE_KIND))
.PHONY: $(SERVE_STAMP)
endif

# `$(call opt,--flag,$(VAR))`: the flag and its value where VAR is set, nothing where it is
# empty (the command's own default then applies)
opt = $(if $(2),$(1) $(2))
# the vLLM engine, the same for every server bench and eval start
ENGINE_OPTS = $(call opt,--max-model-len,$(MAX_MODEL_LEN)) $(call opt,--kv-cache-gib,$(KV_CACHE_GIB)) \
  $(call opt,--gpu-memory-utilization,$(GPU_UTIL)) $(call opt,--tp,$(TP)) $(call opt,--pp,$(PP)) \
  $(foreach a,$(VLLM_ARGS),--vllm-arg=$(a))
SLO_OPTS = $(call opt,--slo-ttft-ms,$(SLO_TTFT_MS)) $(call opt,--slo-itl-ms,$(SLO_ITL_MS)) \
  $(call opt,--reference,$(REFERENCE))
COST_OPTS = $(call opt,--price-per-device-hour,$(PRICE_PER_DEVICE_HOUR)) \
  $(call opt,--target-users,$(TARGET_USERS)) $(call opt,--target-rps,$(TARGET_RPS))

.PHONY: help all compare setup doctor quantize recipes baseline bench eval gate suites plan ui test test-fast test-repeat lint clean sensitivity search calibrate

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "  variables: RECIPE BASELINE FORCE=1 ARTIFACTS QUICK=1 CAMPAIGN WORKLOAD REPEATS SUITE LIMIT"
	@echo "             BACKEND THRESHOLD GATE_LEVEL PLAN_GPU PLAN_CONTEXT OBJECTIVE QUANTIZE_JOBS CALIB_SAMPLES"
	@echo "             SLO_TTFT_MS SLO_ITL_MS PRICE_PER_DEVICE_HOUR TARGET_USERS TARGET_RPS"
	@echo "             FORMATS SCAN_TOKENS BUDGET MAX_DAMAGE SPEEDUP NAME REFINE=1 METHOD (sensitivity, search)"
	@echo "             EXECUTOR=ray RAY_ADDRESS RAY_RESOURCES (make all on a Ray cluster)"
	@echo "             CALIB_SEQ_LEN CALIB_DATA MAX_MODEL_LEN KV_CACHE_GIB GPU_UTIL TP PP VLLM_ARGS"
	@echo "             VLLM_CPU_ISA=avx2 (serve with vLLM CPU's AVX2 kernels on any x86 CPU)"
	@echo "             RUNS FAST=1 (calibrate: draws per scenario, the fast subset)"
	@echo "             N TESTS (test-repeat: runs, the tests; PYTEST_ARGS= adds to each)"

$(PIPELINE_STAMP): requirements/pipeline.txt requirements/embedded.txt pyproject.toml scripts/setup.sh
	@scripts/setup.sh pipeline
	@mkdir -p $(@D) && touch $@

$(RAY_STAMP): $(PIPELINE_STAMP) requirements/ray.txt
	@scripts/setup.sh ray
	@mkdir -p $(@D) && touch $@

$(SERVE_STAMP): requirements/serve-cpu.txt requirements/serve-cuda.txt scripts/setup.sh
	@scripts/setup.sh serve
	@mkdir -p $(@D) && touch $@

all: $(PIPELINE_STAMP) $(SERVE_STAMP) $(if $(filter ray,$(EXECUTOR)),$(RAY_STAMP)) ## quantize every recipe, bench, eval, compare (QUICK=1: a first look)
	@$(QPIPE) campaign --baseline $(BASELINE) --campaign $(CAMPAIGN) \
	  $(foreach r,$(RECIPE),--recipe $(r)) $(foreach w,$(WORKLOAD),--workload $(w)) \
	  $(foreach s,$(SUITE),--suite $(s)) $(call opt,--limit,$(LIMIT)) \
	  $(call opt,--repeats,$(REPEATS)) $(call opt,--gpu,$(PLAN_GPU)) \
	  $(call opt,--context,$(PLAN_CONTEXT)) $(if $(FORCE),--force) \
	  $(call opt,--quantize-jobs,$(QUANTIZE_JOBS)) $(call opt,--objective,$(OBJECTIVE)) \
	  $(ENGINE_OPTS) $(SLO_OPTS) $(COST_OPTS) \
	  $(call opt,--calib-samples,$(CALIB_SAMPLES)) $(call opt,--calib-seq-len,$(CALIB_SEQ_LEN)) \
	  $(call opt,--calib-data,$(CALIB_DATA)) $(call opt,--executor,$(EXECUTOR)) \
	  $(call opt,--threshold,$(THRESHOLD)) \
	  $(call opt,--ray-address,$(RAY_ADDRESS)) $(if $(RAY_RESOURCES),--ray-resources '$(RAY_RESOURCES)')

compare: $(PIPELINE_STAMP) ## rebuild the comparison, report and MLflow campaign run from what is measured
	@$(QPIPE) compare --baseline $(BASELINE) --campaign $(CAMPAIGN) \
	  $(foreach r,$(RECIPE),--recipe $(r)) $(call opt,--gpu,$(PLAN_GPU)) \
	  $(call opt,--context,$(PLAN_CONTEXT)) $(call opt,--objective,$(OBJECTIVE)) $(COST_OPTS) \
	  $(call opt,--threshold,$(THRESHOLD))

setup: $(PIPELINE_STAMP) $(SERVE_STAMP) ## create both environments (pipeline and vLLM serving)

doctor: $(PIPELINE_STAMP) $(SERVE_STAMP) ## this machine (CPU ISA, GPU, vLLM build) and the formats it serves, and why
	@$(QPIPE) doctor

baseline: $(PIPELINE_STAMP) ## resolve the baseline (converts the embedded GGUF model once)
	@$(QPIPE) baseline --baseline $(BASELINE)

recipes: $(PIPELINE_STAMP) ## list and validate the recipes
	@$(QPIPE) recipes

# One process per recipe: peak memory is measured per variant, and llmcompressor's
# session state starts fresh each time.
quantize: $(PIPELINE_STAMP) ## quantize the baseline: RECIPE=int4|awq|fp8|... (default: every recipe in recipes/)
	@for recipe in $(or $(RECIPE),$(ALL_RECIPES)); do \
	  $(QPIPE) quantize --baseline $(BASELINE) --recipe $$recipe $(if $(FORCE),--force) \
	    $(call opt,--calib-samples,$(CALIB_SAMPLES)) $(call opt,--calib-seq-len,$(CALIB_SEQ_LEN)) \
	    $(call opt,--calib-data,$(CALIB_DATA)) || exit $$?; \
	done

bench: $(PIPELINE_STAMP) $(SERVE_STAMP) ## serve + load-test: RECIPE=fp8 (default: baseline and every variant on disk)
	@$(QPIPE) bench --baseline $(BASELINE) $(foreach r,$(RECIPE),--recipe $(r)) \
	  $(foreach w,$(WORKLOAD),--workload $(w)) $(call opt,--repeats,$(REPEATS)) \
	  $(if $(FORCE),--force) $(ENGINE_OPTS) $(SLO_OPTS)

eval: $(PIPELINE_STAMP) $(SERVE_STAMP) ## lm-eval scores and recovery: RECIPE=int4 SUITE=app LIMIT=
	@$(QPIPE) eval --baseline $(BASELINE) $(foreach r,$(RECIPE),--recipe $(r)) \
	  $(foreach s,$(SUITE),--suite $(s)) $(call opt,--limit,$(LIMIT)) \
	  $(call opt,--backend,$(BACKEND)) $(if $(FORCE),--force) $(ENGINE_OPTS)

gate: $(PIPELINE_STAMP) ## exit non-zero if a variant's recovery is below its recipe's threshold
	@$(QPIPE) gate --baseline $(BASELINE) $(foreach r,$(RECIPE),--recipe $(r)) \
	  $(call opt,--threshold,$(THRESHOLD)) $(call opt,--level,$(GATE_LEVEL))

SCAN_OPTS = $(foreach f,$(FORMATS),--format $(f)) $(call opt,--scan-tokens,$(SCAN_TOKENS)) \
  $(call opt,--target,$(TARGET))

# the fusions are read from vLLM (serving environment); the menu from what it serves on TARGET
sensitivity: $(PIPELINE_STAMP) $(SERVE_STAMP) ## damage of each unit quantized alone, per format: table, heat-map, MLflow
	@$(QPIPE) sensitivity --baseline $(BASELINE) $(SCAN_OPTS) $(if $(FORCE),--force)

search: $(PIPELINE_STAMP) $(SERVE_STAMP) ## a mixed-precision recipe: BUDGET=1.15xint4 (or MAX_DAMAGE=) -> recipes/searched-*.yaml
	@$(QPIPE) search --baseline $(BASELINE) $(SCAN_OPTS) $(call opt,--budget,$(BUDGET)) \
	  $(call opt,--max-damage,$(MAX_DAMAGE)) $(call opt,--speedup,$(SPEEDUP)) \
	  $(call opt,--name,$(NAME)) $(call opt,--threshold,$(THRESHOLD)) $(if $(REFINE),--refine) \
	  $(call opt,--method,$(METHOD))

# how often each verdict is wrong, simulated against a known truth (RUNS= draws, FAST=1 subset)
RUNS          ?=
FAST          ?=
calibrate: $(PIPELINE_STAMP) ## error rates of every verdict, measured by simulation: table + artifacts/calibration/
	@$(QPIPE) calibrate $(call opt,--runs,$(RUNS)) $(if $(FAST),--fast)

suites: $(PIPELINE_STAMP) ## list the task suites in evals/ and validate them
	@$(QPIPE) suites

plan: $(PIPELINE_STAMP) ## capacity plan: MODEL GPU CONTEXT MAX_CONTEXT WEIGHTS KV_DTYPE [JSON=1 PLOT=f.png]
	@$(QPIPE) plan $(call opt,--model,$(MODEL)) $(call opt,--gpu,$(GPU)) \
	  $(call opt,--context,$(CONTEXT)) $(call opt,--weights,$(WEIGHTS)) \
	  $(call opt,--kv-dtype,$(KV_DTYPE)) $(call opt,--max-context,$(MAX_CONTEXT)) \
	  $(call opt,--memory-gb,$(MEMORY_GB)) $(call opt,--kv-budget-gb,$(KV_BUDGET_GB)) \
	  $(call opt,--prefix,$(PREFIX)) $(call opt,--plot,$(PLOT)) $(if $(JSON),--json) \
	  $(call opt,--tp,$(TP)) $(call opt,--pp,$(PP))

ui: $(PIPELINE_STAMP) ## the MLflow UI on http://127.0.0.1:$(MLFLOW_PORT) (Ctrl-C stops it)
	@$(QPIPE) ui --port $(MLFLOW_PORT)

test: $(PIPELINE_STAMP) $(SERVE_STAMP) $(RAY_STAMP) lint ## everything: unit, end-to-end on a tiny model, embedded model (what CI runs)
	@# PYTEST_ARGS=-k ... may select nothing (pytest's exit 5)
	@$(VENV)/bin/python -m pytest -n $(TEST_JOBS) --dist loadgroup $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-fast: $(PIPELINE_STAMP) lint ## unit tests only (under 3 minutes): no model, no server, no service
	@$(VENV)/bin/python -m pytest -n $(TEST_JOBS) --dist loadgroup \
	  -m "not slow and not serve and not embedded and not services" $(PYTEST_ARGS)

# make test-repeat N=5: the tests most exposed to timing (faults, services, servers, processes)
# N times, each a fresh pytest session on TEST_JOBS workers, and how many of the N passed;
# TESTS= picks others (TESTS=tests: the whole suite), PYTEST_ARGS= adds to each run
N             ?= 3
TESTS         ?= tests/test_faults.py tests/test_bench_faults.py tests/test_services.py \
  tests/test_serve.py tests/test_procs.py tests/test_jobs.py tests/test_ui.py tests/test_too_slow.py
test-repeat: $(PIPELINE_STAMP) $(SERVE_STAMP) ## TESTS N times in a row (N=3): how often they pass, to see flakiness before it lands
	@passed=0; failed=""; for i in $$(seq 1 $(N)); do \
	  echo "[test-repeat] run $$i of $(N): $(TESTS) $(PYTEST_ARGS)"; \
	  if $(VENV)/bin/python -m pytest -n $(TEST_JOBS) --dist loadgroup -p no:cacheprovider \
	      $(TESTS) $(PYTEST_ARGS); then passed=$$((passed + 1)); else failed="$$failed $$i"; fi; \
	done; \
	echo "[test-repeat] $$passed of $(N) runs passed$${failed:+ (failed:$$failed)}"; \
	[ $$passed -eq $(N) ]

lint: $(PIPELINE_STAMP) ## ruff, and the layer contract (no stage imports one above it)
	@$(VENV)/bin/ruff check pipeline tests scripts
	@$(VENV)/bin/lint-imports

clean: ## remove generated artifacts (keeps the environments and mlflow.db)
	rm -rf $(ARTIFACTS)
