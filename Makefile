# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# CI and this dev box use the CPU build of torch; GPU users may override, e.g.
# `make test TORCH_SPEC=torch==2.13.0+cu128`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test test-gpu lint demo bench clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/.installed

lint: install
	$(BIN)/ruff check elastic cli tests examples

test: lint
	$(BIN)/pytest

# The GPU tier (tests/gpu, marked `gpu`; skipped without CUDA): run it on a machine with a GPU
# and a CUDA build of torch, e.g. `make test-gpu TORCH_SPEC=torch==2.13.0+cu128`; the fit tests
# need backend 'nccl' too (pip install -e '.[gpu]'), those for two GPUs skip with fewer.
test-gpu: lint
	$(BIN)/pytest -m gpu

# Digits MLP on 4 workers, worker 1 SIGKILLed part-way, next to an uninterrupted run.
demo: install
	$(BIN)/elastic demo --run-dir runs/demo
	$(BIN)/elastic report runs/demo/elastic

clean:
	rm -rf $(VENV) bench-out
