# `make test` is the one command: it builds .venv/ from nothing when needed,
# then runs the type gate, the lint gate (ruff, complexity included) and the test suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.cpslice-installed

.PHONY: install typecheck lint test demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements-dev.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[megatron,debug]'
	touch $(STAMP)

typecheck: install
	$(BIN)/mypy

lint: install
	$(BIN)/ruff check src tests benchmarks examples

test: install typecheck lint
	TRITON_INTERPRET=1 $(BIN)/pytest

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

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache src/*.egg-info
