# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# What `pip install` gets for torch: exactly this requirement, from TORCH_INDEX if set. A plain
# `torch==2.13.0` from PyPI is the CUDA build on Linux x86-64 (the CPU build on machines whose
# index or wheel cache offers only that, as this project's CI machine); for the CPU build on
# any Linux machine: make TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
# The extra `make test-gpu` installs: gpu (CUDA 12) or gpu-cu13 (CUDA 13).
GPU_EXTRA ?= gpu

.PHONY: install test test-gpu gpu-check gpu-bundle lint demo bench clean FORCE

# The install is redone when TORCH_SPEC or TORCH_INDEX changes (the stamp depends on a file
# holding them).
$(VENV)/torch-spec: FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC) $(TORCH_INDEX)' | cmp -s - $@ || echo '$(TORCH_SPEC) $(TORCH_INDEX)' > $@

# torch alone, reinstalled whenever TORCH_SPEC changes (pip keeps an installed 2.13.0+cpu for
# a plain torch==2.13.0 otherwise, whatever the index).
$(VENV)/.torch: $(VENV)/torch-spec
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --force-reinstall '$(TORCH_SPEC)' $(if $(TORCH_INDEX),--index-url '$(TORCH_INDEX)')
	touch $@

$(BIN)/.installed: pyproject.toml Makefile $(VENV)/.torch
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/.installed

lint: install
	$(BIN)/ruff check elastic cli tests examples scripts

test: lint
	$(BIN)/pytest

# The GPU tier (tests/gpu, marked `gpu`) on a machine with a GPU and a CUDA build of torch:
# installs the gpu extra (GPU_EXTRA=gpu-cu13 for CUDA 13) and fails when no GPU test ran
# (all skipped: no CUDA device, or a CPU build of torch).
test-gpu: lint
	$(BIN)/pip install -q -e '.[$(GPU_EXTRA)]'
	$(BIN)/pytest -m gpu --junitxml=$(VENV)/gpu-tier.xml
	$(BIN)/python scripts/junit_ran.py $(VENV)/gpu-tier.xml

# The GPU checks in minutes on a GPU machine without network, with its own Python (the GPU
# tier, 4 workers sharing the GPU through kills, throughput and the step against plain
# PyTorch, the data and allreduce benches on its CPUs; a summary table): see
# scripts/gpu_check.sh. Ray and pydantic come from .gpu/bundle.tar.xz (make gpu-bundle, on a
# machine with network) when that Python lacks them.
gpu-check:
	bash scripts/gpu_check.sh

gpu-bundle:
	bash scripts/gpu_bundle.sh .gpu

# Digits MLP on 4 workers, worker 1 SIGKILLed part-way, next to an uninterrupted run.
demo: install
	$(BIN)/elastic demo --run-dir runs/demo
	$(BIN)/elastic report runs/demo/elastic

clean:
	rm -rf $(VENV) bench-out
