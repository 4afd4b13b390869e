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
PORT ?= 8000
HOST ?= 127.0.0.1
MODEL ?= models/merged
NPROC ?= 2
PYTEST_ARGS ?=

.PHONY: setup repro test test-slow test-all serve report wandb-report bench loadtest train-ddp train-zero2 train-zero3 \
	train-zero3-offload train-multinode sweep-grid sweep-random sweep-optuna clean help

help:
	@echo "make repro   - install pinned deps into $(VENV) and run the DVC pipeline (dvc repro)"
	@echo "make test    - install pinned deps and run the test suite"
	@echo "make serve   - serve models/merged with FastAPI (PORT=$(PORT), MODEL=$(MODEL))"

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.setup-*
	@touch $@
	@echo "set-up done ($(STAMP))"

repro: setup
	dvc repro

test: setup
	python -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: setup
	python -m pytest -m slow $(PYTEST_ARGS)

test-all: setup
	python -m pytest $(PYTEST_ARGS)

serve: setup
	AGENTRL_MODEL_PATH=$(MODEL) uvicorn agentrl.serve:app --host $(HOST) --port $(PORT)

loadtest: setup
	python scripts/loadtest.py --model $(MODEL)

report: setup
	python -m agentrl.report

# The same panels as a W&B Report (online: needs WANDB_API_KEY; GROUP=<run group> narrows it).
wandb-report: setup
	python scripts/wandb_report.py $(if $(GROUP),--group $(GROUP))

# Run the pipeline (sft and grpo under `accelerate launch`, then evaluation) with NPROC processes.
# A workspace `dvc exp run`: the chosen config is recorded in params.yaml and the experiment.
train-ddp: ACCEL = ddp
train-zero2: ACCEL = zero2
train-zero3: ACCEL = zero3
train-zero3-offload: ACCEL = zero3_offload
train-ddp train-zero2 train-zero3 train-zero3-offload: setup
	dvc exp run -S distributed.accelerate_config=configs/accelerate/$(ACCEL).yaml \
	  -S distributed.num_processes=$(NPROC) $(DVC_EXP_ARGS)

# Multi-node: run on every node with its MACHINE_RANK; MAIN_IP/MAIN_PORT name rank 0's address.
MACHINE_RANK ?= 0
NUM_MACHINES ?= 2
MAIN_IP ?= 127.0.0.1
MAIN_PORT ?= 29500
STAGE ?= sft
train-multinode: setup
	accelerate launch --config_file configs/accelerate/multi_node.yaml --num_machines $(NUM_MACHINES) \
	  --num_processes $(NPROC) --machine_rank $(MACHINE_RANK) --main_process_ip $(MAIN_IP) \
	  --main_process_port $(MAIN_PORT) -m agentrl.$(STAGE)

clean:
	rm -rf data/prepared models checkpoints eval metrics dvclive runs wandb reports

# Hyperparameter sweeps over `dvc exp` (search spaces in configs/sweeps/). SPACE, JOBS, N, TRIALS.
SPACE ?= configs/sweeps/grpo.yaml
JOBS ?= 1
N ?= 10
TRIALS ?= 20
sweep-grid: setup
	python scripts/sweep.py grid --space $(SPACE) --jobs $(JOBS)
sweep-random: setup
	python scripts/sweep.py random --space $(SPACE) -n $(N) --jobs $(JOBS)
sweep-optuna: setup
	python scripts/sweep.py optuna --space $(SPACE) --trials $(TRIALS)

bench: setup
	python scripts/bench.py
