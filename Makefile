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

.PHONY: setup repro test test-all serve report bench loadtest train-ddp train-zero2 train-zero3 clean help

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

test-all: setup
	python -m pytest $(PYTEST_ARGS)

serve: setup
	AGENTRL_MODEL_PATH=$(MODEL) uvicorn agentrl.serve:app --host $(HOST) --port $(PORT)

loadtest: setup
	python scripts/loadtest.py --model $(MODEL)

report: setup
	python -m agentrl.report

train-ddp train-zero2 train-zero3: setup
	python scripts/train_distributed.py --config configs/accelerate/$(subst train-,,$@).yaml --nproc $(NPROC)

clean:
	rm -rf data/prepared models checkpoints eval metrics dvclive runs wandb reports
