# `make test` is the one command: it builds .venv/ from nothing when needed,
# then runs the type gate, the lint gate (ruff, complexity included) and the test suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.cpslice-installed
TORCH  := torch==2.13.0
# The index torch comes from. Empty: pip's own configuration (an index or --find-links that
# serves the CPU wheel, as on a machine with a local mirror). Elsewhere pip's default index
# serves the CUDA build (gigabytes): `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_INDEX ?=
PIP    := $(BIN)/python -m pip install -q --disable-pip-version-check

.PHONY: install typecheck lint test test-fast demo bench gpu-check clean

install: $(STAMP)

# one line per stage: pip is quiet, and the first stages take minutes
$(STAMP): pyproject.toml requirements-dev.txt Makefile
	@echo "make install: 1/4 the virtual environment $(VENV)/"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "make install: 2/4 $(TORCH) from $(if $(TORCH_INDEX),$(TORCH_INDEX),pip's configured index) (the largest download)"
	@$(PIP) $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@echo "make install: 3/4 the pinned tools of requirements-dev.txt (megatron-core, transformers, triton, ...)"
	@$(PIP) -r requirements-dev.txt
	@echo "make install: 4/4 cpslice itself, editable, with its extras"
	@$(PIP) -e '.[megatron,debug]'
	@touch $(STAMP)
	@echo "make install: done"

typecheck: install
	$(BIN)/mypy

lint: install
	$(BIN)/ruff check src tests benchmarks examples

test: install typecheck lint
	TRITON_INTERPRET=1 $(BIN)/pytest

# The inner loop: a few files of every area (the layout, the vocabulary engine with its
# Triton kernels, the command line, the project's gates, the glue with, last, its test on a
# gloo world of 2, whose ranks start in the background meanwhile), without the slow tests
# (`-m "not slow"`: those that wait for a background job or compile for long). Under a
# minute on two shared cores (README, Install); no type or lint gate. `make test` runs
# everything, as CI does.
FAST := tests/layout/test_recipes.py tests/layout/test_padded.py tests/layout/test_row_offsets.py \
        tests/vocabulary/test_entropy.py tests/cli/test_cli_plan.py tests/project tests/glue/test_debug.py
test-fast: install
	TRITON_INTERPRET=1 $(BIN)/pytest -m "not slow" $(FAST)

# Every layout end to end on 2 CP x 2 TP gloo ranks with megatron-core, against float64;
# then a tiny megatron-core GPTModel trained on 2 TP ranks from its hidden states; then
# GRPO steps of a small Hugging Face Llama on left-padded rows, and a shared-prefix
# batch through it against the same samples unshared.
demo: install
	$(BIN)/cpslice verify
	$(BIN)/python examples/train_tiny_gpt.py
	$(BIN)/python examples/hf_grpo_step.py
	$(BIN)/python examples/shared_prefix_grpo.py

bench: install
	$(BIN)/cpslice bench

# On a CUDA machine, from the repository's root, with the python3 that holds its CUDA torch
# (no .venv: cpslice runs from src/): every CUDA test natively and the GPU benchmarks, in
# under 8 minutes on an H200 (docs/numbers.md, "On a GPU"). GPU_CHECK passes options:
# `make gpu-check GPU_CHECK=--only=hidden`; without a GPU, `TRITON_INTERPRET=1 make gpu-check
# PYTHON=.venv/bin/python GPU_CHECK=--smoke` runs every stage on the CPU at tiny sizes.
gpu-check:
	PYTHONUNBUFFERED=1 PYTHONPATH=src:. $(PYTHON) -m benchmarks.gpu_check $(GPU_CHECK)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache src/*.egg-info
